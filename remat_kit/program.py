"""A user's training program as remat-kit reads it: a step (or loss) factory and its arguments.

remat-kit's tools ask one question of a program: *what does this step cost under policy P?* A
:class:`Program` answers it for any JAX/Flax code, written the way its author writes it:

- :meth:`Program.from_loss`: a factory ``make_loss(policy) -> loss(*args)`` (the function the
  user differentiates, with ``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat`` inside taking
  ``policy``); remat-kit builds the training step around it (``value_and_grad`` over
  ``argnums`` plus an optax update, parameters and optimizer state donated).
- :meth:`Program.from_step`: a factory ``make_step(policy) -> step(*args)`` for the user's own
  step (an idiomatic NNX step that mutates its model and ``nnx.Optimizer`` included); give
  ``make_loss`` too for the residual table and the doctor.

The factory receives a ``jax.checkpoint`` policy callable, or ``None`` for ``no-remat``: build
the step *without* remat then (``jax.checkpoint(f, policy=None)`` would save nothing).
Arguments are arrays, ``jax.ShapeDtypeStruct`` pytrees, or NNX objects (``nnx.Module``,
``nnx.Optimizer``, real or from ``nnx.eval_shape``): NNX objects are split into their state and
merged inside the traced function, and their updated state is returned, so a step that mutates
them keeps its backward pass and update (a plain ``jax.jit`` of such a step drops both).
Pytrees holding other leaves than arrays (an ``equinox.Module`` with its Python floats, bools and
activation functions) are taken with equinox's filter semantics: the array leaves are the
program's arguments, every other leaf is static (closed over, as ``eqx.partition`` /
``eqx.filter_jit`` do), and only the array leaves of the step's outputs are kept; the
parameters of :meth:`Program.from_loss` are differentiated in their array leaves only (as
``eqx.filter_value_and_grad``), and the optimizer state is made for those.

The bundled models are Programs too (:func:`remat_kit.zoo.preset`); the tools never ask
which kind they hold.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> def make_loss(policy):
    ...     def layer(x, w):
    ...         return jnp.tanh(checkpoint_name(x @ w, "hidden"))
    ...     body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    ...     return lambda w, x: body(x, w).sum()
    >>> prog = Program.from_loss(make_loss, jnp.ones((4, 4)), jnp.ones((2, 4)), name="toy")
    >>> prog.name, prog.argument_names
    ('toy', ('opt_state', 'w', 'x'))
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jax_core

from remat_kit import targets as T
from remat_kit.optimizers import make_optimizer
from remat_kit.policies import PolicySpec, get_policy_spec, remat_implementation
from remat_kit.units import format_bytes
from remat_kit.validation import positive_int, unknown_value_error
from remat_kit.walker import (
    Residual,
    TagResiduals,
    group_by_tag,
    holds,
    remat_in_loop,
    remat_policy,
    remat_segments,
    saved_residuals,
    traced_flops,
    wraps_whole_loop,
)

#: ``make_step`` / ``make_loss``: a jax.checkpoint policy (None: no remat) -> function.
Factory = Callable[[Callable[..., Any] | None], Callable[..., Any]]
#: ``(target, the step's argument names) -> Placement``: a program's layout (:func:`sharded`).
Layout = Callable[[T.Target, Sequence[str]], "Placement"]


def jax_policy(spec: PolicySpec) -> Callable[..., Any] | None:
    """The policy a factory receives: ``None`` for ``no-remat`` (build without remat)."""
    return spec.to_jax() if spec.wrap else None


#: NNX objects with state: modules and optimizers (``nnx.Pytree`` in flax >= 0.11,
#: ``nnx.Object`` before).
_NNX_OBJECT = getattr(nnx, "Pytree", None) or nnx.Object


def _is_nnx(x: Any) -> bool:
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
class _Static:
    """The non-array leaves of one argument, to put back around its array leaves."""

    treedef: Any
    leaves: tuple[Any, ...]
    mask: tuple[bool, ...]  # True where the leaf is an array (an argument)


def partition(tree: Any, keep: Callable[[Any], bool] = is_array) -> tuple[Any, _Static | None]:
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
    static = _Static(treedef, others, mask)
    return jax.tree.unflatten(treedef, arrays), static


def combine(arrays: Any, static: _Static | None) -> Any:
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
    parts = [(a, None) if _is_nnx(a) else partition(a) for a in args]
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


def _summary(arg: Any) -> str:
    """``int32[2, 33]`` for one array; ``Model (12 arrays float32, 1.00 MiB)`` otherwise."""
    tree = nnx.state(arg) if _is_nnx(arg) else arg
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]
    if len(leaves) == 1 and leaves[0] is tree:
        return f"{tree.dtype.name}{list(tree.shape)}"
    dtypes = "/".join(sorted({x.dtype.name for x in leaves}))
    kind = f"{type(arg).__name__} " if _is_nnx(arg) else ""
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
    graph = [i for i, a in enumerate(args) if _is_nnx(a)]
    for i, a in enumerate(args):
        if i not in graph and any(_is_nnx(x) for x in jax.tree.leaves(a, is_leaf=_is_nnx)):
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
        objs = [a for a in originals if _is_nnx(a)]
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
        graph = [i for i, a in enumerate(full) if _is_nnx(a)]
        objs = tuple(full[i] for i in graph)
        state = nnx.split(objs)[1]
        rest = [partition(full[i])[0] for i in range(len(full)) if i not in graph]
        new_state, out = self.pure.fn(state, *rest)
        nnx.update(objs, new_state)
        return out


#: What a program computes once and every tool reads (its loss traces, its policy reach): kept
#: beside the program, which stays a plain value, keyed by its identity and dropped with it.
_MEMO: dict[int, dict[Any, Any]] = {}


def memo(program: Any, key: Any, make: Callable[[], Any]) -> Any:
    """``make()`` once per ``program`` (by identity) and ``key``; later calls read it. The memo
    is dropped when the program is (a :func:`dataclasses.replace` copy starts a new one)."""
    held = _MEMO.get(id(program))
    if held is None:
        held = _MEMO[id(program)] = {}
        weakref.finalize(program, _MEMO.pop, id(program), None)
    if key not in held:
        held[key] = make()
    return held[key]


@dataclasses.dataclass(frozen=True)
class Program:
    """A training program: what remat-kit compiles and walks for each policy.

    Attributes:
      name: shown in reports.
      make_step: ``policy -> step``; ``step(*args)`` is one training step.
      args: the step's arguments (arrays, ``ShapeDtypeStruct`` pytrees, NNX objects).
      donate_argnums: step arguments donated to its outputs (updated in place).
      make_loss: ``policy -> loss``; the differentiated function, for residuals by tag and the
        doctor (None: not given).
      loss_args: the loss's arguments.
      argnums: which loss arguments are differentiated (integer arrays never are).
      argument_names: names of the step's arguments (from its signature).
    """

    name: str
    make_step: Factory
    args: tuple[Any, ...]
    donate_argnums: tuple[int, ...] = ()
    make_loss: Factory | None = None
    loss_args: tuple[Any, ...] = ()
    argnums: tuple[int, ...] = (0,)
    argument_names: tuple[str, ...] = ()
    #: How the step's arguments are laid out over a target's devices (:func:`sharded`); None:
    #: one device, unsharded. Set it with ``dataclasses.replace(program, layout=...)``.
    layout: Layout | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``loss -> step`` of a :meth:`from_loss` program (the step built around a given loss);
    #: None for a user's own step.
    step_of_loss: Callable[[Callable[..., Any]], Callable[..., Any]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    def __repr__(self) -> str:
        """Short: name, each argument summarised (one array as ``int32[2, 33]``, a pytree or NNX
        object as its array count, dtypes and bytes), donated arguments, whether a loss is given
        (the dataclass repr printed every argument array)."""
        names = self.argument_names or tuple(f"arg{i}" for i in range(len(self.args)))
        args = ", ".join(f"{n}: {_summary(a)}" for n, a in zip(names, self.args, strict=False))
        loss = "yes" if self.make_loss is not None else "no"
        return (
            f"Program({self.name!r}, args=({args}), donate_argnums={self.donate_argnums}, "
            f"loss={loss})"
        )

    @classmethod
    def from_loss(
        cls,
        make_loss: Factory,
        *args: Any,
        optimizer: str | optax.GradientTransformation = "adamw",
        argnums: int | Sequence[int] = 0,
        name: str | None = None,
    ) -> Program:
        """A program whose step is ``value_and_grad(loss, argnums)`` plus an optax update:
        ``step(opt_state, *args) -> (opt_state, (updated parameters...), loss)`` (an NNX module
        updated in place is not in the tuple).

        Args:
          make_loss: ``policy -> loss(*args) -> scalar``.
          *args: the loss's arguments; those in ``argnums`` are the parameters (pytrees of
            float arrays, or pytrees such as an ``equinox.Module`` whose other leaves are
            static), updated by ``optimizer`` in their array leaves; an ``nnx.Module`` is
            differentiated by its ``nnx.Param`` state and updated in place, so the step's new
            NNX state carries the update (fed to the next step, its buffers donated).
          optimizer: a name of :func:`remat_kit.training.make_optimizer` (``"adamw"``,
            ``"sgd"``, ``"adafactor"``, the bundled models' settings) or an optax transformation;
            its state is an
            argument of the step (donated, with the parameters).
          argnums: the differentiated arguments.
          name: for reports (default: the factory's name).

        Raises:
          ValueError: ``argnums`` out of range or naming an argument with no float arrays
            (integer and boolean leaves beside floats are carried, not differentiated), or an
            NNX object with an integer ``nnx.Param``; a parameter
            argument with no array leaves; an argument JAX cannot see into (not a pytree, a
            linen Module); a loss that does not return a float scalar; unknown optimizer.
        """
        nums = _argnums(argnums, args)
        names = ("opt_state", *param_names(make_loss(None), len(args)))
        _check_params(args, nums, names[1:])
        check_loss(make_loss, args, names[1:])
        tx = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
        opt_state = _initial_opt_state(tx, args, nums)
        step_of_loss = functools.partial(_loss_step, tx=tx, nums=nums, names=names)

        def make_step(policy):
            return step_of_loss(make_loss(policy))

        return cls(
            name=name or getattr(make_loss, "__name__", "program"),
            make_step=make_step,
            step_of_loss=step_of_loss,
            args=(opt_state, *args),
            donate_argnums=(0, *(1 + i for i in nums)),
            make_loss=make_loss,
            loss_args=tuple(args),
            argnums=nums,
            argument_names=names,
        )

    @classmethod
    def from_step(
        cls,
        make_step: Factory,
        *args: Any,
        donate_argnums: int | Sequence[int] = (),
        make_loss: Factory | None = None,
        loss_args: Sequence[Any] = (),
        argnums: int | Sequence[int] = 0,
        name: str | None = None,
    ) -> Program:
        """A program from the user's own step factory (see the module docstring).

        Raises:
          ValueError: ``donate_argnums`` or ``argnums`` out of range; with ``make_loss``, as
            :meth:`from_loss` (parameters without arrays, a loss that is not a float scalar).
        """
        donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        for i in donate:
            if not 0 <= i < len(args):
                raise ValueError(
                    f"donate_argnums {i} out of range for a step of {len(args)} arguments"
                )
        nums = _argnums(argnums, loss_args) if make_loss is not None else (0,)
        if make_loss is not None:
            loss_names = param_names(make_loss(None), len(loss_args))
            _check_params(tuple(loss_args), nums, loss_names)
            check_loss(make_loss, tuple(loss_args), loss_names)
        return cls(
            name=name or getattr(make_step, "__name__", "program"),
            make_step=make_step,
            args=tuple(args),
            donate_argnums=donate,
            make_loss=make_loss,
            loss_args=tuple(loss_args),
            argnums=nums,
            argument_names=tuple(param_names(make_step(None), len(args))),
        )

    # -- What every tool asks of a program. A bundled preset answers some of these from what
    # -- it knows of its model (:class:`remat_kit.zoo.PresetProgram`); the tools never ask which.

    #: Sequences per step and tokens per sequence, where the program knows them (a preset);
    #: None for a user's program (its arguments carry its shapes).
    batch_size: int | None = dataclasses.field(default=None, init=False, repr=False)
    seq_len: int | None = dataclasses.field(default=None, init=False, repr=False)
    #: The optimizer's name and the (dp, fsdp, tp) mesh, where the program says (a preset);
    #: None for a user's program (its step holds its optimizer; it runs on one device).
    optimizer: Any = dataclasses.field(default=None, init=False, repr=False)
    mesh: Any = dataclasses.field(default=None, init=False, repr=False)

    @property
    def title(self) -> str:
        """The program as a report's name shows it."""
        return self.name

    @property
    def logits(self) -> tuple[tuple[int, int, int], str] | None:
        """``((batch, seq, vocab), compute dtype)`` of the logits where known (a preset)."""
        return None

    def factory_input(self, spec: PolicySpec) -> Any:
        """What the factories receive for ``spec``: its ``jax.checkpoint`` policy (None for
        ``no-remat``)."""
        return jax_policy(spec)

    def step(self, spec: PolicySpec) -> Pure:
        """The step under ``spec`` as a function of arrays (NNX objects split and merged).

        A :meth:`from_loss` program's step differentiates the loss's one trace under ``spec``
        (:meth:`loss_trace`): what is compiled is what the residual table, the tags and the
        doctor walk, even where the factory's trace depends on state it changes (a class
        swapped in at module level to add remat)."""
        if self.step_of_loss is not None:
            fn = self.step_of_loss(self.loss_trace(spec).call)
        else:
            fn = self.make_step(self.factory_input(spec))
        return purify(fn, self.args, self.argument_names)

    def loss(self, spec: PolicySpec) -> Pure | None:
        """The loss under ``spec`` as a function of arrays (NNX objects split): its one trace
        (:meth:`loss_trace`); None without ``make_loss``."""
        if self.make_loss is None:
            return None
        return self.loss_trace(spec).pure

    def loss_trace(self, spec: PolicySpec) -> LossTrace:
        """The loss built for ``spec`` and traced once per program and spec (later calls read
        it): every tool walks and compiles this jaxpr, never a second call of the factory.

        Raises:
          ValueError: the program has no ``make_loss``.
        """
        if self.make_loss is None:
            raise ValueError(f"program {self.name!r} has no loss (make_loss)")

        def trace() -> LossTrace:
            loss = self.make_loss(self.factory_input(spec))
            names = param_names(loss, len(self.loss_args))
            return LossTrace.of(purify(loss, self.loss_args, names))

        return memo(self, ("loss_trace", spec), trace)

    def baseline_step(self) -> Pure:
        """The step without remat: the denominator of the recompute ratio."""
        return self.step(get_policy_spec("no-remat"))

    def donated(self, pure: Pure) -> tuple[int, ...]:
        """``donate_argnums`` of the pure step (:func:`purify` puts the NNX objects' state
        first, the other arguments after it in order): the NNX state is donated (updated in
        place), and each other donated argument at its place there (a :meth:`from_loss`
        optimizer state beside an ``nnx.Module``'s parameters)."""
        if pure.nnx_index is None:
            return self.donate_argnums
        rest = [i for i, a in enumerate(self.args) if not _is_nnx(a)]
        return (pure.nnx_index, *(1 + rest.index(i) for i in self.donate_argnums if i in rest))

    def place(self, target: T.Target) -> Placement:
        """Where the step's arguments live on ``target``: laid out by :attr:`layout` where the
        program has one, else on one device, each array leaf a ``ShapeDtypeStruct`` with the
        target's single-device sharding."""
        if self.layout is not None:
            return self.layout(T.get_target(target), self.baseline_step().names)
        sharding = T.abstract_sharding(target)
        return Placement(lambda args: tuple(T.abstractify(a, sharding) for a in args))

    @property
    def scan_layers(self) -> bool | None:
        """Whether the layers run under a scan, where the program's config says (a preset);
        None for a user's program: advice then speaks of its own code (``jax.lax.scan``,
        ``nn.scan``, ``nnx.scan``, its own checkpoint names)."""
        return None

    @property
    def model_config(self) -> Any:
        """The bundled model's :class:`~remat_kit.models.ModelConfig` (a preset); None for a
        user's program."""
        return None

    @property
    def default_policy(self) -> PolicySpec | str | None:
        """The policy the program is configured with (a preset's ``remat_policy``); None: the
        factory receives whichever is asked."""
        return None

    def saved(self, spec: PolicySpec) -> list[Residual] | None:
        """The values the loss keeps for its backward pass under ``spec``, one
        :class:`~remat_kit.walker.Residual` each (arguments flagged); None without
        ``make_loss``. Traces the loss, compiles nothing."""
        loss = self.loss(spec)
        if loss is None:
            return None
        return list(saved_residuals(loss.fn, *loss.args))

    def residuals(self, spec: PolicySpec, placement: Placement) -> tuple[TagResiduals, ...] | None:
        """:meth:`saved` by checkpoint tag (parameters excluded; shapes as the VJP keeps them,
        e.g. [layers, batch, seq, d_model] under a layer scan); None without ``make_loss``."""
        saved = self.saved(spec)
        return None if saved is None else tuple(group_by_tag(saved))

    def buffer_names(self, rows: Sequence[TagResiduals], placement: Placement) -> BufferNames:
        """What names the buffers live at the peak: each residual row's shape -> its tags, and
        the differentiated arguments' shapes (parameters; their gradients share them)."""
        params = [(x.dtype.name, tuple(x.shape)) for x in self.param_leaves()]
        stacked: dict[tuple[str, tuple[int, ...]], tuple[str, ...]] = {}
        for row in rows:
            key = (row.dtype, tuple(row.shape))
            if row.tag not in stacked.get(key, ()):
                stacked[key] = (*stacked.get(key, ()), row.tag)
        return BufferNames(stacked=stacked, params=frozenset(params))

    def param_leaves(self) -> list[Any]:
        """The arrays the loss differentiates: the float array leaves of its ``argnums``
        arguments (not integer or boolean buffers), an NNX object's ``nnx.Param`` state only
        (not its RNG keys, counters or batch statistics); empty without a loss."""
        out = []
        for i in self.argnums if self.make_loss is not None else ():
            arg = self.loss_args[i]
            out += [x for x in jax.tree.leaves(_diff_part(arg)[0]) if is_float_array(x)]
        return out

    def reach(self) -> PolicyReach:
        """Whether the factories pass the policy on (:func:`policy_reach`: two to four traces),
        judged once per program and remat implementation: every tool, and each compile a
        search makes (recommend's candidates, the sweep's points), reads the same judgement."""
        return memo(self, ("reach", remat_implementation()), lambda: policy_reach(self))

    def request_key(self) -> tuple[Any, ...] | None:
        """What decides this program's reports, for the report cache, where it can be said
        without tracing (a preset's config and shapes); None: the program is traced first and
        its compiles are cached by their lowered text."""
        return None

    def variant(self, **changes: Any) -> Program:
        """The same program with ``changes`` (``batch_size``, ``seq_len``, model fields such as
        ``remat_group_size``), for the searches that vary the model (recommend's batch, group
        size and structure).

        Raises:
          ValueError: always for a user's program: its factory fixes its shapes and layers.
        """
        raise ValueError(
            f"program {self.name!r} cannot be varied ({', '.join(sorted(changes))}): it carries "
            "its own arguments; change the shapes in its factory and run again"
        )


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


@dataclasses.dataclass(frozen=True)
class PolicyReach:
    """Whether a program's factory passes the policy it receives to its remat segments.

    Read from two traces (nothing compiled) of the loss (the step where no loss is given): one
    with a probe policy, a fresh function no model holds, and one with None (``no-remat``).

    Attributes:
      program: the program's name.
      segments: remat segments (``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat`` /
        ``eqx.filter_checkpoint``: the ``remat`` primitive) in the probe trace.
      reached: those of them whose policy is the probe or holds it (a wrapper around it).
      without_policy: remat segments in the trace for ``no-remat`` (a factory building without
        remat has none).
      part: which of the program's factories this judges (``make_step``, ``make_loss``).
      linearized: None where the segments were counted; under a ``jax_remat3`` that
        differentiates a remat segment as it traces it (jax 0.10.2's: a step's trace holds
        none; jax 0.12's leaves the segments in the step's trace, counted), whether
        the trace changes with the policy (save-everything against save-nothing): True, the
        policy reaches segments the trace no longer shows (``segments`` and ``reached`` are
        then 0, not counted).
      around_loop: those segments that wrap a whole loop with no remat in its body
        (:func:`remat_kit.walker.wraps_whole_loop`: ``jax.checkpoint`` around a ``lax.scan``).
      lone: the trace's only remat segment sits outside every loop (``jax.checkpoint`` around
        the whole loss: :data:`remat_kit.memory.undone.LONE_SEGMENT_CAUSE`).
      differentiated: those of the ``reached`` segments JAX had already differentiated when
        they took the policy (the ``remat`` primitive's ``differentiated`` parameter: a policy
        set on a step after its gradient, e.g. ``remat_kit.inject_policy`` around the whole
        step), where it changes nothing JAX keeps.
    """

    program: str
    segments: int
    reached: int
    without_policy: int
    part: str = "factory"
    linearized: bool | None = None
    around_loop: int = 0
    lone: bool = False
    differentiated: int = 0

    def after_gradient_cause(self) -> str | None:
        """Why every policy compiles to one program when each reached segment was already
        differentiated (None otherwise), with the fix."""
        if not self.reached or self.differentiated < self.reached:
            return None
        return (
            f"the {self.part}'s remat segments take the policy only after the step's gradient is "
            "taken (remat_kit.inject_policy wrapped around a whole step), when JAX has already "
            "chosen what they keep; hand it to the loss's remat calls: Program.from_loss("
            "inject_policy(loss), ...), or inject_policy(loss)(policy) inside make_step"
        )

    @property
    def passes(self) -> bool:
        """The policy decides something: at least one remat segment takes it."""
        return self.reached > 0 or bool(self.linearized)

    def error(self) -> str:
        """One line: why every policy would compile to one program, and what to do."""
        if self.linearized is False:
            return (
                f"the {self.part} of program {self.program!r} traces to the same step under "
                "every policy (under jax_remat3, which differentiates remat segments as it "
                "traces them, save-everything and save-nothing gave one step), so every policy "
                "would compile to one program; pass the policy it receives to its jax.checkpoint "
                "/ nn.remat / nnx.remat / eqx.filter_checkpoint calls"
            )
        if not self.segments:
            return (
                f"the {self.part} of program {self.program!r} applies no remat: its trace holds "
                "no remat segment (jax.checkpoint / nn.remat / nnx.remat / eqx.filter_checkpoint), "
                "so every policy would compile to the no-remat program; wrap its layers with the "
                "policy it receives: jax.checkpoint(layer, policy=policy)"
            )
        return (
            f"the {self.part} of program {self.program!r} does not pass the policy it receives "
            f"on: none of its {self.segments} remat segment(s) takes it (a remat call with no "
            "policy= or a fixed policy of its own), so every policy would compile to one "
            "program; pass the policy it receives to those remat calls, or wrap the loss in "
            "remat_kit.inject_policy(loss) (docs/own-model-no-policy-hook.md)"
        )

    def no_remat_note(self) -> str | None:
        """A note for the ``no-remat`` row when the factory remats even when given None."""
        if not self.without_policy:
            return None
        return (
            f"not a no-remat baseline: the factory still builds {self.without_policy} remat "
            "segment(s) when given no policy (None), so this row includes that remat and no "
            "recompute ratio is reported against it; build without remat for None (remat_kit."
            "inject_policy does)"
        )


def policy_reach(program: Program) -> PolicyReach:
    """Trace ``program``'s step, and its loss where it has one, with a probe policy and with
    None and count the remat segments that take the policy (:class:`PolicyReach`). The step is
    what compiles and the loss is what is walked for residuals: a policy either drops is not
    passed (the loss's judgement where it drops it, else the step's). Traces only."""
    loss = None
    if program.make_loss is not None:
        loss = factory_reach(program.make_loss, program.loss_args, program.name, "make_loss")
        if not loss.passes:
            return loss
    step = factory_reach(program.make_step, program.args, program.name, "make_step")
    if step.linearized and loss is not None:  # the loss's trace still shows its segments
        return loss
    return step


def factory_reach(
    make: Factory, args: Sequence[Any], name: str, part: str = "factory"
) -> PolicyReach:
    """:class:`PolicyReach` of a factory ``make(policy) -> fn`` on ``fn``'s arguments ``args``
    (arrays, ``ShapeDtypeStruct`` s, NNX objects, pytrees with static leaves); ``part`` names
    the factory in its messages."""

    def probe(prim: Any, *a: Any, **params: Any) -> bool:  # saves nothing, held by no one
        return jax.checkpoint_policies.nothing_saveable(prim, *a, **params)

    def trace(policy: Any) -> Any:
        fn = make(policy)
        pure = purify(fn, args, param_names(fn, len(args)))
        return jax.make_jaxpr(pure.fn)(*pure.args).jaxpr

    def segments(policy: Any) -> list[Any]:
        return remat_segments(trace(policy))

    jaxpr = trace(probe)
    probed = remat_segments(jaxpr)
    taking = [eqn for eqn in probed if holds(remat_policy(eqn), probe)]
    reached = len(taking)
    after = sum(bool(eqn.params.get("differentiated", False)) for eqn in taking)
    if not probed and remat_implementation() == "remat3":
        # a differentiated trace (a step) under jax 0.10.2's jax_remat3 holds no segment
        # (0.12's keeps them, counted above): judged by whether
        # two policies that keep different values trace to different steps
        cp = jax.checkpoint_policies
        every, none = (
            _trace_text(make, args, p) for p in (cp.everything_saveable, cp.nothing_saveable)
        )
        return PolicyReach(name, 0, 0, 0, part, linearized=every != none)
    around = sum(wraps_whole_loop(eqn) for eqn in probed)
    lone = len(probed) == 1 and not around and not remat_in_loop(jaxpr)
    return PolicyReach(
        name, len(probed), reached, len(segments(None)), part, around_loop=around, lone=lone,
        differentiated=after,
    )  # fmt: skip


def _trace_text(make: Factory, args: Sequence[Any], policy: Any) -> str:
    """The jaxpr of ``make(policy)`` on ``args``, as text (two traces compared)."""
    fn = make(policy)
    pure = purify(fn, args, param_names(fn, len(args)))
    return str(jax.make_jaxpr(pure.fn)(*pure.args))


def _argnums(argnums: int | Sequence[int], args: Sequence[Any]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in nums:
        if not 0 <= i < len(args):
            raise ValueError(f"argnums {i} out of range for a function of {len(args)} arguments")
        # an NNX object is differentiated by its nnx.Param state (:func:`_diff_part`): an
        # integer nnx.Param is refused; elsewhere integer and boolean arrays (masks, position
        # ids) are carried, not differentiated, unless the argument holds nothing else
        nnx_state = _is_nnx(args[i])
        tree = nnx.state(args[i], nnx.Param) if nnx_state else args[i]
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        bad = [
            jax.tree_util.keystr(path)
            for path, x in leaves
            if is_array(x) and not is_float_array(x)
        ]
        if bad and (nnx_state or not any(is_float_array(x) for _, x in leaves)):
            where = f" (at {', '.join(p or 'the argument itself' for p in bad[:3])})"
            what = "no float arrays, only" if not nnx_state else "nnx.Param"
            raise ValueError(
                f"argnums {i}: argument {i} holds {what} integer or boolean arrays{where}, "
                "which are not differentiated; pass the float parameters' position"
            )
    return nums


@dataclasses.dataclass(frozen=True)
class _NnxRest:
    """What an NNX parameter argument keeps besides its ``nnx.Param`` state: its graph and
    its other variables (batch statistics, RNG counters: not differentiated)."""

    graphdef: Any
    rest: Any


def _diff_part(arg: Any) -> tuple[Any, _Static | _NnxRest | None]:
    """A parameter argument's differentiated arrays and what :func:`_whole` needs to rebuild
    it: an NNX object's ``nnx.Param`` state (a pytree of arrays, so the optimizer's state
    holds no NNX object), other pytrees' array leaves (:func:`partition`)."""
    if _is_nnx(arg):
        graphdef, params, rest = nnx.split(arg, nnx.Param, ...)
        return params, _NnxRest(graphdef, rest)
    return partition(arg)


def _whole(arrays: Any, static: _Static | _NnxRest | None) -> Any:
    """The argument :func:`_diff_part` split, from its differentiated arrays."""
    if isinstance(static, _NnxRest):  # its variables made anew here, in the current trace
        return nnx.merge(static.graphdef, arrays, jax.tree.map(lambda x: x, static.rest))
    return combine(arrays, static)


def _initial_opt_state(
    tx: optax.GradientTransformation, args: Sequence[Any], nums: Sequence[int]
) -> Any:
    """The optimizer's initial state for the array leaves of the parameters ``args[nums]``."""
    # the differentiated arrays: each parameter's array leaves (filter semantics)
    params = tuple(partition(_diff_part(args[i])[0], is_float_array)[0] for i in nums)
    concrete = all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    # the optimizer's own initial state on concrete parameters (abstract ones: its shapes)
    return tx.init(params) if concrete else jax.eval_shape(tx.init, params)


def _loss_step(
    loss: Callable[..., Any],
    tx: optax.GradientTransformation,
    nums: tuple[int, ...],
    names: tuple[str, ...],
) -> Callable[..., Any]:
    """The step of :meth:`Program.from_loss` around ``loss``: gradients of the arguments
    ``nums``, then ``tx``'s update; ``names``: the step's argument names."""

    def step(opt_state, *loss_args):
        parts = [_diff_part(loss_args[i]) for i in nums]
        # floats differentiated; integer and boolean arrays carried (filter semantics)
        floats = [partition(arrays, is_float_array) for arrays, _ in parts]

        def of_arrays(*diff):
            full = list(loss_args)
            for n, (i, arrays) in enumerate(zip(nums, diff, strict=True)):
                full[i] = _whole(combine(arrays, floats[n][1]), parts[n][1])
            # what the loss changed in an NNX parameter's other variables (RNG
            # counters, batch statistics), carried out of the differentiated function
            changed = tuple(
                nnx.split(full[i], nnx.Param, ...)[2] if _is_nnx(full[i]) else None for i in nums
            )
            return loss(*full), changed

        params = tuple(f for f, _ in floats)
        (value, changed), grads = jax.value_and_grad(
            of_arrays, argnums=tuple(range(len(nums))), has_aux=True
        )(*params)
        updates, opt_state = tx.update(grads, opt_state, params)
        new, kept = optax.apply_updates(params, updates), []
        for n, (i, arrays, rest) in enumerate(zip(nums, new, changed, strict=True)):
            arrays = combine(arrays, floats[n][1])
            if _is_nnx(loss_args[i]):  # updated in place: the step's NNX state out
                nnx.update(loss_args[i], arrays, rest)
            else:
                kept.append(arrays)
        # outputs in the order of the donated inputs (optimizer state, parameters), as
        # a user's step returns them: out of order, JAX pairs each donated input with
        # the first output of its shape (Adam's moments have the parameters' shapes),
        # XLA:CPU then copies to update in place, and the peak was 1-6% above the
        # user's own step (s19 trials; the h100 target's agreed either way)
        return opt_state, tuple(kept), value

    # the loss's own argument names in JAX's debug info, so buffers read "params..."
    # (the loss's name for them), not "loss_args[0]..."
    if all(n.isidentifier() for n in names) and len(set(names)) == len(names):
        only = inspect.Parameter.POSITIONAL_ONLY
        step.__signature__ = inspect.Signature([inspect.Parameter(n, only) for n in names])
    return step


def _check_params(args: Sequence[Any], nums: Sequence[int], names: Sequence[str]) -> None:
    """Each differentiated argument holds arrays (one line naming what to pass otherwise)."""
    for i in nums:
        arg = args[i]
        check_argument(arg, names[i])
        if _is_nnx(arg) or any(is_array(x) for x in jax.tree.leaves(arg)):
            continue
        leaves = jax.tree.leaves(arg)
        what = type(arg).__name__ + (
            f" of {len(leaves)} non-array leaves" if leaves and leaves != [arg] else ""
        )
        raise ValueError(
            f"argument {names[i]!r} (argnums {i}) holds no arrays ({what}): nothing to "
            "differentiate; pass the parameters: a pytree of float arrays (the linen variables, "
            "an equinox.Module, a dict of arrays) or jax.ShapeDtypeStruct leaves"
        )


def _describe_output(out: Any) -> str:
    if is_array(out):
        return f"{jnp.dtype(out.dtype).name}{list(out.shape)}"
    leaves = jax.tree.leaves(out)
    return f"a {type(out).__name__} of {len(leaves)} leaves"


def check_loss(make_loss: Factory, args: Sequence[Any], names: Sequence[str]) -> None:
    """The loss (built without remat) returns a float scalar, the one thing
    ``jax.value_and_grad`` differentiates; traced abstractly, nothing computed.

    Raises:
      ValueError: a non-scalar, integer or boolean, or structured (tuple, dict) output.
    """
    pure = purify(make_loss(None), args, names)
    out = jax.eval_shape(pure.fn, *pure.args)
    if pure.nnx_index is not None:  # (new NNX state, the loss)
        out = out[1]
    got = _describe_output(out)
    if not is_array(out):
        raise ValueError(
            f"the loss returns {got}, not a scalar: return the scalar loss alone (remat-kit "
            "differentiates it with jax.value_and_grad, without has_aux)"
        )
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        raise ValueError(
            f"the loss returns {got}, which cannot be differentiated: return a float scalar "
            "(e.g. .astype(jnp.float32) before the mean)"
        )
    if out.shape != ():
        raise ValueError(
            f"the loss returns {got}, not a scalar: reduce it to one number (e.g. .mean() over "
            "the batch)"
        )


#: Names a function building a program refers to (its code's global and attribute names).
_BUILDS = frozenset({"Program", "from_loss", "from_step", "preset"})


def _factories(module: Any) -> list[str]:
    """Names in ``module`` that could be a factory: its :class:`Program` objects and the
    functions defined there (not imported) callable with no arguments, those whose code names
    ``Program`` / ``from_loss`` / ``from_step`` / ``preset`` where any does (not a helper
    returning the abstract arguments, which the error listed as valid)."""
    programs, builders, others = [], [], []
    for n, obj in vars(module).items():
        if n.startswith("_"):
            continue
        if isinstance(obj, Program):
            programs.append(n)
        if not inspect.isfunction(obj) or obj.__module__ != module.__name__:
            continue
        try:
            inspect.signature(obj).bind()
        except TypeError:
            continue
        (builders if _BUILDS & set(obj.__code__.co_names) else others).append(n)
    return sorted(programs + (builders or others))


def require_program(obj: Any) -> Program:
    """``obj`` if it is a :class:`Program` (the tools take nothing else).

    Raises:
      ValueError: anything else (one line saying how to make a Program).
    """
    if not isinstance(obj, Program):
        raise ValueError(
            f"expected a remat_kit.Program (Program.from_loss / Program.from_step, or "
            f"remat_kit.preset(name, batch_size, seq_len) for a bundled model), got "
            f"{type(obj).__name__}"
        )
    return obj


def _on_path(folder: str) -> None:
    """Put ``folder`` on ``sys.path`` (first) where it is not yet."""
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _syntax_error(err: SyntaxError, ref: str) -> str:
    """One line for a program file Python cannot parse: file, line, column and its message
    (an error in the code it runs is the user's traceback to read, and is not caught)."""
    where = f"{err.filename}, line {err.lineno}" + (f", column {err.offset}" if err.offset else "")
    return f"cannot load {ref!r}: {type(err).__name__} in {where}: {err.msg}"


def load_program(ref: str) -> Program:
    """The :class:`Program` a reference names: ``"pkg.module:factory"`` or
    ``"path/to/file.py:factory"``, where ``factory()`` (no arguments) returns a Program.

    As Python runs a script, the file's folder (``FILE.py``) or the current folder
    (``MODULE``) is put on ``sys.path`` first, so the program's sibling modules import.

    This is how the command line takes a user's model (``remat-kit analyze --model
    my_models.gpt:program``) beside the bundled preset names.

    Raises:
      ValueError: ``ref`` without ``:``, a module or file that cannot be found or imported, a
        file Python cannot parse (``SyntaxError``: file and line in one line), a missing
        factory, a factory that raises (its exception chained) or that does not return a
        Program (one line naming which).

    A program left with its default name (its loss or step function's, often ``make_loss``)
    is named ``FILE:FACTORY`` (``gpt:program``) in reports; a name given to ``from_loss`` /
    ``from_step`` other than that function's is kept.
    """
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise ValueError(
            f"cannot read {ref!r} as a program: write MODULE:FACTORY (my_pkg.models:program) or "
            "FILE.py:FACTORY (models/gpt.py:program), or give a preset name"
        )
    module = _import_module(ref, module_ref)
    program = _from_factory(ref, module_ref, attr, module)
    if not isinstance(program, Program):
        raise ValueError(
            f"{ref} returned {type(program).__name__}, not a remat_kit.Program; return "
            "Program.from_loss(...) or Program.from_step(...)"
        )
    defaulted = {getattr(f, "__name__", None) for f in (program.make_loss, program.make_step)}
    if program.name in defaulted | {"program"}:  # named after a function (from_loss's default,
        # often ``make_loss``): the reports name it as the user named it instead
        stem = os.path.splitext(os.path.basename(module_ref))[0]
        program = dataclasses.replace(program, name=f"{stem}:{attr}")
    return program


def _import_module(ref: str, module_ref: str) -> Any:
    """The module ``module_ref`` of program reference ``ref`` (a ``.py`` file or a module
    name), imported with its folder on ``sys.path``."""
    if module_ref.endswith(".py"):
        path = os.path.abspath(module_ref)
        if not os.path.isfile(path):
            raise ValueError(f"program file {module_ref!r} does not exist (from {ref!r})")
        name = f"_remat_kit_user_{os.path.splitext(os.path.basename(path))[0]}"
        _on_path(os.path.dirname(path))  # its sibling modules import, as `python FILE.py` has
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except SyntaxError as err:  # the file cannot run at all: where, in one line
            raise ValueError(_syntax_error(err, ref)) from None
        return module
    _on_path(os.getcwd())  # as `python -m` has it: modules of the folder it runs from
    try:
        module = importlib.import_module(module_ref)
    except SyntaxError as err:
        raise ValueError(_syntax_error(err, ref)) from None
    except ModuleNotFoundError as err:
        if err.name and module_ref.startswith(err.name):
            raise ValueError(
                f"cannot import module {module_ref!r} (from {ref!r}): not on the Python path; "
                "run from its folder, set PYTHONPATH, or give a FILE.py:FACTORY path"
            ) from None
        raise
    return module


def _from_factory(ref: str, module_ref: str, attr: str, module: Any) -> Any:
    """What the factory ``attr`` of ``module`` returns (called with no arguments), or the
    Program the name holds."""
    factory = getattr(module, attr, None)
    if factory is None:
        found = _factories(module)
        bad = unknown_value_error("factory", attr, found or ["(none)"])
        raise ValueError(f"{module_ref}: {bad}")
    if callable(factory) and not isinstance(factory, Program):
        try:
            inspect.signature(factory).bind()
        except TypeError:
            raise ValueError(
                f"{ref}: the factory must take no arguments (remat-kit calls {attr}()); wrap it, "
                "e.g. def program(): return Program.from_loss(...)"
            ) from None
        except ValueError:  # no signature (a builtin): just call it
            pass
        try:
            return factory()
        except Exception as err:  # the user's code: one line naming it (the cause chained)
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
            raise ValueError(
                f"{ref}: the factory raised {type(err).__name__}" + (f": {first}" if first else "")
            ) from err
    if not isinstance(factory, Program):  # a module, a constant: nothing to call
        valid = ", ".join(_factories(module)) or "(none)"
        raise ValueError(
            f"{module_ref}: {attr!r} is a {type(factory).__name__}, not a factory (a function "
            f"returning a remat_kit.Program) or a Program; valid: {valid}."
        )
    return factory


def step_flops(program: Program, spec: PolicySpec) -> float:
    """Matmul FLOPs of ``program``'s whole step under ``spec`` (forward, backward and update;
    the global step, not one device's share), counted on its jaxpr (:func:`traced_flops`):
    nothing is compiled. Saving a tag lowers it only where the backward pass then stops
    recomputing the matmul under the tag; the solver's per-tag costs
    (:func:`remat_kit.recommend.tag_costs`) and the doctor's "tags whose saving removes
    recompute" (:func:`remat_kit.doctor.tags.recompute_savers`) both judge by it."""
    pure = program.step(spec)
    return traced_flops(pure.fn, *pure.args)
