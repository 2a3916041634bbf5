"""Meshes and shardings for the bundled models on JAX's own SPMD (``Mesh``, ``NamedSharding``).

Three mesh axes, each optional (size 1 = unused):

- ``dp``: data parallel. The batch is split; parameters and optimizer state are replicated.
- ``fsdp``: fully sharded data parallel (ZeRO-3, Rajbhandari et al. 2020, arXiv:1910.02054).
  The batch is split and every parameter and optimizer-state array is split along its ``embed``
  dimension; XLA all-gathers a layer's weights when it runs.
- ``tp``: tensor parallel over attention heads and the MLP hidden dimension (Megatron-LM,
  Shoeybi et al. 2019, arXiv:1909.08053).

The modules name the logical axes of every parameter (``embed``, ``heads``, ``kv_heads``, ``mlp``,
``vocab``, ``layers`` ...); :data:`LOGICAL_RULES` maps them to mesh axes. Activations carry
logical names too (``activation_batch`` ...), mapped by :data:`ACTIVATION_RULES` inside
:func:`activation_sharding`. This module imports no model and no training code; the sharded
train state is :func:`remat_kit.training.sharded_train_state`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit.validation import check_batch_split, unknown_value_error

MESH_AXES: tuple[str, ...] = ("dp", "fsdp", "tp")

#: Logical parameter axis -> mesh axes.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("positions", None),
)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the ``dp``, ``fsdp`` and ``tp`` mesh axes; ``num_devices`` is their product."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    @property
    def num_devices(self) -> int:
        return self.dp * self.fsdp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.fsdp, self.tp)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)

    @classmethod
    def of(cls, mesh: Mesh) -> MeshSpec:
        """The sizes of a mesh made by :func:`make_mesh` (axes dp, fsdp, tp)."""
        return cls(**{a: int(mesh.shape[a]) for a in MESH_AXES})


def parse_mesh(text: str | MeshSpec | None, num_devices: int | None = None) -> MeshSpec:
    """Parse ``"fsdp=8"`` or ``"dp=2,fsdp=4,tp=1"`` (axes not named have size 1).

    ``None`` or ``""`` means plain data parallelism over ``num_devices`` (``dp=num_devices``).

    Raises:
      ValueError: an unknown axis name (listing dp, fsdp, tp), a size that is not a positive
        integer, or a product of sizes different from ``num_devices`` (naming both numbers).
    """
    if isinstance(text, MeshSpec):
        spec = text
    elif not text:
        spec = MeshSpec(dp=num_devices or 1)
    else:
        sizes: dict[str, int] = {}
        for part in str(text).split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\S+)\s*", part)
            if not m:
                raise ValueError(
                    f"bad mesh entry {part!r} in {text!r}; write e.g. 'dp=2,fsdp=4,tp=1'"
                )
            axis, size = m.group(1), m.group(2)
            if axis not in MESH_AXES:
                raise unknown_value_error("mesh axis", axis, MESH_AXES)
            if not size.isdigit() or int(size) <= 0:
                raise ValueError(
                    f"mesh axis {axis} must have a positive integer size, got {size!r}"
                )
            sizes[axis] = int(size)
        spec = MeshSpec(**sizes)
    if num_devices is not None and spec.num_devices != num_devices:
        raise ValueError(
            f"mesh {spec} has {spec.num_devices} device(s) (product of its sizes) but "
            f"{num_devices} device(s) were asked for"
        )
    return spec


def make_mesh(spec: MeshSpec, devices: Sequence[Any]) -> Mesh:
    """A ``Mesh`` with axes (dp, fsdp, tp) over ``devices`` (real or deviceless).

    Raises:
      ValueError: ``len(devices)`` differs from the mesh's device count.
    """
    if len(devices) != spec.num_devices:
        raise ValueError(f"mesh {spec} needs {spec.num_devices} devices, got {len(devices)}")
    return Mesh(np.asarray(devices).reshape(spec.shape), MESH_AXES)


def _mesh_axis_size(mesh: Mesh, axes: Any) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    """Raise if a sharded dimension is not divisible by the mesh axes it is split over.

    Raises:
      ValueError: naming the array, the dimension, its size and the mesh axis size.
    """
    for dim, (size, axes) in enumerate(
        zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True)
    ):
        n = _mesh_axis_size(mesh, axes)
        if n > 1 and size % n:
            raise ValueError(
                f"{path}: dimension {dim} of size {size} is not divisible by mesh axes {axes} "
                f"of size {n}"
            )


def param_shardings(boxed_params: Any, mesh: Mesh) -> Any:
    """``NamedSharding`` per parameter from the logical axes the modules annotate.

    Args:
      boxed_params: abstract or real parameters as flax ``LogicallyPartitioned`` boxes
        (``remat_kit.training.init_boxed_params`` under ``jax.eval_shape``).
      mesh: a mesh with axes (dp, fsdp, tp).

    Raises:
      ValueError: a sharded dimension not divisible by its mesh axes (see :func:`check_divisible`).
    """
    logical = nn.get_partition_spec(boxed_params)
    specs = nn.logical_to_mesh(logical, LOGICAL_RULES)
    unboxed = nn.meta.unbox(boxed_params)
    flat, _ = jax.tree_util.tree_flatten_with_path(unboxed)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(flat, spec_leaves, strict=True):
        check_divisible(jax.tree_util.keystr(path), tuple(leaf.shape), spec, mesh)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def like_params_shardings(tree: Any, params: Any, shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a tree that holds copies of the parameter tree (optimizer moments): a leaf
    whose path ends with a parameter's path and has its shape gets that parameter's sharding;
    everything else (step counts, scalars) is replicated."""
    by_path = {}
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings), strict=True
    ):
        by_path[jax.tree_util.keystr(path)] = (tuple(leaf.shape), sharding)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        key = jax.tree_util.keystr(path)
        for suffix, (shape, sharding) in by_path.items():
            if key.endswith(suffix) and tuple(getattr(leaf, "shape", ())) == shape:
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def local_mesh(mesh: str | MeshSpec | None = None) -> Mesh:
    """A (dp, fsdp, tp) ``Mesh`` over every device of the run (``jax.devices()``: all processes'
    devices under ``jax.distributed``).

    Args:
      mesh: ``"fsdp=4"``, ``"dp=2,fsdp=2,tp=2"``, a :class:`MeshSpec`, or ``None`` / ``""`` for
        data parallelism over every device.

    Raises:
      ValueError: a bad mesh text (see :func:`parse_mesh`), or a product of sizes different
        from ``jax.device_count()`` (naming both numbers).
    """
    devices = jax.devices()
    spec = parse_mesh(mesh) if mesh else MeshSpec(dp=len(devices))
    if spec.num_devices != len(devices):
        more = (
            "; on a CPU, JAX_NUM_CPU_DEVICES=N (set before JAX starts) gives N devices"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh {spec} needs {spec.num_devices} devices (product of its sizes) but this run "
            f"has {len(devices)} (jax.device_count()){more}"
        )
    return make_mesh(spec, devices)


def put_global(host: Any, shardings: Any) -> Any:
    """Place a tree of host (numpy) arrays as global ``jax.Array`` s with ``shardings``.

    Every process holds the whole value and keeps the shards its own devices own
    (``jax.make_array_from_callback``), so the same call works in one process and in every
    process of a ``jax.distributed`` run. Meant for values every process can compute (initial
    parameters from a seed, a batch drawn from a seeded stream); a very large model would be
    initialised sharded instead.
    """

    def put(x: Any, sharding: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, host, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays [batch, seq] split over (dp, fsdp) along the batch dimension."""
    return NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), None))


def check_batch(batch_size: int, mesh: Mesh, micro_batches: int = 1) -> None:
    """Raise unless each micro-batch of ``batch_size // micro_batches`` rows splits evenly over
    the (dp, fsdp) devices of ``mesh``.

    Raises:
      ValueError: naming the batch size, the micro-batch count and dp*fsdp.
    """
    split = mesh.shape["dp"] * mesh.shape["fsdp"]
    check_batch_split(batch_size, split, micro_batches=micro_batches, mesh=str(MeshSpec.of(mesh)))


#: Logical activation axis -> mesh axes, in force inside :func:`activation_sharding` (the
#: models constrain ``activation_batch``; axes without a rule stay unsplit).
ACTIVATION_RULES: tuple[tuple[str, Any], ...] = (("activation_batch", ("dp", "fsdp")),)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None):
    """While active (at trace time), activations the models constrain with
    ``nn.with_logical_constraint`` (a block's input: ``activation_batch``, ...) have their batch
    dimension split over (dp, fsdp) of ``mesh``; ``None`` leaves them to XLA's propagation.

    Scoped flax context (``nn.logical_axis_rules``, :data:`ACTIVATION_RULES`) plus ``mesh``'s
    abstract mesh (``jax.sharding.use_abstract_mesh``, allowed inside ``jax.jit`` too): no
    module-level state. Without it XLA's sharding propagation may keep whole activations on
    every device under fsdp (measured: llama3-8b fsdp=8 on h100-sxm, 185 GiB per device
    instead of ~44)."""
    if mesh is None:
        with nn.logical_axis_rules(()):
            yield
        return
    with (
        nn.logical_axis_rules(ACTIVATION_RULES),
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
    ):
        yield
