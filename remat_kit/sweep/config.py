"""Sweep configuration: :class:`Grid`, :class:`SweepConfig`, :class:`Point`, config files."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit import validation as V
from remat_kit.policies import PolicySpec, parse_policy_arg, policy_names
from remat_kit.sweep import results as R
from remat_kit.sweep.checks import check_grid, error_message, within

#: Every registered policy name, in registry order.
ALL_POLICIES: tuple[str, ...] = tuple(policy_names())


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
      overrides: model fields changed in every model (``{"scan_layers": True}``; the fields
        :func:`remat_kit.zoo.preset` takes).
      measure: run the real step at points whose target is the local device (a measurer
        runs them: :func:`~remat_kit.sweep.run.run_sweep`).
      warmup_steps: untimed steps before timing (compilation happens before them).
      timed_steps: steps timed, one ``block_until_ready`` each; the median is reported.
      optimizer: ``adamw``, ``sgd`` or ``adafactor`` (:func:`remat_kit.make_optimizer`).
      learning_rate: the optimizer's learning rate.
      seed: parameter initialisation and batch order seed.
      mesh: a (dp, fsdp, tp) mesh (:mod:`remat_kit.targets`), ``"fsdp=4"`` or
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
    measure: bool = False
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
        """:func:`remat_kit.sweep.results.point_key` of :meth:`to_dict`."""
        return R.point_key(self.to_dict())

    @property
    def label(self) -> str:
        g = f" k={self.remat_group_size}" if self.remat_group_size != 1 else ""
        m = f" [{self.mesh}]" if self.mesh else ""
        return (
            f"{self.model} b={self.batch_size} s={self.seq_len}{g}{m} {self.policy} @{self.target}"
        )

    @property
    def changes(self) -> dict[str, Any]:
        """The preset's fields this point changes (group size and overrides; the policy is the
        analysis's), as :func:`remat_kit.zoo.preset` takes them."""
        return {"remat_group_size": self.remat_group_size, **dict(self.overrides)}

    @property
    def remat_policy(self) -> str | PolicySpec:
        """The policy as the model applies it: a registered name, or the per-tag spec."""
        return self.policy if self.policy in ALL_POLICIES else parse_policy_arg(self.policy)

    @property
    def group(self) -> tuple:
        """Points of one group differ only in the policy; they are analysed together."""
        d = self.to_dict()
        d.pop("policy")
        return tuple(sorted((k, repr(v)) for k, v in d.items()))


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

    def identity(self, data: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """What the fingerprint is made of: the config and the data argument (JSON-ready)."""
        return {**self.to_dict(), "data": None if data is None else str(data)}

    def fingerprint(self, data: str | os.PathLike[str] | None = None) -> str:
        """:func:`remat_kit.sweep.results.fingerprint` of :meth:`identity`."""
        return R.fingerprint(self.identity(data))

    def points(self, local_devices: int | None = None) -> list[Point]:
        """Every point, validated, in run order (grid, model, target, group size, batch,
        sequence length, then policy).

        Args:
          local_devices: how many devices a local point without a grid mesh runs on (data
            parallel over them when more than one): None, every device of the run (a grid's
            mesh must then span them all); a number, where an engine hands devices out to
            points side by side (1: one GPU each; a grid's mesh then takes a group of that
            many devices, at most every device).

        Raises:
          ValueError: see :func:`validate`; a grid's mesh needing more devices than the run
            has (or, with ``local_devices`` None, other than all of them).
        """
        validate(self)
        local_kind = jax.default_backend()
        out = [point for g in self.grids for point in _grid_points(g, local_kind, local_devices)]
        keys = [p.key for p in out]
        if len(set(keys)) != len(keys):
            dup = next(p for p in out if keys.count(p.key) > 1)
            raise ValueError(f"sweep {self.name!r} lists point {dup.label} twice")
        return out


def _grid_points(g: Grid, local_kind: str, local_devices: int | None) -> Iterator[Point]:
    for model, target, group, b, s, policy in _product(g):
        yield Point(
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
            mesh=_point_mesh(g, target, b, local_kind, local_devices),
        )


def _point_mesh(
    g: Grid, target: str, batch_size: int, local_kind: str, local_devices: int | None
) -> str | None:
    """The mesh a point runs or is analysed on (see :attr:`Grid.mesh`), as ``MeshSpec`` text;
    None for one device without a mesh (``local_devices``: see :meth:`SweepConfig.points`)."""
    local = _is_local(target, local_kind)
    if g.mesh is not None:
        spec = T.parse_mesh(g.mesh)
        if local and local_devices is None:
            try:
                T.local_mesh(spec)  # raises unless the mesh has every device of the run
            except ValueError as err:
                raise within(f"grid {g.name!r}", err) from None
        elif local and spec.num_devices > jax.device_count():
            raise ValueError(
                f"grid {g.name!r}: mesh {spec} needs {spec.num_devices} devices (product of "
                f"its sizes) but this machine has {jax.device_count()} (jax.device_count())"
            )
    elif local and (local_devices or jax.device_count()) > 1:
        spec = T.parse_mesh(None, local_devices or jax.device_count())
    else:
        return None
    try:
        V.check_batch_split(batch_size, spec.dp * spec.fsdp, mesh=str(spec))
    except ValueError as err:
        default = " (mesh: data parallel over every device, the default)" if g.mesh is None else ""
        raise ValueError(
            f"grid {g.name!r}{default}: {err} (--mesh, e.g. tp=N), or fewer devices "
            "(CUDA_VISIBLE_DEVICES=0 for one GPU)"
        ) from None
    return str(spec)


def _product(g: Grid) -> Iterator[tuple]:
    for model in g.models:
        for target in g.targets:
            for group in g.remat_group_sizes:
                for b in g.batch_sizes:
                    for s in g.seq_lens:
                        for policy in g.policies:
                            yield model, target, group, b, s, policy


def _is_local(target: str, local_kind: str) -> bool:
    name = T.get_target(target).name
    return name == T.LOCAL or (name == "cpu" and local_kind == "cpu")


def validate(config: SweepConfig) -> None:
    """Check a sweep config without compiling anything.

    Raises:
      ValueError: no grids or an unnamed grid; an unknown preset, policy, target, optimizer or
        model field (message lists the valid names and the closest match); an empty tuple,
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
        check_grid(g, ALL_POLICIES)


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
        raise ValueError(f"sweep config {str(path)!r}: {error_message(err)}") from None
    validate(config)
    return config
