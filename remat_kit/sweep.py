"""Sweep remat policies over a grid; analyse every point, measure the ones on the local device.

A :class:`SweepConfig` is one or more :class:`Grid` s, each the product

    model presets x policies x batch sizes x sequence lengths x remat_group_size x targets

(with ModelConfig ``overrides`` applied to every model, e.g. ``scan_layers=True``). For every
point (:class:`Point`) :func:`run_sweep`

1. analyses the step with :func:`remat_kit.memory.api_policies` (the compiled peak, residuals
   by checkpoint name, compiled FLOPs), all policies of one model/shape/target together;
2. when the target is the local device and the grid asks for it, runs the real training step
   (optax AdamW, train state donated) on real text: ``warmup_steps`` untimed then
   ``timed_steps`` timed steps, each ended by ``jax.block_until_ready``; records the median step
   time, tokens per second, model FLOPs utilisation where the device's peak FLOP/s is known, the
   measured peak memory (``memory_stats()["peak_bytes_in_use"]`` where the backend gives it,
   ``None`` otherwise: the CPU backend gives none) and every loss;
3. appends the row to a JSONL file (:mod:`remat_kit.results`) as soon as the point finishes.

A failure at one point (out of memory, compile error, anything raised) becomes a row with status
``oom`` or ``error`` and the message; the sweep goes on. ``resume=True`` skips points whose
key is already in the file, so a killed sweep loses at most the point in progress.

Model FLOPs follow PaLM (Chowdhery et al. 2022, arXiv:2204.02311, appendix B): per token
``6 N + 12 L H Q T`` (N parameters used in matmuls, L layers, H heads, Q head dimension, T
sequence length); recomputation is not counted, so a remat policy lowers the MFU it reaches.

Example::

    from remat_kit.sweep import Grid, SweepConfig, run_sweep

    cfg = SweepConfig("mine", grids=(Grid("measured", models=("tiny-gpt",),
                      policies=("no-remat", "save-nothing"), seq_lens=(64,)),))
    run = run_sweep(cfg, "out/sweep.jsonl")
    print(run.rows[0]["peak_bytes"], run.rows[0]["step_time_s"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from remat_kit import names as N
from remat_kit import results as R
from remat_kit import sharding as S
from remat_kit import targets as T
from remat_kit.data import Corpus, load_corpus
from remat_kit.models.config import ModelConfig, get_config, preset_names
from remat_kit.policies import policy_names
from remat_kit.train import (
    OPTIMIZERS,
    TrainState,
    abstract_batch,
    init_params,
    init_train_state,
    make_optimizer,
    make_train_step,
)

__all__ = [
    "ALL_POLICIES",
    "Grid",
    "Point",
    "SweepConfig",
    "SweepRun",
    "load_config",
    "model_flops_per_token",
    "compile_steps",
    "measure_point",
    "run_sweep",
    "validate",
]

#: Every registered policy name, in registry order.
ALL_POLICIES: tuple[str, ...] = tuple(policy_names())

_OOM_MARKERS = ("resource_exhausted", "out of memory", "oom when allocating", "ran out of memory")


# -- Configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Grid:
    """One grid of points: the product of its tuples.

    Attributes:
      name: a label stored in each row (``"measured"``, ``"analysis"``).
      models: preset names (:func:`remat_kit.preset_names`).
      policies: policy names (:func:`remat_kit.policy_names`); :data:`ALL_POLICIES` for all.
      batch_sizes: sequences per step (b).
      seq_lens: tokens per sequence (s); each at most the model's ``max_seq_len``.
      remat_group_sizes: blocks per remat segment (each must divide ``num_layers``).
      targets: target names (:func:`remat_kit.targets.target_names`): ``local`` is the machine's
        own device; GPU models (``h100-sxm``) are compiled deviceless, analysis only.
      overrides: ModelConfig fields applied to every model (``{"scan_layers": True}``).
      measure: run the real step at points whose target is the local device.
      warmup_steps: untimed steps before timing (compilation happens before them).
      timed_steps: steps timed, one ``block_until_ready`` each; the median is reported.
      optimizer: ``adamw``, ``sgd`` or ``adafactor`` (:func:`remat_kit.make_optimizer`).
      learning_rate: the optimizer's learning rate.
      seed: parameter initialisation and batch order seed.
      mesh: a (dp, fsdp, tp) mesh (:mod:`remat_kit.sharding`), ``"fsdp=4"`` or
        ``"dp=2,fsdp=2,tp=2"``: local points run on it (its product must be
        ``jax.device_count()``, every process's devices), GPU targets are analysed on that many
        GPUs; figures are per device. ``None``: local points run data parallel over every
        device (one device: no mesh), GPU targets are analysed on one GPU.
    """

    name: str
    models: tuple[str, ...]
    policies: tuple[str, ...] = ALL_POLICIES
    batch_sizes: tuple[int, ...] = (8,)
    seq_lens: tuple[int, ...] = (128,)
    remat_group_sizes: tuple[int, ...] = (1,)
    targets: tuple[str, ...] = ("local",)
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    measure: bool = True
    warmup_steps: int = 2
    timed_steps: int = 5
    optimizer: str = "adamw"
    learning_rate: float = 3e-4
    seed: int = 0
    mesh: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (tuples become lists; ``mesh`` left out when None, so configs written
        before meshes existed keep their fingerprint)."""
        d = dataclasses.asdict(self)
        d["overrides"] = dict(sorted(dict(self.overrides).items()))
        if d["mesh"] is None:
            del d["mesh"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A named sweep: one or more grids, run in order.

    Attributes:
      name: names the results folder (``experiments/results/<name>/``) and is stored in rows.
      grids: the grids; their points are run in order, policy varying fastest.
      description: one line for the log.
    """

    name: str
    grids: tuple[Grid, ...]
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "grids": [g.to_dict() for g in self.grids],
        }

    def fingerprint(self, data: str | os.PathLike[str] | None = None) -> str:
        """:func:`remat_kit.results.fingerprint` of this config and the data argument."""
        return R.fingerprint({**self.to_dict(), "data": None if data is None else str(data)})

    def points(self) -> list[Point]:
        """Every point, validated, in run order (grid, model, target, group size, batch,
        sequence length, then policy).

        Raises:
          ValueError: see :func:`validate`.
        """
        validate(self)
        local_kind = _local_kind()
        out = []
        for g in self.grids:
            for model, target, group, b, s, policy in _product(g):
                mesh = _point_mesh(g, target, b, local_kind)
                out.append(
                    Point(
                        grid=g.name,
                        model=model,
                        policy=policy,
                        batch_size=b,
                        seq_len=s,
                        remat_group_size=group,
                        target=target,
                        overrides=tuple(sorted(dict(g.overrides).items())),
                        measure=g.measure and _is_local(target, local_kind),
                        warmup_steps=g.warmup_steps,
                        timed_steps=g.timed_steps,
                        optimizer=g.optimizer,
                        learning_rate=g.learning_rate,
                        seed=g.seed,
                        mesh=mesh,
                    )
                )
        keys = [p.key for p in out]
        if len(set(keys)) != len(keys):
            dup = next(p for p in out if keys.count(p.key) > 1)
            raise ValueError(f"sweep {self.name!r} lists point {dup.label} twice")
        return out


def _point_mesh(g: Grid, target: str, batch_size: int, local_kind: str) -> str | None:
    """The mesh a point runs or is analysed on (see :attr:`Grid.mesh`), as ``MeshSpec`` text;
    None for one device without a mesh."""
    local = _is_local(target, local_kind)
    if g.mesh is not None:
        spec = S.parse_mesh(g.mesh)
        if local:
            try:
                S.local_mesh(spec)  # raises unless the mesh has every device of the run
            except ValueError as err:
                raise _in(f"grid {g.name!r}", err) from None
    elif local and jax.device_count() > 1:
        spec = S.parse_mesh(None, jax.device_count())
    else:
        return None
    split = spec.dp * spec.fsdp
    if batch_size % split:
        default = " (data parallel over every device: the default)" if g.mesh is None else ""
        raise ValueError(
            f"grid {g.name!r}: batch size {batch_size} does not split over dp*fsdp={split} "
            f"devices of mesh {spec}{default}; use a multiple of {split}, another mesh "
            "(--mesh, e.g. tp=N), or fewer devices (CUDA_VISIBLE_DEVICES=0 for one GPU)"
        )
    return str(spec)


def _product(g: Grid) -> Iterator[tuple]:
    for model in g.models:
        for target in g.targets:
            for group in g.remat_group_sizes:
                for b in g.batch_sizes:
                    for s in g.seq_lens:
                        for policy in g.policies:
                            yield model, target, group, b, s, policy


@dataclasses.dataclass(frozen=True)
class Point:
    """One point of a sweep: a model, a policy, a shape, a target, what to measure."""

    grid: str
    model: str
    policy: str
    batch_size: int
    seq_len: int
    remat_group_size: int
    target: str
    overrides: tuple[tuple[str, Any], ...]
    measure: bool
    warmup_steps: int
    timed_steps: int
    optimizer: str
    learning_rate: float
    seed: int
    mesh: str | None = None  # MeshSpec text ("dp=2,fsdp=1,tp=1"); None: one device

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``mesh`` left out when None (keys of one-device points unchanged)."""
        d = dataclasses.asdict(self)
        d["overrides"] = dict(self.overrides)
        if d["mesh"] is None:
            del d["mesh"]
        return d

    @property
    def key(self) -> str:
        """:func:`remat_kit.results.point_key` of :meth:`to_dict`."""
        return R.point_key(self.to_dict())

    @property
    def label(self) -> str:
        g = f" k={self.remat_group_size}" if self.remat_group_size != 1 else ""
        m = f" [{self.mesh}]" if self.mesh else ""
        return (
            f"{self.model} b={self.batch_size} s={self.seq_len}{g}{m} {self.policy} @{self.target}"
        )

    def model_config(self) -> ModelConfig:
        """The preset with the policy, group size and overrides applied (validated)."""
        return get_config(
            self.model,
            remat_policy=self.policy,
            remat_group_size=self.remat_group_size,
            **dict(self.overrides),
        )

    @property
    def group(self) -> tuple:
        """Points of one group differ only in the policy; they are analysed together."""
        d = self.to_dict()
        d.pop("policy")
        return tuple(sorted((k, repr(v)) for k, v in d.items()))


def _local_kind() -> str:
    return jax.default_backend()


def _is_local(target: str, local_kind: str) -> bool:
    name = T.get_target(target).name
    return name == T.LOCAL or (name == "cpu" and local_kind == "cpu")


def _positive_ints(label: str, values: Any) -> None:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{label} must be a non-empty tuple, got {values!r}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{label} must hold positive integers, got {v!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{label} lists a value twice: {values!r}")


def validate(config: SweepConfig) -> None:
    """Check a sweep config without compiling anything.

    Raises:
      ValueError: no grids or an unnamed grid; an unknown preset, policy, target, optimizer or
        ModelConfig field (message lists the valid names and the closest match); an empty tuple,
        a repeated value, a non-positive batch size, sequence length, group size or step count;
        a sequence longer than the model's ``max_seq_len``; a group size not dividing the
        layers; a GPU target without JAX's CUDA plugin installed.
    """
    if not isinstance(config, SweepConfig):
        raise ValueError(f"a sweep config must be a SweepConfig, got {type(config).__name__}")
    if not config.name or not isinstance(config.name, str):
        raise ValueError(f"sweep name must be a non-empty string, got {config.name!r}")
    if not config.grids or not isinstance(config.grids, tuple):
        raise ValueError(f"sweep {config.name!r} needs a non-empty tuple of grids")
    names = [g.name for g in config.grids]
    if len(set(names)) != len(names):
        raise ValueError(f"sweep {config.name!r}: grid names repeat: {names}")
    for g in config.grids:
        where = f"grid {g.name!r}"
        if not isinstance(g.models, tuple) or not g.models:
            raise ValueError(f"{where}: models must be a non-empty tuple, got {g.models!r}")
        if not isinstance(g.policies, tuple) or not g.policies:
            raise ValueError(f"{where}: policies must be a non-empty tuple, got {g.policies!r}")
        for m in g.models:
            if m not in preset_names():
                raise _in(where, N.unknown_value_error("preset", m, preset_names()))
        for p in g.policies:
            if p not in ALL_POLICIES:
                raise _in(where, N.unknown_value_error("policy", p, list(ALL_POLICIES)))
        for label in ("batch_sizes", "seq_lens", "remat_group_sizes"):
            _positive_ints(f"{where}: {label}", getattr(g, label))
        if len(set(g.models)) != len(g.models) or len(set(g.policies)) != len(g.policies):
            raise ValueError(f"{where}: a model or policy is listed twice")
        if not isinstance(g.targets, tuple) or not g.targets:
            raise ValueError(f"{where}: targets must be a non-empty tuple, got {g.targets!r}")
        for t in g.targets:
            try:
                target = T.get_target(t)
            except ValueError as err:
                raise _in(where, err) from None
            if target.gpu is not None and T.cuda_plugin_module() is None:
                raise ValueError(
                    f"{where}: target {t!r} is compiled deviceless and needs JAX's CUDA plugin: "
                    "pip install 'remat-kit[cuda12]', or drop the target"
                )
        if g.optimizer not in OPTIMIZERS:
            raise _in(where, N.unknown_value_error("optimizer", g.optimizer, OPTIMIZERS))
        if not isinstance(g.warmup_steps, int) or g.warmup_steps < 0:
            raise ValueError(f"{where}: warmup_steps must be >= 0, got {g.warmup_steps!r}")
        if not isinstance(g.timed_steps, int) or g.timed_steps < 1:
            raise ValueError(f"{where}: timed_steps must be >= 1, got {g.timed_steps!r}")
        if not (isinstance(g.learning_rate, (int, float)) and g.learning_rate > 0):
            raise ValueError(f"{where}: learning_rate must be > 0, got {g.learning_rate!r}")
        if not isinstance(g.measure, bool):
            raise ValueError(f"{where}: measure must be True or False, got {g.measure!r}")
        if g.mesh is not None:
            try:
                S.parse_mesh(g.mesh)
            except ValueError as err:
                raise _in(where, err) from None
        if not isinstance(g.overrides, Mapping):
            raise ValueError(f"{where}: overrides must be a mapping, got {g.overrides!r}")
        for bad in ("remat_policy", "remat_group_size"):
            if bad in g.overrides:
                raise ValueError(f"{where}: set {bad} through the grid, not overrides")
        for m in g.models:
            for k in g.remat_group_sizes:
                try:
                    cfg = get_config(m, remat_group_size=k, **dict(g.overrides))
                except ValueError as err:
                    raise _in(f"{where}, model {m!r}", err) from None
                longest = max(g.seq_lens)
                if longest > cfg.max_seq_len:
                    raise ValueError(
                        f"{where}: seq_len {longest} exceeds max_seq_len={cfg.max_seq_len} of "
                        f"{m!r}; use shorter sequences or overrides={{'max_seq_len': {longest}}}"
                    )


def _in(where: str, err: ValueError) -> ValueError:
    return ValueError(f"{where}: {err}")


def load_config(path: str | os.PathLike[str]) -> SweepConfig:
    """Load a sweep config file: a Python module whose ``get_config()`` returns a
    :class:`SweepConfig` (the big_vision layout), validated.

    Raises:
      ValueError: the file does not exist, fails to run (the message gives the exception's
        first line), has no ``get_config``, or the config is invalid (see :func:`validate`).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"sweep config {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_remat_kit_sweep_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        make = getattr(module, "get_config", None)
        if make is None:
            raise ValueError("it defines no get_config()")
        config = make()
    except Exception as err:  # a config with a typo: one line, not a traceback
        raise ValueError(f"sweep config {str(path)!r}: {_message(err)}") from None
    validate(config)
    return config


# -- FLOPs ------------------------------------------------------------------------------------


def _param_counts(config: ModelConfig) -> tuple[int, int]:
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


# -- Running ---------------------------------------------------------------------------------


@dataclasses.dataclass
class SweepRun:
    """What :func:`run_sweep` did.

    Attributes:
      path: the results file.
      rows: every row of this config now in the file (earlier runs' included), in point order.
      new_rows: rows written by this call.
      skipped: points skipped because their key was already in the file (``resume``).
      wall_s: seconds this call took.
    """

    path: Path
    rows: list[dict[str, Any]]
    new_rows: list[dict[str, Any]]
    skipped: int
    wall_s: float


def _prepare_output(path: Path, fingerprint: str, resume: bool, overwrite: bool) -> dict:
    """Check the output can be written and return the rows already there (by key)."""
    if resume and overwrite:
        raise ValueError("pass --resume or --overwrite, not both")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder")
        with open(path, "a", encoding="utf-8"):
            pass
        if not os.access(path, os.W_OK):
            raise PermissionError("not writable")
    except OSError as err:
        raise ValueError(f"cannot write results to {str(path)!r}: {err}") from None
    rows = R.read_rows(path)
    if rows and overwrite:
        with open(path, "w", encoding="utf-8") as f:
            f.flush()
            os.fsync(f.fileno())
        return {}
    if rows and not resume:
        raise ValueError(
            f"{path} already holds {len(rows)} row(s); pass --resume to continue that sweep, "
            "--overwrite to start again, or --out for a new file"
        )
    R.check_resumable(rows, fingerprint, str(path))
    R.repair(path)
    return {r["key"]: r for r in rows if "key" in r}


def _classify(err: BaseException) -> str:
    text = f"{type(err).__name__} {err}".lower()
    return "oom" if any(m in text for m in _OOM_MARKERS) else "error"


def _message(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:2000]


def _peak_bytes_in_use() -> int | None:
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


def _mesh(point: Point) -> Mesh | None:
    """The point's mesh over every device of the run, or None (one device)."""
    return None if point.mesh is None else S.local_mesh(point.mesh)


def _device_batch(batcher: Any, step: int, sharding: Any) -> dict[str, jax.Array]:
    """Batch ``step`` (int32 [b, s] inputs and targets) placed as the compiled step takes it
    (``sharding``: its input shardings of the batch; on a mesh, split over (dp, fsdp), each
    process placing its own rows)."""
    inputs, targets = batcher.batch_at(step)
    batch = S.put_global({"inputs": inputs, "targets": targets}, sharding)
    return jax.block_until_ready(batch)


def _host_state(point: Point, config: ModelConfig, cache: dict | None) -> TrainState:
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


def compile_steps(
    points: Sequence[Point], state_cache: dict | None = None, workers: int | None = None
) -> dict[str, tuple[Any, float] | BaseException]:
    """Compile the real training step of each point for the local device, ahead of time.

    Each step (:func:`remat_kit.make_train_step`, state donated) is lowered in turn on the
    abstract shapes of the initial state and batch, then the lowered programs compile
    ``workers`` at a time (default ``min(4, cpu_count)``; XLA's compile releases the GIL, so the
    cores are used while nothing is being timed). Identical programs compile once.

    Returns:
      By point key: ``(compiled executable, seconds spent lowering and compiling it)``, or the
      exception lowering or compiling raised.
    """

    def compile_one(low: Any) -> tuple[Any, float] | BaseException:
        t0 = time.perf_counter()
        try:
            return low.compile(), time.perf_counter() - t0
        except Exception as err:
            return err

    out: dict[str, Any] = {}
    lowered: dict[str, tuple[float, str]] = {}
    futures: dict[str, Any] = {}  # program hash -> future of its compile
    n = max(1, workers or min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=n) as pool:
        for p in points:  # lower in turn (Python, holds the GIL) while earlier ones compile
            try:
                config = p.model_config()
                host = _host_state(p, config, state_cache)
                state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
                optimizer = make_optimizer(p.optimizer, learning_rate=p.learning_rate)
                t0 = time.perf_counter()
                low = make_train_step(config, optimizer, donate=True, mesh=_mesh(p)).lower(
                    state, abstract_batch(p.batch_size, p.seq_len)
                )
                text_key = hashlib.sha256(low.as_text().encode()).hexdigest()
                lowered[p.key] = (time.perf_counter() - t0, text_key)
                if text_key not in futures:
                    futures[text_key] = pool.submit(compile_one, low)
            except Exception as err:
                out[p.key] = err
        for key, (lower_s, text_key) in lowered.items():
            result = futures[text_key].result()
            out[key] = (
                result if isinstance(result, BaseException) else (result[0], lower_s + result[1])
            )
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
    host = _host_state(point, point.model_config(), state_cache)
    # Laid out as the compiled step takes them: one device, or sharded over the point's mesh.
    (state_sharding, batch_sharding), _ = compiled.input_shardings
    state = jax.block_until_ready(S.put_global(host, state_sharding))
    batcher = corpus.batcher(point.batch_size, point.seq_len, seed=point.seed)
    before = _peak_bytes_in_use()
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
    after = _peak_bytes_in_use()
    if after is None:
        peak, note = None, f"the {jax.default_backend()} backend reports no peak_bytes_in_use"
    elif before is not None and after <= before:
        peak = None
        note = "peak_bytes_in_use did not rise above an earlier point's peak in this process"
    else:
        peak = int(after)
        note = "memory_stats()['peak_bytes_in_use'] after the point (largest over devices)"
    median = statistics.median(times)
    return {
        "step_times_s": [round(t, 6) for t in times],
        "step_time_s": median,
        "step_cpu_times_s": [round(t, 6) for t in cpu_times],
        "step_cpu_s": statistics.median(cpu_times),
        "tokens_per_s": point.batch_size * point.seq_len / median,
        "losses": losses,
        "measured_peak_bytes": peak,
        "measured_peak_note": note,
    }


#: Row fields from the point's model and analysis (None in a row whose analysis failed).
_ANALYSIS_KEYS = (
    "model_config", "num_params", "matmul_params", "tokens_per_step", "model_flops_per_step",
    "dtype",
    "peak_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "host_bytes",
    "params_bytes", "opt_state_bytes", "activation_bytes", "offloaded_bytes", "flops",
    "flops_no_remat", "recompute_ratio", "memory_bytes", "fits", "analysis_compile_s",
    "warnings", "report",
)  # fmt: skip
#: Row fields from running the step (None in an analysis-only or failed row).
_MEASURED_KEYS = (
    "compile_s", "step_times_s", "step_time_s", "step_cpu_times_s", "step_cpu_s",
    "tokens_per_s", "losses", "measured_peak_bytes", "measured_peak_note", "mfu", "peak_error",
)  # fmt: skip


def _analysis_fields(report: Any) -> dict[str, Any]:
    return {
        "peak_bytes": report.peak_bytes,
        "argument_bytes": report.argument_bytes,
        "output_bytes": report.output_bytes,
        "temp_bytes": report.temp_bytes,
        "alias_bytes": report.alias_bytes,
        "host_bytes": report.host_bytes,
        "params_bytes": report.arguments.get("params"),
        "opt_state_bytes": report.arguments.get("opt_state"),
        "activation_bytes": report.activation_bytes,
        "offloaded_bytes": report.offloaded_bytes,
        "flops": report.flops,
        "flops_no_remat": report.flops_no_remat,
        "recompute_ratio": report.recompute_ratio,
        "memory_bytes": report.memory_bytes,
        "fits": report.fits,
        "analysis_compile_s": report.compile_s,
        "warnings": list(report.warnings),
    }


def _analyze_group(points: Sequence[Point]) -> dict[str, Any]:
    """Reports (or the exception) of every point of one group, by point key."""
    from remat_kit.memory import analyze_policies

    p0 = points[0]
    try:
        out = analyze_policies(
            p0.model_config(),
            p0.batch_size,
            p0.seq_len,
            [p.policy for p in points],
            target=p0.target,
            optimizer=make_optimizer(p0.optimizer, learning_rate=p0.learning_rate),
            raise_errors=False,
            mesh=p0.mesh,
        )
    except Exception as err:  # the whole group failed: every point gets the error
        out = [err] * len(points)
    return {p.key: r for p, r in zip(points, out, strict=True)}


def _run_point(
    point: Point,
    report: Any,
    corpus: Corpus | None,
    common: Mapping[str, Any],
    param_counts: dict[tuple, tuple[int, int]],
    executable: Any,
    state_cache: dict,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    row: dict[str, Any] = {
        "format": R.ROW_FORMAT,
        "key": point.key,
        **common,
        **point.to_dict(),
        "status": "ok",
        "error": None,
    }
    row.update(dict.fromkeys(_ANALYSIS_KEYS))
    measured: dict[str, Any] = dict.fromkeys(_MEASURED_KEYS)
    try:
        if isinstance(report, BaseException):
            raise report
        config = point.model_config()
        count_key = (point.model, point.overrides)
        if count_key not in param_counts:
            param_counts[count_key] = _param_counts(config)
        total, matmul = param_counts[count_key]
        tokens = point.batch_size * point.seq_len
        model_flops = model_flops_per_token(config, point.seq_len, matmul) * tokens
        row.update(
            num_params=total,
            matmul_params=matmul,
            tokens_per_step=tokens,
            model_flops_per_step=model_flops,
            dtype=config.dtype,
            model_config=dataclasses.asdict(config),
        )
        row.update(_analysis_fields(report))
        row["report"] = report.to_dict()
        if point.measure:
            if isinstance(executable, BaseException):
                raise executable
            compiled, measured["compile_s"] = executable[0], round(executable[1], 3)
            measured.update(measure_point(point, compiled, corpus, state_cache))
            peak_flops = T.get_target(point.target).peak_flops_bf16
            if peak_flops and config.dtype == "bfloat16":  # over every device of the mesh
                devices = S.parse_mesh(point.mesh).num_devices if point.mesh else 1
                measured["mfu"] = model_flops / measured["step_time_s"] / (peak_flops * devices)
            if measured["measured_peak_bytes"]:
                measured["peak_error"] = report.peak_bytes / measured["measured_peak_bytes"] - 1
    except Exception as err:
        row["status"] = _classify(err)
        row["error"] = _message(err)
    row.update(measured)
    row["point_s"] = round(time.perf_counter() - t0, 3)
    row["time"] = R.now_utc()
    return row


def run_sweep(
    config: SweepConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    overwrite: bool = False,
    data: str | os.PathLike[str] | None = None,
    max_data_bytes: int | None = None,
    progress: bool = True,
    console: Any = None,
    before_point: Callable[[Point], None] | None = None,
) -> SweepRun:
    """Run every point of ``config`` not yet in ``out``; append one row per point.

    Everything that can be checked is checked before anything compiles: the config
    (:func:`validate`), the output file (writable; from the same config when resuming), the
    data (when a point is measured).

    Args:
      config: the sweep.
      out: the JSONL results file (created with its folders).
      resume: skip points whose key is already in ``out`` (a torn last line is dropped first).
      overwrite: empty ``out`` first.
      data: text file or folder for measured points; ``None``: the Python standard library's
        source (:func:`remat_kit.data.load_corpus`).
      max_data_bytes: cap on the corpus size in bytes (``None``: the loader's default).
      progress: show a rich progress bar (point being run, ETA).
      console: a ``rich.console.Console`` for the bar (default: a new one on stderr).
      before_point: called with each point before its group (the points differing only in the
        policy) is analysed; an exception it raises becomes that point's ``error`` row and the
        point is neither analysed nor run (used to test fault handling).

    Returns:
      A :class:`SweepRun`.

    Raises:
      ValueError: an invalid config; ``out`` not writable; ``out`` holding rows without
        ``resume`` or ``overwrite``, or rows of another config; a missing, empty or binary
        ``data`` path.
    """
    start = time.perf_counter()
    points = config.points()
    path = Path(out)
    fingerprint = config.fingerprint(data)
    corpus = None
    if any(p.measure for p in points):  # a bad data path fails before the output is touched
        corpus = load_corpus(data, max_bytes=max_data_bytes)
    primary = jax.process_index() == 0
    # Several processes (jax.distributed) run every point together; process 0 owns the file.
    done: dict | ValueError = {}
    if primary:
        try:
            done = _prepare_output(path, fingerprint, resume, overwrite)
        except ValueError as err:
            done = err
    todo = _agreed_todo(points, done)
    if not any(p.measure for p in todo):
        corpus = None
    common = {
        "sweep": config.name,
        "config_fingerprint": fingerprint,
        **R.environment(),
        **(corpus.info() if corpus is not None else {}),
    }
    new_rows: list[dict[str, Any]] = []
    groups: dict[tuple, list[Point]] = {}
    for p in todo:
        groups.setdefault(p.group, []).append(p)
    param_counts: dict[tuple, tuple[int, int]] = {}
    state_cache: dict = {}
    with _progress(progress and primary, console, len(todo)) as advance:
        for members in groups.values():
            failed: dict[str, BaseException] = {}
            for p in members:
                try:
                    if before_point is not None:
                        before_point(p)
                except Exception as err:
                    failed[p.key] = err
            live = [p for p in members if p.key not in failed]
            what = members[0].label.rsplit(" ", 2)[0]
            advance(None, f"analysing {what} ({len(live)} policies)")
            reports = {**failed, **(_analyze_group(live) if live else {})}
            to_run = [p for p in live if p.measure and not isinstance(reports[p.key], Exception)]
            if to_run:
                advance(None, f"compiling {len(to_run)} steps of {what}")
            executables = compile_steps(to_run, state_cache)
            for p in members:
                advance(None, p.label)
                row = _run_point(
                    p,
                    reports[p.key],
                    corpus,
                    common,
                    param_counts,
                    executables.get(p.key),
                    state_cache,
                )
                if primary:
                    R.append_row(path, row)
                new_rows.append(row)
                advance(1, p.label)
            del executables
    by_key = {**done, **{r["key"]: r for r in new_rows}}
    rows = [by_key[p.key] for p in points if p.key in by_key]
    return SweepRun(path, rows, new_rows, len(points) - len(todo), time.perf_counter() - start)


def _agreed_todo(points: Sequence[Point], done: Mapping[str, Any] | ValueError) -> list[Point]:
    """The points still to run, as process 0 sees them (broadcast to every process of a
    ``jax.distributed`` run, whose steps must run in the same order everywhere).

    Raises:
      ValueError: process 0 could not prepare the output (``done`` is its error there).
    """
    failed = isinstance(done, ValueError)
    mask = np.array([failed] + [failed or p.key not in done for p in points], np.int32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
    if failed:
        raise done
    if mask[0]:
        raise ValueError("process 0 could not prepare the results file (its error says why)")
    return [p for p, todo in zip(points, mask[1:], strict=True) if todo]


@contextlib.contextmanager
def _progress(enabled: bool, console: Any, total: int):
    """Yields ``advance(n, description)``: a rich progress bar, or nothing when disabled."""
    if not enabled:
        yield lambda n, description: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[bold]sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=console or Console(stderr=True),
    ) as bar:
        task = bar.add_task("", total=total)

        def advance(n: int | None, description: str) -> None:
            bar.update(task, advance=n or 0, description=description)

        yield advance
