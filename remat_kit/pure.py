"""A step as a function of arrays, and the loss traced once.

Arguments are arrays, ``jax.ShapeDtypeStruct`` pytrees, or NNX objects (``nnx.Module``,
``nnx.Optimizer``, real or from ``nnx.eval_shape``): NNX objects are split into their state and
merged inside the traced function, and their updated state is returned, so a step that mutates
them keeps its backward pass and update (a plain ``jax.jit`` of such a step drops both). Pytrees
with other leaves than arrays (an ``equinox.Module``) are taken with equinox's filter semantics:
the array leaves are the arguments, every other leaf is static (as ``eqx.partition`` /
``eqx.filter_jit``), and only the array leaves of the outputs are kept.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jax_core

from remat_kit.policies import PolicySpec
from remat_kit.units import format_bytes

#: ``make_step`` / ``make_loss``: a jax.checkpoint policy (None: no remat) -> function.
Factory = Callable[[Callable[..., Any] | None], Callable[..., Any]]


def jax_policy(spec: PolicySpec) -> Callable[..., Any] | None:
    """The policy a factory receives: ``None`` for ``no-remat`` (build without remat)."""
    return spec.to_jax() if spec.wrap else None


#: NNX objects with state: modules and optimizers (``nnx.Pytree`` in flax >= 0.11,
#: ``nnx.Object`` before).
_NNX_OBJECT = getattr(nnx, "Pytree", None) or nnx.Object


def is_nnx(x: Any) -> bool:
    """Whether ``x`` is an NNX object with state (a module or an optimizer)."""
    return isinstance(x, _NNX_OBJECT)


def is_array(x: Any) -> bool:
    """Whether a pytree leaf is an argument of the program (filter semantics, as
    ``eqx.is_array``, plus ``jax.ShapeDtypeStruct`` for abstract arguments): JAX and NumPy arrays
    (tracers included); every other leaf (a Python float or bool, a function) is static."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_float_array(x: Any) -> bool:
    """An array leaf of a floating (or complex) dtype: what a loss is differentiated by (as
    ``eqx.is_inexact_array``); integer and boolean arrays (masks, position ids, counters) are
    carried unchanged."""
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class Static:
    """The non-array leaves of one argument, to put back around its array leaves."""

    treedef: Any
    leaves: tuple[Any, ...]
    mask: tuple[bool, ...]  # True where the leaf is an array (an argument)


def partition(tree: Any, keep: Callable[[Any], bool] = is_array) -> tuple[Any, Static | None]:
    """``tree`` split as ``eqx.partition(tree, keep)`` would: the same tree with each leaf
    ``keep`` refuses (default: each non-array leaf) replaced by None (an empty subtree to JAX),
    and what :func:`combine` needs to put them back; ``(tree, None)`` when ``keep`` takes
    every leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = tuple(keep(x) for x in leaves)
    if all(mask):
        return tree, None
    arrays = [x if m else None for x, m in zip(leaves, mask, strict=True)]
    others = tuple(None if m else x for x, m in zip(leaves, mask, strict=True))
    static = Static(treedef, others, mask)
    return jax.tree.unflatten(treedef, arrays), static


def combine(arrays: Any, static: Static | None) -> Any:
    """The tree :func:`partition` split: ``arrays``' leaves (in order) with the static leaves."""
    if static is None:
        return arrays
    given = iter(jax.tree.leaves(arrays))
    leaves = [next(given) if m else x for x, m in zip(static.leaves, static.mask, strict=True)]
    return jax.tree.unflatten(static.treedef, leaves)


def filtered_factory(make: Factory, args: Sequence[Any]) -> tuple[Factory, tuple[Any, ...]]:
    """A factory and its arguments with filter semantics, for code that traces, differentiates
    and compiles ``make(policy)(*args)`` itself: ``(make', arrays)``, ``arrays`` the arguments'
    array parts (:func:`partition`) and ``make'(policy)`` the function ``make(policy)`` of them,
    each argument's non-array leaves put back (:func:`combine`): a Python float or bool of an
    ``equinox.Module`` (a dropout's ``p``, ``inference``) stays static, never a traced input.
    NNX objects are passed as given; ``(make, args)`` when no argument has a static leaf."""
    parts = [(a, None) if is_nnx(a) else partition(a) for a in args]
    statics = [st for _, st in parts]
    if all(st is None for st in statics):
        return make, tuple(args)

    def filtered(policy: Any) -> Callable[..., Any]:
        fn = make(policy)

        def of_arrays(*arrays: Any) -> Any:
            return fn(*(combine(a, st) for a, st in zip(arrays, statics, strict=True)))

        of_arrays.__wrapped__ = fn  # the function's own parameter names (param_names)
        of_arrays.__name__ = getattr(fn, "__name__", "loss")
        return of_arrays

    filtered.__wrapped__ = make
    return filtered, tuple(a for a, _ in parts)


def arrays_only(tree: Any) -> Any:
    """``tree`` with its non-array leaves replaced by None (what a jitted function may return)."""
    return jax.tree.map(lambda x: x if is_array(x) else None, tree)


def leaf_bytes(tree: Any) -> int:
    """Bytes per device of every array leaf (a leaf carrying a sharding counts its shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            continue
        shape = x.shape
        sharding = getattr(x, "sharding", None)
        if sharding is not None and hasattr(sharding, "shard_shape"):
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total


def summary(arg: Any) -> str:
    """``int32[2, 33]`` for one array; ``Model (12 arrays float32, 1.00 MiB)`` otherwise."""
    tree = nnx.state(arg) if is_nnx(arg) else arg
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]
    if len(leaves) == 1 and leaves[0] is tree:
        return f"{tree.dtype.name}{list(tree.shape)}"
    dtypes = "/".join(sorted({x.dtype.name for x in leaves}))
    kind = f"{type(arg).__name__} " if is_nnx(arg) else ""
    return f"{kind}({len(leaves)} arrays {dtypes}, {format_bytes(leaf_bytes(tree))})"


def param_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names of ``fn``'s first ``n`` positional parameters (``arg{i}`` where unknown)."""
    target = inspect.unwrap(fn)
    try:
        params = [
            p.name
            for p in inspect.signature(target).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Pure:
    """A function of arrays only, made from a user's function whose arguments may hold NNX
    objects: ``fn(*args)`` runs the user's function and returns ``(new_nnx_state, result)``
    when NNX objects were present (the state first among the outputs as among the arguments),
    else the user's result."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    names: tuple[str, ...]
    nnx_index: int | None  # position of the merged NNX state among ``args``


def purify(fn: Callable[..., Any], args: Sequence[Any], names: Sequence[str]) -> Pure:
    """Make ``fn(*args)`` a function of arrays: NNX objects among ``args`` are split into one
    state (first argument of the result) and merged back inside; their updated state is the
    first output, so mutations (an optimizer update) are part of the program. The state leads
    both lists so that JAX, which pairs each donated argument with the first unpaired output of
    its shape and dtype, gives each state buffer its own update and the other donated arguments
    (a :meth:`Program.from_loss` optimizer state, whose moments have the parameters' shapes)
    theirs: paired out of order, XLA:CPU copied to update in place and the peak rose by up to
    5%. Other arguments holding
    non-array leaves (an ``equinox.Module``) keep their array leaves as the argument and the rest
    static (:func:`partition`); only the array leaves of ``fn``'s result are returned.

    Raises:
      ValueError: an NNX object nested inside a container argument (pass it as its own
        argument); an argument JAX cannot see into (:func:`check_argument`).
    """
    args = tuple(args)
    graph = [i for i, a in enumerate(args) if is_nnx(a)]
    for i, a in enumerate(args):
        if i not in graph and any(is_nnx(x) for x in jax.tree.leaves(a, is_leaf=is_nnx)):
            raise ValueError(
                f"argument {names[i]!r} holds an NNX object inside a container; pass each "
                "nnx.Module / nnx.Optimizer as its own argument"
            )
        if i not in graph:
            check_argument(a, names[i])
    rest = [i for i in range(len(args)) if i not in graph]
    parts = {i: partition(args[i]) for i in rest}
    static = {i: st for i, (_, st) in parts.items() if st is not None}
    if not graph and not static:
        return Pure(fn, args, tuple(names), None)
    if not graph:

        def filtered(*arrays):
            full = [combine(a, static.get(i)) for i, a in enumerate(arrays)]
            return arrays_only(fn(*full))

        # the arguments' own names in JAX's debug info (buffer names: model.layers.mlp.weight)
        labels = [n if n.isidentifier() else f"arg{i}" for i, n in enumerate(names)]
        if len(set(labels)) == len(labels):
            only = inspect.Parameter.POSITIONAL_ONLY
            filtered.__signature__ = inspect.Signature([inspect.Parameter(n, only) for n in labels])
        return Pure(filtered, tuple(parts[i][0] for i in rest), tuple(names), None)
    graphdef, state = nnx.split(tuple(args[i] for i in graph))

    def pure(nnx_state, *others):
        objs = nnx.merge(graphdef, nnx_state)
        full = list(args)
        for i, obj in zip(graph, objs, strict=True):
            full[i] = obj
        for i, value in zip(rest, others, strict=True):
            full[i] = combine(value, static.get(i))
        out = fn(*full)
        return nnx.split(objs)[1], arrays_only(out)

    nnx_name = "+".join(names[i] for i in graph)
    return Pure(
        pure, (state, *(parts[i][0] for i in rest)), (nnx_name, *(names[i] for i in rest)), 0
    )


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _hidden_arrays(x: Any) -> int:
    """How many arrays an opaque (non-pytree) object holds in its attributes, one level deep."""
    try:
        values = list(vars(x).values())
    except TypeError:
        return 0
    n = 0
    for v in values:
        if is_array(v):
            n += 1
        elif isinstance(v, (list, tuple, dict)):
            n += sum(1 for y in jax.tree.leaves(v) if is_array(y))
    return n


def check_argument(arg: Any, name: str) -> None:
    """Refuse an argument whose arrays JAX cannot see (they would be compile-time constants,
    not arguments, and their bytes missing from every figure).

    Raises:
      ValueError: a flax.linen Module (its parameters live in its variables, not in it), a
        leaf that is not a pytree but holds arrays in its attributes (one line saying what to
        pass instead), or an array or ``ShapeDtypeStruct`` with a negative dimension.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
        if is_array(leaf) and any(d < 0 for d in leaf.shape):
            where = jax.tree_util.keystr(path) or "itself"
            raise ValueError(
                f"argument {name!r} ({where}) has shape {tuple(leaf.shape)}: a dimension is "
                "negative; every dimension must be 0 or more"
            )
        if is_array(leaf) or isinstance(leaf, _SCALARS):
            continue
        kind = type(leaf).__name__
        if isinstance(leaf, nn.Module):
            raise ValueError(
                f"argument {name!r} is a flax.linen Module ({kind}), which holds no arrays: pass "
                f"its variables (variables = model.init(key, x)) and call model.apply(variables, "
                "...) in the loss"
            )
        n = _hidden_arrays(leaf)
        if n:
            raise ValueError(
                f"argument {name!r} holds a {kind}, which is not a JAX pytree: its {n} arrays "
                "would be compile-time constants, not arguments; make it a pytree (an "
                "equinox.Module, a flax.struct.dataclass, jax.tree_util.register_dataclass) or "
                "pass its arrays"
            )


def argument_parts(pure: Pure, originals: Sequence[Any] = ()) -> dict[str, int]:
    """Bytes of each argument by role; the parts add up to the arguments' bytes.

    An argument with ``params`` and ``opt_state`` attributes (a
    :class:`~remat_kit.training.TrainState`) counts as ``params`` and ``opt_state`` (its step
    counter with the optimizer state). The merged NNX state is split per object: an
    ``nnx.Optimizer``'s variables count as ``opt_state``; a module's ``nnx.Param`` variables as
    ``params`` and its other variables (RNG counters, batch statistics) as ``other``. Other
    arguments count under their names.

    Args:
      pure: from :func:`purify`.
      originals: the arguments given to :func:`purify` (to tell optimizers from modules).
    """
    parts: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        parts[key] = parts.get(key, 0) + n

    for i, (name, arg) in enumerate(zip(pure.names, pure.args, strict=True)):
        if i != pure.nnx_index and hasattr(arg, "params") and hasattr(arg, "opt_state"):
            params = leaf_bytes(arg.params)  # a TrainState: its step counter with opt_state
            add("params", params)
            add("opt_state", leaf_bytes(arg) - params)
            continue
        if i != pure.nnx_index:
            add(name, leaf_bytes(arg))
            continue
        objs = [a for a in originals if is_nnx(a)]
        for k in arg.keys():
            obj = objs[k] if k < len(objs) else None
            if isinstance(obj, nnx.Optimizer):
                add("opt_state", leaf_bytes(arg[k]))
            else:
                params, rest = nnx.split_state(arg[k], nnx.Param, ...)
                add("params", leaf_bytes(params))
                if leaf_bytes(rest):
                    add("other", leaf_bytes(rest))
    return parts


@dataclasses.dataclass(frozen=True)
class LossTrace:
    """One trace of a loss (:meth:`Program.loss_trace`): its jaxpr, the loss as a function of
    arrays evaluating it (``pure``), and ``call``, the loss as the step calls it (its own
    arguments: NNX objects updated with what the loss changed, static leaves as given)."""

    jaxpr: Any  # jax.extend.core.ClosedJaxpr
    pure: Pure
    out_tree: Any

    @classmethod
    def of(cls, pure: Pure) -> LossTrace:
        closed, shape = jax.make_jaxpr(pure.fn, return_shape=True)(*pure.args)
        out_tree = jax.tree.structure(shape)
        run = jax_core.jaxpr_as_fun(closed)

        def frozen(*arrays):
            return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(arrays)))

        frozen.__name__ = getattr(pure.fn, "__name__", "loss")
        return cls(closed, dataclasses.replace(pure, fn=frozen), out_tree)

    def call(self, *full: Any) -> Any:
        """The loss on the step's view of its arguments (what :func:`purify` split, split the
        same way), evaluated from the trace."""
        if self.pure.nnx_index is None:
            return self.pure.fn(*(partition(a)[0] for a in full))
        graph = [i for i, a in enumerate(full) if is_nnx(a)]
        objs = tuple(full[i] for i in graph)
        state = nnx.split(objs)[1]
        rest = [partition(full[i])[0] for i in range(len(full)) if i not in graph]
        new_state, out = self.pure.fn(state, *rest)
        nnx.update(objs, new_state)
        return out
