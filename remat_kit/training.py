"""Training on real text with a remat policy: validation, gradient accumulation, orbax checkpoints.

:func:`train` runs a language model (a preset, optionally scaled down) on a byte-level corpus
(:mod:`remat_kit.data`; the Python standard library's source by default) with the remat policy
and ``remat_group_size`` of a :class:`TrainConfig`, and returns a :class:`TrainResult` (the loss
at every step, periodic validation losses, timings).

Gradient accumulation is the ``lax.scan`` over micro-batches of :func:`remat_kit.train.grad_fn`:
the global batch ``[batch_size, seq_len]`` is viewed as ``[micro_batches, batch_size //
micro_batches, seq_len]`` and scanned, so one micro-batch's activations are live at a time, the
float32 gradient sum is the only extra buffer, and one call of the compiled step is one optimizer
update. ``optax.MultiSteps`` was not used: it makes every micro-batch a separate step call (a
host round trip each, an optimizer state that counts micro-steps), so a checkpoint could fall
between the micro-batches of one update and "step ``t``" would no longer name one batch.

Checkpoints (orbax ``CheckpointManager``; *not* gradient checkpointing, which is remat) are saved
under ``workdir/checkpoints/<k>`` every ``ckpt_every`` updates and at the end, keeping the last
``keep``. Checkpoint ``k`` holds the state after ``k`` updates: the :class:`TrainState` (params,
optimizer state, step), the run's PRNG key, and JSON metadata (the config, a compatibility
fingerprint, the data position, the loss history). The batch of step ``t`` is
``Corpus.batcher(...).batch_at(t)``, a pure function of ``(seed, t)``, so a run resumed from
checkpoint ``k`` computes bitwise the same losses as an uninterrupted one on the same machine.

Devices: the step runs on every device of the run (``jax.devices()``; every process's devices
under ``jax.distributed``, see :mod:`remat_kit.distributed`) on the mesh ``TrainConfig.mesh``
names (default: data parallel). Every process computes the same initial parameters and the same
global batch from the seed and places the shards its devices own
(:func:`remat_kit.sharding.put_global`); orbax saves and restores the sharded state, so a run may
resume on another mesh or number of processes.

Faults:

* A process killed while saving leaves the previous checkpoints intact: orbax writes
  ``<k>.orbax-checkpoint-tmp`` and renames it to ``<k>`` only once everything is written, and
  deletes checkpoints beyond ``keep`` only after that rename. Leftover tmp folders are removed
  when the manager next opens the folder.
* A non-finite loss or gradient norm raises :class:`NonFiniteLossError` naming the step, before
  anything is saved: the last good checkpoint stays the latest.
* Resuming with a config that would load a different model, optimizer or data stream raises a
  one-line ``ValueError`` naming every mismatched field (see :data:`RESUME_MAY_CHANGE` for the
  fields that may change between the runs).

Example::

    from remat_kit.training import TrainConfig, train

    cfg = TrainConfig(preset="tiny-gpt", policy="save-nothing", steps=200, micro_batches=2)
    result = train(cfg, "runs/tiny")            # writes runs/tiny/checkpoints/{150,200,...}
    result = train(cfg.replace(steps=400), "runs/tiny", resume=True)   # continues from 200
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from remat_kit import names as N
from remat_kit import sharding as S
from remat_kit.data import Corpus, load_corpus
from remat_kit.models.config import ModelConfig, get_config, preset_names
from remat_kit.policies import get_policy_spec
from remat_kit.train import (
    OPTIMIZERS,
    TrainState,
    abstract_batch,
    abstract_train_state,
    grad_fn,
    init_params,
    loss_fn,
    make_optimizer,
    make_train_step,
)

__all__ = [
    "CHECKPOINT_DIR",
    "RESUME_MAY_CHANGE",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "compare_updates",
    "environment_info",
    "latest_checkpoint_step",
    "load_checkpoint",
    "train",
    "train_step_memory",
]

CHECKPOINT_DIR = "checkpoints"
"""Sub-folder of the workdir that holds the orbax checkpoints (one folder per saved step)."""

RESUME_MAY_CHANGE = (
    "policy",
    "micro_batches",
    "mesh",
    "steps",
    "eval_every",
    "eval_batches",
    "ckpt_every",
    "keep",
)
"""TrainConfig fields a resumed run may change. They change how a step is computed (remat policy,
accumulation) or how the run is monitored, not what is learned; every other field, and the data
itself, must match the checkpoint. Changing ``policy``, ``micro_batches`` or ``mesh`` (the number
of devices included) keeps the losses equal within float tolerance, not bitwise."""

_FORMAT = 1  # version of the checkpoint metadata layout


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm of a step was NaN or infinite; training stopped before saving.

    Attributes:
      step: the step (0-based index into the loss history) whose loss was not finite.
      loss: that loss, in nats.
      grad_norm: the global gradient norm of that step.
      last_checkpoint: the latest complete checkpoint (updates done), or None if there is none.
    """

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None,
                 directory: Path) -> None:  # fmt: skip
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.last_checkpoint = last_checkpoint
        kept = (
            f"the last good checkpoint is step {last_checkpoint} in {directory}"
            if last_checkpoint is not None
            else f"no checkpoint was saved yet in {directory}"
        )
        super().__init__(
            f"non-finite loss {loss} (grad_norm {grad_norm}) at step {step}; training stopped "
            f"without saving, {kept}"
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run, passed whole to :func:`train` and stored in every checkpoint.

    Sizes are in tokens (``seq_len``), rows (``batch_size``) and optimizer updates (``steps``,
    ``eval_every``, ``ckpt_every``).

    Raises:
      ValueError (on construction): an unknown preset, policy, optimizer or ModelConfig field
        in ``overrides``; a non-positive size; ``batch_size`` not divisible by
        ``micro_batches``; ``seq_len`` above the model's ``max_seq_len``; ``remat_group_size``
        not dividing ``num_layers``.
    """

    preset: str = "tiny-gpt"  # a name from remat_kit.preset_names()
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig fields
    policy: str = "no-remat"  # a name from remat_kit.policy_names()
    remat_group_size: int = 1  # consecutive blocks per remat segment (divides num_layers)
    batch_size: int = 8  # global batch: rows per optimizer update
    seq_len: int = 128  # tokens per row
    micro_batches: int = 1  # the global batch is split into this many scanned micro-batches
    steps: int = 200  # optimizer updates in the whole run (a resumed run stops here too)
    optimizer: str = "adamw"  # adamw | sgd | adafactor (remat_kit.make_optimizer)
    lr: float = 1e-3  # constant learning rate
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    grad_clip: float | None = 1.0  # global-norm clipping; None disables it
    eval_every: int = 50  # validation every this many updates (and at 0 and the end); 0: never
    eval_batches: int = 4  # validation batches of [batch_size, seq_len] per evaluation
    ckpt_every: int = 50  # checkpoint every this many updates (and at the end); 0: never
    keep: int = 3  # checkpoints kept (the oldest is deleted after a newer one is complete)
    seed: int = 0  # parameter init and batch order
    mesh: str | None = None  # "dp=2,fsdp=2,tp=1" over all devices; None: dp over all devices
    data: str | None = None  # corpus path (text file or folder); None: the Python stdlib
    max_bytes: int | None = None  # corpus cap in bytes; None: 8 MiB for the stdlib, no cap else
    val_fraction: float = 0.05  # tail of the token stream held out for validation

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", dict(sorted(dict(self.overrides).items())))
        for key in ("remat_policy", "remat_group_size"):
            if key in self.overrides:
                field = "policy" if key == "remat_policy" else key
                raise ValueError(f"set {field} on TrainConfig, not {key!r} in overrides")
        if self.preset not in preset_names():
            raise N.unknown_value_error("preset", self.preset, preset_names())
        get_policy_spec(self.policy)  # raises on an unknown name
        if self.optimizer not in OPTIMIZERS:
            raise N.unknown_value_error("optimizer", self.optimizer, OPTIMIZERS)
        for field in ("batch_size", "seq_len", "micro_batches", "steps", "keep",
                      "eval_batches", "remat_group_size"):  # fmt: skip
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in ("eval_every", "ckpt_every", "seed"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by "
                f"micro_batches={self.micro_batches}; the micro-batch size must be a whole number"
            )
        if self.mesh is not None:
            S.parse_mesh(self.mesh)  # the text; its device count is checked when training starts
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        model = self.model_config()  # raises on bad overrides / group size
        if self.seq_len > model.max_seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's max_seq_len={model.max_seq_len}; "
                f"use a shorter seq_len or override max_seq_len"
            )

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig`: the preset with ``overrides``, the policy and group size."""
        return get_config(
            self.preset,
            **self.overrides,
            remat_policy=self.policy,
            remat_group_size=self.remat_group_size,
        )

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "overrides": dict(self.overrides)
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in valid:
                raise N.unknown_value_error("TrainConfig field", key, valid)
        return cls(**d)


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      config: the run's :class:`TrainConfig`.
      losses: training loss (nats per token, float32 values) of every step ``0 .. steps - 1``,
        including the steps a resumed run inherited from its checkpoint.
      val_losses: ``(updates_done, mean validation loss in nats)`` pairs.
      resumed_from: the checkpoint step this call started from, or None for a fresh start.
      checkpoints: the complete checkpoint steps on disk when the call returned.
      num_params: parameter count.
      compile_time_s: seconds to compile the train step (0 if cached in this process).
      step_time_s: mean seconds per update in this call (batch fetch included), compile and the
        call's first step excluded (nan if no step ran).
      wall_time_s: seconds this call took, end to end.
      data: corpus metadata (:meth:`remat_kit.data.Corpus.info`).
      mesh: the mesh the run used, e.g. ``"dp=2,fsdp=1,tp=1"`` (its product: the devices).
      num_processes: JAX processes that ran it together (``jax.process_count()``).
    """

    config: TrainConfig
    losses: list[float]
    val_losses: list[tuple[int, float]]
    resumed_from: int | None
    checkpoints: list[int]
    num_params: int
    compile_time_s: float
    step_time_s: float
    wall_time_s: float
    data: dict[str, Any]
    mesh: str = "dp=1,fsdp=1,tp=1"
    num_processes: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the config as a dict)."""
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        d["val_losses"] = [list(p) for p in self.val_losses]
        if not math.isfinite(d["step_time_s"]):
            d["step_time_s"] = None  # no step ran in this call; strict JSON has no NaN
        return d


def environment_info() -> dict[str, Any]:
    """Where a result was measured: hardware, backend and library versions (JSON-ready)."""

    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                None,
            )
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d.device_kind) for d in jax.devices()],
        "process_count": jax.process_count(),
        "python": sys.version.split()[0],
        **{
            name: version(name)
            for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
        },
    }


# ----------------------------------------------------------------------------- internals


def _optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """``make_optimizer`` with the learning rate and weight decay held in the optimizer state
    (``optax.inject_hyperparams``), so one compiled step serves every value of them."""
    return _injected(cfg.optimizer, cfg.grad_clip)(
        learning_rate=cfg.lr, weight_decay=cfg.weight_decay
    )


@functools.lru_cache(maxsize=16)
def _injected(name: str, grad_clip: float | None) -> Callable[..., optax.GradientTransformation]:
    return functools.partial(
        optax.inject_hyperparams(make_optimizer, static_args=("name", "grad_clip")),
        name=name,
        grad_clip=grad_clip,
    )


@functools.lru_cache(maxsize=8)
def _initial_params(model: ModelConfig, seed: int) -> Any:
    """Initial parameters (host numpy arrays) for ``model`` and ``seed``, computed by one jitted
    init (op-by-op init costs seconds on CPU). The remat policy does not change the parameters,
    so the cache key ignores it: every policy starts from the same values."""
    model = model.replace(remat_policy="no-remat")
    init_key, _ = jax.random.split(jax.random.key(seed))
    return jax.device_get(jax.jit(init_params, static_argnums=0)(model, init_key))


def _initial_state(cfg: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """A fresh TrainState with its own buffers (the train step donates them); on ``mesh``,
    sharded as the train step takes it (every process places its own shards)."""
    host = _initial_params(cfg.model_config(), cfg.seed)
    if mesh is None:
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), host)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=_optimizer(cfg).init(params)
        )
    init, shardings = _init_on_mesh(
        cfg.model_config(), _opt_key(cfg), cfg.lr, cfg.weight_decay, mesh
    )
    return init(S.put_global(host, shardings.params))


@functools.lru_cache(maxsize=8)
def _init_on_mesh(
    model: ModelConfig, opt_key: tuple, lr: float, weight_decay: float, mesh: Mesh
) -> tuple[Callable, TrainState]:
    """Jitted ``params -> TrainState`` (step 0, fresh optimizer state) laid out on ``mesh``, and
    the state's shardings."""
    opt = _injected(*opt_key)(learning_rate=lr, weight_decay=weight_decay)
    shardings = S.sharded_train_state(model, opt, mesh)[1]
    init = jax.jit(
        lambda params: TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params)
        ),
        out_shardings=shardings,
    )
    return init, shardings


@functools.lru_cache(maxsize=16)
def _compiled_step(
    model: ModelConfig,
    opt_key: tuple,
    micro_batches: int,
    batch_size: int,
    seq_len: int,
    mesh: Mesh | None = None,
) -> tuple[Any, float]:
    """The compiled train step (state donated; on ``mesh``, sharded) and its compile time in
    seconds, cached so that runs of the same shapes in one process (a resume, a test) compile
    once."""
    opt = _injected(*opt_key)(learning_rate=0.0, weight_decay=0.0)  # values live in the state
    step = make_train_step(model, opt, micro_batches=micro_batches, mesh=mesh)
    t0 = time.perf_counter()
    compiled = step.lower(
        abstract_train_state(model, opt), abstract_batch(batch_size, seq_len)
    ).compile()
    return compiled, time.perf_counter() - t0


@functools.lru_cache(maxsize=16)
def _eval_fn(model: ModelConfig, mesh: Mesh | None = None) -> Callable:
    """Jitted ``(params, inputs, targets) -> mean loss``; on ``mesh``, batch split as in
    training."""

    def loss(params, inputs, targets):
        with S.activation_sharding(mesh):
            return loss_fn(params, model, {"inputs": inputs, "targets": targets})

    return jax.jit(loss)


def _opt_key(cfg: TrainConfig) -> tuple:
    return (cfg.optimizer, cfg.grad_clip)


def _compat(cfg: TrainConfig, corpus: Corpus) -> dict[str, Any]:
    """The fields a resumed run must share with its checkpoint (see RESUME_MAY_CHANGE)."""
    model = dataclasses.asdict(cfg.model_config())
    model.pop("remat_policy")
    model["preset"] = model.pop("name")
    run = {
        k: v
        for k, v in cfg.to_dict().items()
        if k not in RESUME_MAY_CHANGE and k not in ("preset", "overrides", "data", "max_bytes")
    }
    data = {"data_fingerprint": corpus.fingerprint, "data_train_tokens": int(corpus.train.size)}
    return {**model, **run, **data}


def _check_compatible(saved: Mapping[str, Any], now: Mapping[str, Any], where: str) -> None:
    bad = [
        f"{k} (checkpoint {saved.get(k)!r}, now {now.get(k)!r})"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if bad:
        raise ValueError(
            f"cannot resume from {where}: incompatible config, mismatched {'; '.join(bad)}; "
            "resume with the checkpoint's settings or use a fresh workdir"
        )


def _manager(directory: Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        cleanup_tmp_directories=True,  # remove the tmp folder of a save that was killed
        # Synchronous: save() returns once the checkpoint is renamed into place. The train step
        # donates the state's buffers, and on CPU a host "copy" may alias them.
        enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(directory.resolve(), options=options)


def _checkpoint_dir(workdir: str | os.PathLike[str]) -> Path:
    return Path(workdir).expanduser() / CHECKPOINT_DIR


def latest_checkpoint_step(workdir: str | os.PathLike[str]) -> int | None:
    """The latest *complete* checkpoint step under ``workdir`` (None if there is none)."""
    directory = _checkpoint_dir(workdir)
    if not directory.is_dir():
        return None
    with _manager(directory, keep=1_000_000) as mgr:
        return mgr.latest_step()


def load_checkpoint(
    workdir: str | os.PathLike[str], step: int | None = None, mesh: Mesh | None = None
) -> tuple[TrainState, dict[str, Any]]:
    """Restore a checkpoint written by :func:`train`.

    Args:
      workdir: the run's workdir (checkpoints are in ``workdir/checkpoints``).
      step: the checkpoint step (updates done); None for the latest complete one.
      mesh: restore the state sharded over this (dp, fsdp, tp) mesh (any mesh: a checkpoint
        does not depend on the mesh it was saved from); None: onto the default device.

    Returns:
      ``(state, meta)``: the :class:`TrainState` with real arrays, and the JSON metadata
      (``config``, ``compat``, ``data``, ``losses``, ``val_losses``, ``rng``, ``step``).

    Raises:
      ValueError: no complete checkpoint (at ``step``) under ``workdir``.
    """
    directory = _checkpoint_dir(workdir)
    with _manager(directory, keep=1_000_000) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None or step not in mgr.all_steps():
            raise ValueError(
                f"no complete checkpoint {'' if step is None else step} in {directory}; "
                f"available: {sorted(mgr.all_steps())}"
            )
        return _restore(mgr, step, mesh)


def _restore(
    mgr: ocp.CheckpointManager, step: int, mesh: Mesh | None
) -> tuple[TrainState, dict[str, Any]]:
    meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    cfg = TrainConfig.from_dict(meta["config"])
    if mesh is None:
        state = abstract_train_state(cfg.model_config(), _optimizer(cfg))
    else:
        state = S.sharded_train_state(cfg.model_config(), _optimizer(cfg), mesh)[0]
    # The run's key is a host (numpy) array: every process holds it whole.
    target = {"train_state": state, "rng": np.zeros((2,), np.uint32)}
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    meta["rng"] = np.asarray(out["state"]["rng"]).tolist()
    return out["state"]["train_state"], meta


def _save(mgr, step: int, state: TrainState, rng_data: np.ndarray, meta: dict[str, Any]) -> None:
    mgr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"train_state": state, "rng": rng_data}),
            meta=ocp.args.JsonSave(meta),
        ),
    )


def _num_params(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------- public API


def train(
    cfg: TrainConfig,
    workdir: str | os.PathLike[str],
    resume: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train ``cfg`` on its corpus, checkpointing into ``workdir/checkpoints``.

    Step ``t`` (0-based) takes the batch ``batch_at(t)`` of the training split, computes the loss
    with the params after ``t`` updates, and applies update ``t + 1``. Validation (mean loss over
    the first ``eval_batches`` batches of the validation split) runs after 0 updates, every
    ``eval_every`` updates and at the end; a checkpoint is saved every ``ckpt_every`` updates and
    at the end.

    Args:
      cfg: the run.
      workdir: folder for the checkpoints (created if missing).
      resume: continue from the latest complete checkpoint in ``workdir`` (a fresh start if
        there is none). Without it, a ``workdir`` that already holds checkpoints is an error.
      on_step: called after every step with ``{"step", "loss", "grad_norm", "step_time_s"}``
        (plus ``"val_loss"`` when validation ran, ``"checkpoint"`` when one was saved).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError: bad corpus or sizes (see :func:`remat_kit.data.load_corpus`); ``workdir``
        holds checkpoints and ``resume`` is False; the checkpoint's config is incompatible (the
        message names each mismatched field, checkpoint vs now).
      NonFiniteLossError: a step's loss or gradient norm is not finite (nothing saved for it).
    """
    t_start = time.perf_counter()
    mesh = S.local_mesh(cfg.mesh)
    S.check_batch(cfg.batch_size, mesh, cfg.micro_batches)
    batch_sharding = S.batch_sharding(mesh)
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes, val_fraction=cfg.val_fraction)
    batcher = corpus.batcher(cfg.batch_size, cfg.seq_len, cfg.seed)
    val = (
        [
            S.put_global(xy, (batch_sharding, batch_sharding))
            for xy in corpus.val_batches(cfg.batch_size, cfg.seq_len, cfg.eval_batches)
        ]
        if cfg.eval_every
        else []
    )
    model = cfg.model_config()
    compat = _compat(cfg, corpus)
    directory = _checkpoint_dir(workdir)
    directory.mkdir(parents=True, exist_ok=True)

    with _manager(directory, cfg.keep) as mgr:
        latest = mgr.latest_step()
        if latest is not None and not resume:
            raise ValueError(
                f"{directory} already holds checkpoints (latest step {latest}); pass "
                "resume=True (--resume) to continue that run, or use a fresh workdir"
            )
        if resume and latest is not None:
            where = f"{directory / str(latest)}"
            meta = mgr.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            if meta["meta"].get("format") != _FORMAT:
                raise ValueError(
                    f"cannot resume from {where}: not a remat-kit checkpoint of format {_FORMAT} "
                    f"(found format {meta['meta'].get('format')!r}); use a fresh workdir"
                )
            _check_compatible(meta["meta"]["compat"], compat, where)
            state, meta = _restore(mgr, latest, mesh)
            rng_data = np.asarray(meta["rng"], np.uint32)
            losses, val_losses = list(meta["losses"]), [tuple(p) for p in meta["val_losses"]]
            start = int(meta["step"])
            if start > cfg.steps:
                raise ValueError(
                    f"cannot resume from {where} with steps={cfg.steps}: that checkpoint is "
                    f"already {start} updates in; ask for more steps (--steps > {start})"
                )
            batcher.step = int(meta["data"]["step"])
            if int(state.step) != start or batcher.step != start or len(losses) != start:
                raise ValueError(f"checkpoint {where} is inconsistent: step counters disagree")
            resumed_from: int | None = start
        else:
            _, run_key = jax.random.split(jax.random.key(cfg.seed))
            state = _initial_state(cfg, mesh)
            # uint32[2] on the host, saved so a resume is exact.
            rng_data = np.asarray(jax.random.key_data(run_key))
            losses, val_losses, start, resumed_from = [], [], 0, None

        eval_fn = _eval_fn(model, mesh)

        def evaluate(params) -> float:
            return float(np.mean([float(eval_fn(params, x, y)) for x, y in val]))

        if val and start == 0:
            val_losses.append((0, evaluate(state.params)))

        compiled, compile_time_s = None, 0.0
        if start < cfg.steps:
            hits = _compiled_step.cache_info().hits
            compiled, compile_time_s = _compiled_step(
                model, _opt_key(cfg), cfg.micro_batches, cfg.batch_size, cfg.seq_len, mesh
            )
            if _compiled_step.cache_info().hits > hits:
                compile_time_s = 0.0  # compiled earlier in this process

        step_times: list[float] = []
        for t in range(start, cfg.steps):
            t0 = time.perf_counter()
            inputs, targets = S.put_global(batcher.batch_at(t), (batch_sharding, batch_sharding))
            state, metrics = compiled(state, {"inputs": inputs, "targets": targets})
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            step_times.append(time.perf_counter() - t0)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteLossError(t, loss, grad_norm, mgr.latest_step(), directory)
            losses.append(loss)
            done = t + 1
            batcher.step = done
            info: dict[str, Any] = {"step": t, "loss": loss, "grad_norm": grad_norm,
                                    "step_time_s": step_times[-1]}  # fmt: skip
            if val and (done % cfg.eval_every == 0 or done == cfg.steps):
                info["val_loss"] = evaluate(state.params)
                val_losses.append((done, info["val_loss"]))
            if cfg.ckpt_every and (done % cfg.ckpt_every == 0 or done == cfg.steps):
                meta = {
                    "format": _FORMAT,
                    "step": done,
                    "config": cfg.to_dict(),
                    "compat": compat,
                    "data": batcher.state,
                    "losses": losses,
                    "val_losses": [list(p) for p in val_losses],
                    "corpus": corpus.info(),
                }
                _save(mgr, done, state, rng_data, meta)
                info["checkpoint"] = done
            if on_step is not None:
                on_step(info)
        checkpoints = sorted(mgr.all_steps())

    return TrainResult(
        config=cfg,
        losses=losses,
        val_losses=val_losses,
        resumed_from=resumed_from,
        checkpoints=checkpoints,
        num_params=_num_params(state.params),
        compile_time_s=compile_time_s,
        # The first step of a call also allocates and warms up; leave it out when there are more.
        step_time_s=float(np.mean(step_times[1:] or step_times)) if step_times else float("nan"),
        wall_time_s=time.perf_counter() - t_start,
        data=corpus.info(),
        mesh=str(S.MeshSpec.of(mesh)),
        num_processes=jax.process_count(),
    )


def compare_updates(cfg: TrainConfig, micro_batches: int, grads: bool = True) -> dict[str, Any]:
    """One optimizer update as one batch vs accumulated over ``micro_batches`` micro-batches.

    Both start from the same initial state (``cfg.seed``) and take the same global batch
    ``batch_at(0)`` of shape [cfg.batch_size, cfg.seq_len]; the first compiles the step with
    ``micro_batches=1``, the second with ``micro_batches`` (``cfg.micro_batches`` is ignored).

    Args:
      cfg: model, optimizer, batch and data; ``cfg.micro_batches`` is ignored.
      micro_batches: micro-batches of the accumulated step; divides ``cfg.batch_size``.
      grads: also compare the gradients themselves (two more compiles, of ``grad_fn``).

    Returns:
      ``loss_abs_diff`` (nats) and ``grad_norm_abs_diff`` of the two steps; with ``grads``,
      ``grads_max_abs_diff`` (largest absolute difference of any gradient element) and
      ``grads_max_abs`` (largest gradient magnitude, for scale); ``params_max_abs_diff``
      (largest absolute difference of any parameter after the update), ``params_worst_leaf``
      (the parameter path where it occurs) and ``params_max_abs`` (for scale);
      ``memory_one_batch`` and ``memory_accumulated``: the :func:`train_step_memory` dicts
      (bytes) of the two compiled steps, and ``temp_ratio``: one-batch temp bytes /
      accumulated temp bytes.

    Note: Adam's first update is ``lr * g / (|g| + eps)`` per element, so for elements whose
    gradient is near 0 it magnifies float noise in ``g`` (an attention key bias has a true
    gradient of exactly 0: softmax ignores a shift shared by all keys; its ~1e-10 noise becomes
    a step of ~``lr * 1e-10 / eps``). ``params_max_abs_diff`` can then be ~1e-5 with
    ``lr = 1e-3`` while the gradients agree to ~1e-7: compare the gradients.

    Raises:
      ValueError: ``cfg.batch_size`` not divisible by ``micro_batches``.
    """
    if cfg.batch_size % micro_batches:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not divisible by micro_batches={micro_batches}"
        )
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes, val_fraction=cfg.val_fraction)
    inputs, targets = corpus.batcher(cfg.batch_size, cfg.seq_len, cfg.seed).batch_at(0)
    batch = {"inputs": inputs, "targets": targets}
    model = cfg.model_config()
    steps, gradients, memory = [], [], []
    for n in (1, micro_batches):
        state = _initial_state(cfg)  # fresh buffers: the step donates them
        if grads:
            gradients.append(jax.jit(grad_fn(model, n))(state.params, batch)[1])
        compiled, _ = _compiled_step(model, _opt_key(cfg), n, cfg.batch_size, cfg.seq_len)
        steps.append(compiled(state, batch))
        memory.append(_memory(compiled))
    (s1, m1), (sn, mn) = steps

    def max_abs(tree) -> float:
        return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))

    param_diffs = jax.tree_util.tree_leaves_with_path(
        jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s1.params, sn.params)
    )
    worst_path, worst = max(param_diffs, key=lambda kv: kv[1])
    out: dict[str, Any] = {
        "loss_abs_diff": abs(float(m1["loss"]) - float(mn["loss"])),
        "grad_norm_abs_diff": abs(float(m1["grad_norm"]) - float(mn["grad_norm"])),
    }
    if grads:
        out["grads_max_abs_diff"] = max_abs(jax.tree.map(lambda a, b: a - b, *gradients))
        out["grads_max_abs"] = max_abs(gradients[0])
    return out | {
        "params_max_abs_diff": worst,
        "params_worst_leaf": jax.tree_util.keystr(worst_path),
        "params_max_abs": max_abs(s1.params),
        "memory_one_batch": memory[0],
        "memory_accumulated": memory[1],
        "temp_ratio": memory[0]["temp_bytes"] / max(memory[1]["temp_bytes"], 1),
    }


def train_step_memory(cfg: TrainConfig) -> dict[str, int]:
    """XLA's memory analysis of ``cfg``'s compiled train step on the local backend (nothing run).

    The step is compiled for ``cfg``'s model, optimizer, ``micro_batches``, ``batch_size`` and
    ``seq_len``, with the train state donated as in :func:`train`.

    Returns:
      Bytes: ``temp_bytes`` (scratch: activations and residuals kept for the backward pass,
      gradient buffers, optimizer temporaries), ``argument_bytes``, ``output_bytes``,
      ``alias_bytes`` (donated arguments reused for outputs) and ``peak_bytes`` = argument +
      output + temp - alias.
    """
    compiled, _ = _compiled_step(
        cfg.model_config(), _opt_key(cfg), cfg.micro_batches, cfg.batch_size, cfg.seq_len
    )
    return _memory(compiled)


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }
    out["peak_bytes"] = (
        out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    )
    return out
