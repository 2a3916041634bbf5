"""Run a point's real training step on the local device: compile (through the analyzer's
engine), place the state and batches, time the steps; and the model FLOPs of a point."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax

from remat_kit import sharding as S
from remat_kit import targets as T
from remat_kit.data import Corpus
from remat_kit.memory.runner import CompileEngine
from remat_kit.models.config import ModelConfig
from remat_kit.sweep.config import Point
from remat_kit.training.step import (
    TrainState,
    abstract_batch,
    init_params,
    init_train_state,
    make_optimizer,
    make_train_step,
)


def param_counts(config: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters used in matmuls) of ``config``, from shapes only."""
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    total = matmul = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        n = math.prod(leaf.shape)
        total += n
        top = getattr(path[0], "key", str(path[0]))
        if top == "pos_embed" or (top == "embed" and not config.tied_embeddings):
            continue  # lookup tables: no matmul (a tied embedding is also the output matmul)
        matmul += n
    return total, matmul


def model_flops_per_token(config: ModelConfig, seq_len: int, matmul_params: int) -> float:
    """Training FLOPs per token, PaLM appendix B (Chowdhery et al. 2022, arXiv:2204.02311):
    ``6 N + 12 L H Q T`` with N the parameters used in matmuls, L layers, H query heads, Q head
    dimension, T = ``seq_len``. Forward plus backward, no recomputation; the attention term
    counts the full (unmasked) ``T x T`` scores, as the compiled attention computes them."""
    return 6.0 * matmul_params + 12.0 * config.num_layers * config.d_model * seq_len


def peak_bytes_in_use() -> int | None:
    """The largest ``peak_bytes_in_use`` over this process's devices (None: not reported)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and stats.get("peak_bytes_in_use") is not None:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def _device_batch(batcher: Any, step: int, sharding: Any) -> dict[str, jax.Array]:
    """Batch ``step`` (int32 [b, s] inputs and targets) placed as the compiled step takes it
    (``sharding``: its input shardings of the batch; on a mesh, split over (dp, fsdp), each
    process placing its own rows)."""
    inputs, targets = batcher.batch_at(step)
    batch = S.put_global({"inputs": inputs, "targets": targets}, sharding)
    return jax.block_until_ready(batch)


def host_state(point: Point, config: ModelConfig, cache: dict | None) -> TrainState:
    """The initial train state as host (numpy) arrays: the same values for every policy.

    Parameters do not depend on the remat policy, so the state is initialised once per model,
    optimizer and seed (one jitted init: flax's eager init compiles op by op) and kept on the
    host; each point copies it to the device (its step donates, i.e. consumes, the copy).
    """
    key = (
        config.replace(remat_policy="no-remat"),
        point.optimizer,
        point.learning_rate,
        point.seed,
    )
    host = None if cache is None else cache.get(key)
    if host is None:
        optimizer = make_optimizer(point.optimizer, learning_rate=point.learning_rate)
        init = jax.jit(lambda rng: init_train_state(key[0], optimizer, rng))
        host = jax.device_get(init(jax.random.key(point.seed)))
        if cache is not None:
            cache[key] = host
    return host


@dataclasses.dataclass
class _Step:
    """A point's run step for :meth:`CompileEngine.compile_all` (lowered already)."""

    what: str
    target: T.Target
    lower: Any
    program_key: str | None = None


def _lower_step(point: Point, state_cache: dict | None) -> tuple[Any, float]:
    """The point's training step (state donated) lowered for the local device(s), and the
    seconds it took. On one device the arguments carry the analyzer's single-device sharding
    (:func:`remat_kit.targets.abstract_sharding`), so the lowered program is the analyzer's
    when the policy and shapes are (the engine then compiles it once); on a mesh the step
    fixes its input and output shardings (the state is fed back each step)."""
    config = point.model_config()
    host = host_state(point, config, state_cache)
    optimizer = make_optimizer(point.optimizer, learning_rate=point.learning_rate)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
    batch = abstract_batch(point.batch_size, point.seq_len)
    t0 = time.perf_counter()
    if point.mesh is None:
        sharding = T.abstract_sharding(point.target)
        step = make_train_step(config, optimizer, donate=True)
        low = step.lower(T.abstractify(state, sharding), T.abstractify(batch, sharding))
    else:
        step = make_train_step(config, optimizer, donate=True, mesh=S.local_mesh(point.mesh))
        low = step.lower(state, batch)
    return low, time.perf_counter() - t0


def compile_steps(
    points: Sequence[Point],
    state_cache: dict | None = None,
    engine: CompileEngine | None = None,
) -> dict[str, tuple[Any, float, bool] | BaseException]:
    """Compile the real training step of each point for the local device, ahead of time.

    Each step (:func:`remat_kit.make_train_step`, state donated) is lowered in turn on the
    abstract shapes of the initial state and batch and compiled through ``engine``
    (:class:`remat_kit.memory.runner.CompileEngine`: a pool, identical programs once, full
    code-generation optimisation). A program the engine already holds (the analyzer's compile
    of the same step) is not compiled again.

    Returns:
      By point key: ``(compiled executable, seconds lowering it plus compiling it, whether the
      executable was the engine's already)``, or the exception lowering or compiling raised.
    """
    out: dict[str, Any] = {}
    steps, lower_s = [], {}
    with contextlib.nullcontext(engine) if engine else CompileEngine() as eng:
        for p in points:
            try:
                low, lower_s[p.key] = _lower_step(p, state_cache)
            except Exception as err:
                out[p.key] = err
                continue
            tgt = T.get_target(p.target)
            steps.append((p.key, _Step(f"the step of {p.label}", tgt, lambda low=low: low)))
        held = set(eng.held())
        results = eng.compile_all([s for _, s in steps], fast=False, executable=True)
        for (key, _), (program, result) in zip(steps, results, strict=True):
            if isinstance(result, BaseException):
                out[key] = result
            else:
                reused = program in held
                seconds = lower_s[key] + result.compile_s
                out[key] = (result.compiled, seconds, reused)
    return out


def measure_point(
    point: Point,
    compiled: Any,
    corpus: Corpus,
    state_cache: dict | None = None,
) -> dict[str, Any]:
    """Run ``warmup_steps + timed_steps`` training steps of ``point`` on ``corpus``; time them.

    The state starts from the point's initial state (:func:`compile_steps` made it, shared across
    policies through ``state_cache``) and is donated to each step. Batch ``i`` is
    ``corpus.batcher(b, s, seed).batch_at(i)``, moved to the device before its timer starts;
    each timed step ends with ``jax.block_until_ready`` on the new state and the metrics.

    Args:
      point: the point.
      compiled: its compiled step (from :func:`compile_steps`).
      corpus: the text (byte tokens).
      state_cache: the cache :func:`compile_steps` filled.

    Returns:
      ``step_times_s`` (wall seconds of the timed steps), ``step_time_s`` (their median),
      ``step_cpu_s`` (median process CPU seconds per timed step, all threads: robust to other
      processes on a shared machine), ``tokens_per_s`` (``b * s / step_time_s``), ``losses``
      (nats, every step), ``measured_peak_bytes`` (bytes, or None: see ``measured_peak_note``).

    Raises:
      FloatingPointError: a loss was not finite.
      Whatever JAX raises (out of memory: ``XlaRuntimeError`` ``RESOURCE_EXHAUSTED``).
    """
    host = host_state(point, point.model_config(), state_cache)
    # Laid out as the compiled step takes them: one device, or sharded over the point's mesh.
    (state_sharding, batch_sharding), _ = compiled.input_shardings
    state = jax.block_until_ready(S.put_global(host, state_sharding))
    batcher = corpus.batcher(point.batch_size, point.seq_len, seed=point.seed)
    before = peak_bytes_in_use()
    losses, times, cpu_times = [], [], []
    for i in range(point.warmup_steps + point.timed_steps):
        batch = _device_batch(batcher, i, batch_sharding)
        start, cpu_start = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        loss = float(metrics["loss"])
        losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss at step {i} is {loss}")
        if i >= point.warmup_steps:
            times.append(elapsed)
            cpu_times.append(cpu)
    del state
    median = statistics.median(times)
    return {
        "step_times_s": [round(t, 6) for t in times],
        "step_time_s": median,
        "step_cpu_times_s": [round(t, 6) for t in cpu_times],
        "step_cpu_s": statistics.median(cpu_times),
        "tokens_per_s": point.batch_size * point.seq_len / median,
        "losses": losses,
        **measured_peak(before),
    }


def measured_peak(before: int | None) -> dict[str, Any]:
    """``measured_peak_bytes`` (bytes: :func:`peak_bytes_in_use` now, when it rose above
    ``before``, the value read before the run; else None) and ``measured_peak_note`` (why)."""
    after = peak_bytes_in_use()
    if after is None:
        peak, note = None, f"the {jax.default_backend()} backend reports no peak_bytes_in_use"
    elif before is not None and after <= before:
        peak = None
        note = "peak_bytes_in_use did not rise above an earlier point's peak in this process"
    else:
        peak = int(after)
        note = "memory_stats()['peak_bytes_in_use'] after the point (largest over devices)"
    return {"measured_peak_bytes": peak, "measured_peak_note": note}
