"""Run a point's real training step on the local device: compile (through the analyzer's
engine), place the state and batches, time the steps; and the model FLOPs of a point."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from remat_kit import sharding as S
from remat_kit import targets as T
from remat_kit.memory.runner import CompileEngine
from remat_kit.models.config import ModelConfig
from remat_kit.sweep.config import Point
from remat_kit.training.data import Corpus
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
class RunStep:
    """A step to compile for a run, for :meth:`CompileEngine.compile_all`: ``lower`` returns it
    lowered for the local device(s); ``what`` names it in errors."""

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


def compile_run_steps(
    steps: dict[str, RunStep | BaseException],
    engine: CompileEngine | None = None,
    lower_s: dict[str, float] | None = None,
) -> dict[str, tuple[Any, float, bool] | BaseException]:
    """Compile the steps to run through ``engine`` (a pool, identical programs once, full
    code-generation optimisation; a new engine when None): a program the engine already holds
    (the analyzer's compile of the same step) is not compiled again.

    Args:
      steps: by key, the step, or the exception making it raised.
      lower_s: seconds spent lowering, by key, added to the compile's.

    Returns:
      By key: ``(compiled executable, seconds lowering it plus compiling it, whether the
      executable was the engine's already)``, or the exception lowering or compiling raised.
    """
    out: dict[str, Any] = {k: s for k, s in steps.items() if isinstance(s, BaseException)}
    todo = [(k, s) for k, s in steps.items() if not isinstance(s, BaseException)]
    with contextlib.nullcontext(engine) if engine else CompileEngine() as eng:
        held = set(eng.held())
        results = eng.compile_all([s for _, s in todo], fast=False, executable=True)
        for (key, _), (program, result) in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                out[key] = result
            else:
                seconds = (lower_s or {}).get(key, 0.0) + result.compile_s
                out[key] = (result.compiled, seconds, program in held)
    return {k: out[k] for k in steps}


def compile_steps(
    points: Sequence[Point],
    state_cache: dict | None = None,
    engine: CompileEngine | None = None,
    program_keys: Mapping[str, str | None] | None = None,
) -> dict[str, tuple[Any, float, bool] | BaseException]:
    """Compile the real training step of each point for the local device, ahead of time:
    each step (:func:`remat_kit.make_train_step`, state donated) lowered in turn on the
    abstract shapes of the initial state and batch and compiled by :func:`compile_run_steps`.

    Args:
      program_keys: by point key, the program its analysis compiled (the report's
        ``program_sha256``): on one device that program is the step that runs (the analyzer
        lowers the same step, state donated, with the same shardings), so where ``engine``
        holds its executable the step is neither traced nor compiled again.

    Returns:
      By point key, as :func:`compile_run_steps` (seconds: the analysis compile's, for a step
      taken from ``engine``).
    """
    steps: dict[str, RunStep | BaseException] = {}
    lower_s: dict[str, float] = {}
    held: dict[str, tuple[Any, float, bool]] = {}
    for p in points:
        found = engine.executable((program_keys or {}).get(p.key)) if engine else None
        if found is not None and p.mesh is None:
            held[p.key] = (found.compiled, found.compile_s, True)
            continue
        try:
            low, lower_s[p.key] = _lower_step(p, state_cache)
        except Exception as err:
            steps[p.key] = err
            continue
        tgt = T.get_target(p.target)
        steps[p.key] = RunStep(f"the step of {p.label}", tgt, lambda low=low: low)
    out = {**held, **compile_run_steps(steps, engine, lower_s)}
    return {p.key: out[p.key] for p in points}


class StepRun:
    """One program's steps, taken one at a time (:func:`time_runs`): ``warmup`` untimed then
    ``timed`` timed steps, each ended by ``jax.block_until_ready``. A failure (a non-finite
    loss, what JAX raises) ends the run and is kept. Subclasses give :meth:`prepare` (before
    step ``i``'s timer starts), :meth:`call` (the timed step) and :meth:`finish` (after the
    timer: the step's loss or None)."""

    def __init__(self, warmup: int, timed: int):
        self.warmup, self.steps = warmup, warmup + timed
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.error: BaseException | None = None

    def prepare(self, i: int) -> None:
        """Untimed work before step ``i`` (placing its batch)."""

    def call(self) -> Any:
        """Run one step to completion (``jax.block_until_ready``); its output."""
        raise NotImplementedError

    def finish(self, out: Any) -> float | None:
        """Keep what step's output ``out`` feeds the next step; its loss (None: no loss)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop the run's device state (after its last step or a failure)."""

    def step(self, i: int) -> None:
        """Run step ``i`` (a no-op past the last step or after a failure)."""
        if i >= self.steps or self.error is not None:
            return
        try:
            self.prepare(i)
            start, cpu_start = time.perf_counter(), time.process_time()
            out = self.call()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            loss = self.finish(out)
            if loss is not None:
                self.losses.append(loss)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss at step {i} is {loss}")
        except Exception as err:
            self.error = err
            self.release()
            return
        if i >= self.warmup:
            self.times.append(elapsed)
            self.cpu_times.append(cpu)
        if i == self.steps - 1:
            self.release()  # its device memory goes now, not after the other runs

    def result(self) -> dict[str, Any]:
        """``step_times_s`` (wall seconds of the timed steps), ``step_time_s`` (their median),
        ``step_cpu_times_s`` / ``step_cpu_s`` (process CPU seconds, all threads), ``losses``.

        Raises:
          The exception that ended the run.
        """
        if self.error is not None:
            raise self.error
        return {
            "step_times_s": [round(t, 6) for t in self.times],
            "step_time_s": statistics.median(self.times),
            "step_cpu_times_s": [round(t, 6) for t in self.cpu_times],
            "step_cpu_s": statistics.median(self.cpu_times),
            "losses": self.losses,
        }


class _Run(StepRun):
    """A point's training steps: its state on the device, its batches from the corpus."""

    def __init__(self, point: Point, compiled: Any, corpus: Corpus, state_cache: dict | None):
        super().__init__(point.warmup_steps, point.timed_steps)
        self.point, self.compiled = point, compiled
        host = host_state(point, point.model_config(), state_cache)
        # Laid out as the compiled step takes them: one device, or sharded over the point's mesh.
        (state_sharding, self.batch_sharding), _ = compiled.input_shardings
        self.state = jax.block_until_ready(S.put_global(host, state_sharding))
        self.batcher = corpus.batcher(point.batch_size, point.seq_len, seed=point.seed)
        self.batch: Any = None

    def prepare(self, i: int) -> None:
        self.batch = _device_batch(self.batcher, i, self.batch_sharding)

    def call(self) -> Any:
        return jax.block_until_ready(self.compiled(self.state, self.batch))

    def finish(self, out: Any) -> float:
        self.state, metrics = out
        return float(metrics["loss"])

    def release(self) -> None:
        self.state = self.batch = None

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["tokens_per_s"] = self.point.batch_size * self.point.seq_len / out["step_time_s"]
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
      (nats, every step), ``measured_peak_bytes`` (bytes, or None: see ``measured_peak_note``),
      ``step_order`` (``"alone"``).

    Raises:
      FloatingPointError: a loss was not finite.
      Whatever JAX raises (out of memory: ``XlaRuntimeError`` ``RESOURCE_EXHAUSTED``).
    """
    (out,) = time_runs([lambda: _Run(point, compiled, corpus, state_cache)], interleave=False)
    if isinstance(out, BaseException):
        raise out
    return out


def can_interleave(points: Sequence[Any], state_bytes: Sequence[int]) -> bool:
    """Whether the steps of ``points`` (points or policies) may be timed interleaved: the local
    backend reports no per-program peak (:func:`peak_bytes_in_use` is None, as on the CPU:
    nothing to measure alone) and their states (``state_bytes``, bytes each) fit in half the
    host's memory together (``os.sysconf``), in a single process (the processes of a
    multi-process run must run their steps in one order; each host's memory is its own). On a
    GPU each point runs alone, so its measured peak is its own."""
    if len(points) < 2 or jax.process_count() > 1 or peak_bytes_in_use() is not None:
        return False
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return sum(state_bytes) <= memory // 2


def time_runs(
    makers: Sequence[Callable[[], StepRun]], interleave: bool
) -> list[dict[str, Any] | BaseException]:
    """Time each run ``makers`` make (:class:`StepRun`): one after the other, each made just
    before its steps; or with ``interleave`` (see :func:`can_interleave`) every run made
    first and step ``i`` of every run taken before step ``i + 1`` of any, the order rotating
    by one run each step: a drift of the machine's speed (other processes, clocks) then falls
    on every policy alike instead of on whichever ran during it (on a shared 2-core VM, one
    program timed twice a minute apart differed by up to 12%).

    Returns:
      Per run, in order: :meth:`StepRun.result` with ``measured_peak_bytes`` /
      ``measured_peak_note`` and ``step_order`` (``"alone"`` / ``"interleaved"``), or the
      exception making or running it raised.
    """
    results: list[dict[str, Any] | BaseException] = []
    if not interleave:
        for make in makers:
            before = peak_bytes_in_use()
            try:
                run = make()
                for i in range(run.steps):
                    run.step(i)
                results.append({
                    **run.result(), **measured_peak(before), "step_order": "alone",
                    "load_average": load_average(),
                })  # fmt: skip
            except Exception as err:
                results.append(err)
        return results
    runs: list[StepRun | BaseException] = []
    for make in makers:
        try:
            runs.append(make())
        except Exception as err:
            runs.append(err)
    live = [r for r in runs if isinstance(r, StepRun)]
    for i in range(max((r.steps for r in live), default=0)):
        k = i % len(live)
        for run in live[k:] + live[:k]:
            run.step(i)
    # can_interleave: the backend reports no peak, so none is mixed (the note says it)
    peak = {**measured_peak(None), "step_order": "interleaved", "load_average": load_average()}
    for run in runs:
        try:
            if isinstance(run, BaseException):
                raise run
            results.append({**run.result(), **peak})
        except Exception as err:
            results.append(err)
    return results


def load_average() -> list[float] | None:
    """The machine's 1-, 5- and 15-minute load averages (``os.getloadavg``) right after a
    point's steps were timed: other work on the cores slows them (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def measure_points(
    points: Sequence[Point],
    compiled: Sequence[Any],
    corpus: Corpus,
    state_cache: dict | None = None,
    interleave: bool = False,
) -> list[dict[str, Any] | BaseException]:
    """:func:`measure_point` for each point (``compiled``: its executable), timed by
    :func:`time_runs` (``interleave``: see :func:`can_interleave`). Interleaved rows say
    ``step_order: "interleaved"``.

    Returns:
      Per point, in order: the measurement, or the exception its run raised.
    """
    makers = [
        functools.partial(_Run, p, c, corpus, state_cache)
        for p, c in zip(points, compiled, strict=True)
    ]
    return time_runs(makers, interleave)


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
