"""Checks of one sweep grid (nothing compiled) and the one-line wording of failures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from remat_kit import targets as T
from remat_kit import validation as V
from remat_kit.models import preset_names
from remat_kit.policies import parse_policy_arg
from remat_kit.training.step import OPTIMIZERS
from remat_kit.zoo import check_preset

_OOM_MARKERS = ("resource_exhausted", "out of memory", "oom when allocating", "ran out of memory")


def within(where: str, err: ValueError) -> ValueError:
    """``err`` with ``where`` (``"grid 'measured'"``) in front of its message."""
    return ValueError(f"{where}: {err}")


def error_message(err: BaseException) -> str:
    """``"Type: first line of the message"`` (at most 2000 characters)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:2000]


def classify(err: BaseException) -> str:
    """A row's status for a failure: ``oom`` (out of memory compiling or running) or ``error``."""
    text = f"{type(err).__name__} {err}".lower()
    return "oom" if any(m in text for m in _OOM_MARKERS) else "error"


def _names(where: str, label: str, values: Any, valid: Sequence[str], kind: str) -> None:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{where}: {label} must be a non-empty tuple, got {values!r}")
    for v in values:
        if v not in valid:
            raise within(where, V.unknown_value_error(kind, v, list(valid)))
    if len(set(values)) != len(values):
        raise ValueError(f"{where}: {label} lists a value twice: {values!r}")


def _policies(where: str, values: Any) -> None:
    """Each entry a registered name or a per-tag spec (``query_proj=offload,out_proj=save``),
    parsed by :func:`remat_kit.policies.parse_policy_arg`, the command line's one syntax."""
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{where}: policies must be a non-empty tuple, got {values!r}")
    for v in values:
        try:
            parse_policy_arg(v)
        except ValueError as err:
            raise within(where, err) from None
    if len(set(values)) != len(values):
        raise ValueError(f"{where}: policies lists a value twice: {values!r}")


def _positive_ints(where: str, label: str, values: Any) -> None:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{where}: {label} must be a non-empty tuple, got {values!r}")
    for i, v in enumerate(values):
        V.positive_int(f"{where}: {label}[{i}]", v)
    if len(set(values)) != len(values):
        raise ValueError(f"{where}: {label} lists a value twice: {values!r}")


def _check_targets(where: str, targets: Any) -> None:
    if not isinstance(targets, tuple) or not targets:
        raise ValueError(f"{where}: targets must be a non-empty tuple, got {targets!r}")
    for t in targets:
        try:
            target = T.get_target(t)
        except ValueError as err:
            raise within(where, err) from None
        if target.gpu is not None and T.cuda_plugin_module() is None:
            raise ValueError(
                f"{where}: target {t!r} is compiled deviceless and needs JAX's CUDA plugin: "
                "pip install 'remat-kit[cuda12]', or drop the target"
            )
        if target.tpu is not None and not T.libtpu_installed():
            raise ValueError(
                f"{where}: TPU target {t!r} is compiled deviceless and needs libtpu: "
                f"{T.TPU_INSTALL_HINT}, or drop the target"
            )


def _check_steps(where: str, g: Any) -> None:
    if g.optimizer not in OPTIMIZERS:
        raise within(where, V.unknown_value_error("optimizer", g.optimizer, OPTIMIZERS))
    V.nonnegative_int(f"{where}: warmup_steps", g.warmup_steps)
    V.positive_int(f"{where}: timed_steps", g.timed_steps)
    if not (isinstance(g.learning_rate, (int, float)) and g.learning_rate > 0):
        raise ValueError(f"{where}: learning_rate must be > 0, got {g.learning_rate!r}")
    if not isinstance(g.measure, bool):
        raise ValueError(f"{where}: measure must be True or False, got {g.measure!r}")
    if g.mesh is not None:
        try:
            T.parse_mesh(g.mesh)
        except ValueError as err:
            raise within(where, err) from None


def _check_models(where: str, g: Any) -> None:
    if not isinstance(g.overrides, Mapping):
        raise ValueError(f"{where}: overrides must be a mapping, got {g.overrides!r}")
    for bad in ("remat_policy", "remat_group_size"):
        if bad in g.overrides:
            raise ValueError(f"{where}: set {bad} through the grid, not overrides")
    for m in g.models:
        for k in g.remat_group_sizes:
            seq = max(g.seq_lens)
            how = f"overrides={{'max_seq_len': {seq}}} in the grid"
            try:
                check_preset(m, seq, how, remat_group_size=k, **dict(g.overrides))
            except ValueError as err:
                raise within(f"{where}, model {m!r}", err) from None


def check_grid(g: Any, policies: Sequence[str]) -> None:
    """Check one :class:`~remat_kit.sweep.Grid` (``policies``: the valid policy names).

    Raises:
      ValueError: see :func:`remat_kit.sweep.validate`; the message starts ``grid 'name':``.
    """
    where = f"grid {g.name!r}"
    _names(where, "models", g.models, preset_names(), "preset")
    _policies(where, g.policies)
    for label in ("batch_sizes", "seq_lens", "remat_group_sizes"):
        _positive_ints(where, label, getattr(g, label))
    _check_targets(where, g.targets)
    _check_steps(where, g)
    _check_models(where, g)
