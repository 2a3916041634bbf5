"""What a training run is: :class:`TrainConfig` (validated on construction), what it returns
(:class:`TrainResult`), and the error that stops it (:class:`NonFiniteLossError`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remat_kit.models import ModelConfig, get_config, preset_names
from remat_kit.policies import parse_policy_arg, policy_names
from remat_kit.targets import parse_mesh
from remat_kit.training.step import OPTIMIZERS, check_micro_batches
from remat_kit.validation import check_seq_len, positive_int, unknown_value_error

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

_POSITIVE = ("batch_size", "seq_len", "micro_batches", "steps", "keep", "eval_batches",
             "remat_group_size")  # fmt: skip


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
    policy: str = "no-remat"  # a policy name, or a per-tag spec "query_proj=offload,out_proj=save"
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
            raise unknown_value_error("preset", self.preset, preset_names())
        parse_policy_arg(self.policy)  # a registered name or a per-tag spec; raises if neither
        if self.optimizer not in OPTIMIZERS:
            raise unknown_value_error("optimizer", self.optimizer, OPTIMIZERS)
        for field in _POSITIVE:
            positive_int(field, getattr(self, field))
        for field in ("eval_every", "ckpt_every", "seed"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
        check_micro_batches(self.batch_size, self.micro_batches)
        if self.mesh is not None:
            parse_mesh(self.mesh)  # the text; its device count is checked when training starts
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        model = self.model_config()  # raises on bad overrides / group size
        how = f"overrides={{'max_seq_len': {self.seq_len}}}"
        check_seq_len(self.seq_len, model.max_seq_len, self.preset, how=how)

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig`: the preset with ``overrides``, the policy and group size."""
        return get_config(
            self.preset,
            **self.overrides,
            remat_policy=self.policy
            if self.policy in policy_names()
            else parse_policy_arg(self.policy),
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
                raise unknown_value_error("TrainConfig field", key, valid)
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
      data: corpus metadata (:meth:`trainer.data.Corpus.info`).
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
