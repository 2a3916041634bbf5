"""Where a step's arguments live on a target: one device, or laid out over a mesh of its devices
(:func:`sharded`); and what names the buffers alive at the peak (:class:`BufferNames`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from remat_kit import targets as T
from remat_kit.validation import positive_int, unknown_value_error

#: ``(target, the step's argument names) -> Placement``: a program's layout (:func:`sharded`).
Layout = Callable[[T.Target, Sequence[str]], "Placement"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """The step's arguments laid out on a target: ``place(pure.args)`` -> the abstract arguments
    to lower with; ``mesh`` the ``jax.sharding.Mesh`` (axes dp, fsdp, tp) they are sharded over
    (None: one device), under which the step is traced; ``out_shardings`` the step's output
    shardings where the program fixes them (``jax.jit``'s; None: XLA's propagation chooses)."""

    place: Callable[[Sequence[Any]], tuple[Any, ...]]
    mesh: Any = None
    out_shardings: Any = None

    @property
    def devices(self) -> int:
        """Devices the step is compiled for."""
        return 1 if self.mesh is None else self.mesh.size


def sharded(axes: Mapping[str, int], specs: Mapping[str, Any] | None = None) -> Layout:
    """A program's layout over a mesh of a target's devices, for ``Program.layout``.

    ``dataclasses.replace(program, layout=sharded({"fsdp": 4}, {"x": P("fsdp")}))`` compiles
    the step on 4 of the target's devices (chips), the argument ``x`` split over them on its
    first dimension and every other argument replicated; the figures are then per device.

    Args:
      axes: the mesh's axes and sizes, in order (``{"dp": 2, "tp": 4}``); their product is the
        number of devices used (at most the target's).
      specs: a ``jax.sharding.PartitionSpec`` per step argument, by the name the step's
        arguments are traced under (``Program.step(spec).names``: a :meth:`Program.from_loss`
        step's ``opt_state`` and the loss's arguments; NNX objects as one state, their names
        joined by ``+``): one spec for every array leaf of the argument, or a pytree of specs
        matching it (a prefix of it). Arguments not named are replicated (``P()``).

    Raises:
      ValueError: no axes or a size below 1; later, when a tool places the program, a spec
        for an argument the step does not take (the message lists its arguments) or more
        devices than the target has.
    """
    sizes = {str(k): positive_int(f"mesh axis {k!r} size", v) for k, v in axes.items()}
    if not sizes:
        raise ValueError("axes is empty: give the mesh's axes and sizes, e.g. {'fsdp': 4}")
    given = dict(specs or {})

    def layout(target: T.Target, names: Sequence[str]) -> Placement:
        for name in given:
            if name not in names:
                raise unknown_value_error("argument of the step", name, names)
        devices = T.compile_devices(target, math.prod(sizes.values()))
        mesh = jax.sharding.Mesh(np.array(devices).reshape(tuple(sizes.values())), tuple(sizes))

        def lay(spec: Any, arg: Any) -> Any:
            return T.abstractify(arg, jax.sharding.NamedSharding(mesh, spec))

        def place(args: Sequence[Any]) -> tuple[Any, ...]:
            is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
            return tuple(
                jax.tree.map(
                    lay, given.get(name, jax.sharding.PartitionSpec()), arg, is_leaf=is_spec
                )  # fmt: skip
                for name, arg in zip(names, args, strict=True)
            )

        return Placement(place, mesh)

    return layout


@dataclasses.dataclass(frozen=True)
class BufferNames:
    """How a program's buffers are recognised in its compiled program.

    Attributes:
      stacked: ``(dtype name, shape)`` of a residual buffer -> its checkpoint tags.
      params: ``(dtype name, shape)`` of the parameters (gradients and copies share them).
      logits_elems: elements of the [batch, seq, vocab] logits, where known.
    """

    stacked: Mapping[tuple[str, tuple[int, ...]], tuple[str, ...]]
    params: frozenset[tuple[str, tuple[int, ...]]] = frozenset()
    logits_elems: int | None = None
