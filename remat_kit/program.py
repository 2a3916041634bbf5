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
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from remat_kit.policies import PolicySpec
from remat_kit.training.step import make_optimizer
from remat_kit.units import format_bytes
from remat_kit.validation import unknown_value_error

#: ``make_step`` / ``make_loss``: a jax.checkpoint policy (None: no remat) -> function.
Factory = Callable[[Callable[..., Any] | None], Callable[..., Any]]


def jax_policy(spec: PolicySpec) -> Callable[..., Any] | None:
    """The policy a factory receives: ``None`` for ``no-remat`` (build without remat)."""
    return spec.to_jax() if spec.wrap else None


#: NNX objects with state: modules and optimizers (``nnx.Pytree`` in flax >= 0.11,
#: ``nnx.Object`` before).
_NNX_OBJECT = getattr(nnx, "Pytree", None) or nnx.Object


def _is_nnx(x: Any) -> bool:
    return isinstance(x, _NNX_OBJECT)


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
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _summary(arg: Any) -> str:
    """``int32[2, 33]`` for one array; ``Model (12 arrays float32, 1.00 MiB)`` otherwise."""
    tree = nnx.state(arg) if _is_nnx(arg) else arg
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]
    if len(leaves) == 1 and leaves[0] is tree:
        return f"{jnp.dtype(tree.dtype).name}{list(tree.shape)}"
    dtypes = "/".join(sorted({jnp.dtype(x.dtype).name for x in leaves}))
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
    objects: ``fn(*args)`` runs the user's function and returns ``(result, new_nnx_state)``
    when NNX objects were present, else the user's result."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    names: tuple[str, ...]
    nnx_index: int | None  # position of the merged NNX state among ``args``


def purify(fn: Callable[..., Any], args: Sequence[Any], names: Sequence[str]) -> Pure:
    """Make ``fn(*args)`` a function of arrays: NNX objects among ``args`` are split into one
    state (first argument of the result) and merged back inside; their updated state is an
    output, so mutations (an optimizer update) are part of the program.

    Raises:
      ValueError: an NNX object nested inside a container argument (pass it as its own
        argument).
    """
    args = tuple(args)
    graph = [i for i, a in enumerate(args) if _is_nnx(a)]
    for i, a in enumerate(args):
        if i not in graph and any(_is_nnx(x) for x in jax.tree.leaves(a, is_leaf=_is_nnx)):
            raise ValueError(
                f"argument {names[i]!r} holds an NNX object inside a container; pass each "
                "nnx.Module / nnx.Optimizer as its own argument"
            )
    if not graph:
        return Pure(fn, args, tuple(names), None)
    graphdef, state = nnx.split(tuple(args[i] for i in graph))
    rest = [i for i in range(len(args)) if i not in graph]

    def pure(nnx_state, *others):
        objs = nnx.merge(graphdef, nnx_state)
        full = list(args)
        for i, obj in zip(graph, objs, strict=True):
            full[i] = obj
        for i, value in zip(rest, others, strict=True):
            full[i] = value
        out = fn(*full)
        return out, nnx.split(objs)[1]

    nnx_name = "+".join(names[i] for i in graph)
    return Pure(pure, (state, *(args[i] for i in rest)), (nnx_name, *(names[i] for i in rest)), 0)


def argument_parts(pure: Pure, originals: Sequence[Any] = ()) -> dict[str, int]:
    """Bytes of each argument by role; the parts add up to the arguments' bytes.

    The merged NNX state is split per object: an ``nnx.Optimizer``'s variables count as
    ``opt_state``; a module's ``nnx.Param`` variables as ``params`` and its other variables
    (RNG counters, batch statistics) as ``other``. Other arguments count under their names.

    Args:
      pure: from :func:`purify`.
      originals: the arguments given to :func:`purify` (to tell optimizers from modules).
    """
    parts: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        parts[key] = parts.get(key, 0) + n

    for i, (name, arg) in enumerate(zip(pure.names, pure.args, strict=True)):
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
        """A program whose step is ``value_and_grad(loss, argnums)`` plus an optax update.

        Args:
          make_loss: ``policy -> loss(*args) -> scalar``.
          *args: the loss's arguments; those in ``argnums`` are the parameters (pytrees of
            float arrays), updated by ``optimizer``.
          optimizer: a name of :func:`remat_kit.training.make_optimizer` (``"adamw"``,
            ``"sgd"``, ``"adafactor"``, the bundled models' settings) or an optax transformation;
            its state is an
            argument of the step (donated, with the parameters).
          argnums: the differentiated arguments.
          name: for reports (default: the factory's name).

        Raises:
          ValueError: ``argnums`` out of range or naming an integer array; unknown optimizer.
        """
        nums = _argnums(argnums, args)
        tx = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
        params = tuple(args[i] for i in nums)
        concrete = all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
        # the optimizer's own initial state on concrete parameters (abstract ones: its shapes)
        opt_state = tx.init(params) if concrete else jax.eval_shape(tx.init, params)

        def make_step(policy):
            loss = make_loss(policy)

            def step(opt_state, *loss_args):
                value, grads = jax.value_and_grad(loss, argnums=nums)(*loss_args)
                params = tuple(loss_args[i] for i in nums)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, value

            return step

        names = ("opt_state", *param_names(make_loss(None), len(args)))
        return cls(
            name=name or getattr(make_loss, "__name__", "program"),
            make_step=make_step,
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
          ValueError: ``donate_argnums`` or ``argnums`` out of range.
        """
        donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        for i in donate:
            if not 0 <= i < len(args):
                raise ValueError(
                    f"donate_argnums {i} out of range for a step of {len(args)} arguments"
                )
        return cls(
            name=name or getattr(make_step, "__name__", "program"),
            make_step=make_step,
            args=tuple(args),
            donate_argnums=donate,
            make_loss=make_loss,
            loss_args=tuple(loss_args),
            argnums=_argnums(argnums, loss_args) if make_loss is not None else (0,),
            argument_names=tuple(param_names(make_step(None), len(args))),
        )

    def step(self, spec: PolicySpec) -> Pure:
        """The step under ``spec`` as a function of arrays (NNX objects split and merged)."""
        return purify(self.make_step(jax_policy(spec)), self.args, self.argument_names)

    def loss(self, spec: PolicySpec) -> Pure | None:
        """The loss under ``spec`` as a function of arrays (NNX objects split), or None without
        ``make_loss``."""
        if self.make_loss is None:
            return None
        loss = self.make_loss(jax_policy(spec))
        names = param_names(loss, len(self.loss_args))
        pure = purify(loss, self.loss_args, names)
        if pure.nnx_index is not None:
            return pure
        return pure

    def donated(self, pure: Pure) -> tuple[int, ...]:
        """``donate_argnums`` of the pure step: the NNX state is donated (updated in place)."""
        if pure.nnx_index is None:
            return self.donate_argnums
        return (pure.nnx_index,)


def _argnums(argnums: int | Sequence[int], args: Sequence[Any]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in nums:
        if not 0 <= i < len(args):
            raise ValueError(f"argnums {i} out of range for a function of {len(args)} arguments")
        leaves = jax.tree.leaves(args[i])
        if any(hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves):
            raise ValueError(
                f"argnums {i}: argument {i} holds integer or boolean arrays, which are not "
                "differentiated; pass the float parameters' position"
            )
    return nums


def _factories(module: Any) -> list[str]:
    """Names in ``module`` that could be a factory: functions defined there (not imported)
    callable with no arguments."""
    out = []
    for n, obj in vars(module).items():
        if n.startswith("_") or not inspect.isfunction(obj):
            continue
        if obj.__module__ != module.__name__:
            continue
        try:
            inspect.signature(obj).bind()
        except TypeError:
            continue
        out.append(n)
    return sorted(out)


def load_program(ref: str) -> Program:
    """The :class:`Program` a reference names: ``"pkg.module:factory"`` or
    ``"path/to/file.py:factory"``, where ``factory()`` (no arguments) returns a Program.

    This is how the command line takes a user's model (``remat-kit analyze --model
    my_models.gpt:program``) beside the bundled preset names.

    Raises:
      ValueError: ``ref`` without ``:``, a module or file that cannot be found or imported, a
        missing factory, or a factory that does not return a Program (one line naming which).
    """
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise ValueError(
            f"cannot read {ref!r} as a program: write MODULE:FACTORY (my_pkg.models:program) or "
            "FILE.py:FACTORY (models/gpt.py:program), or give a preset name"
        )
    if module_ref.endswith(".py"):
        path = os.path.abspath(module_ref)
        if not os.path.isfile(path):
            raise ValueError(f"program file {module_ref!r} does not exist (from {ref!r})")
        name = f"_remat_kit_user_{os.path.splitext(os.path.basename(path))[0]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_ref)
        except ModuleNotFoundError as err:
            if err.name and module_ref.startswith(err.name):
                raise ValueError(
                    f"cannot import module {module_ref!r} (from {ref!r}): not on the Python path; "
                    "run from its folder, set PYTHONPATH, or give a FILE.py:FACTORY path"
                ) from None
            raise
    factory = getattr(module, attr, None)
    if factory is None:
        found = _factories(module)
        raise unknown_value_error(f"factory in {module_ref}", attr, found or ["(none)"])
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
        program = factory()
    else:
        program = factory
    if not isinstance(program, Program):
        raise ValueError(
            f"{ref} returned {type(program).__name__}, not a remat_kit.Program; return "
            "Program.from_loss(...) or Program.from_step(...)"
        )
    return program
