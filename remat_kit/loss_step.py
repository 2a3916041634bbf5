"""The training step :meth:`remat_kit.program.Program.from_loss` builds around a loss:
``value_and_grad`` over the parameters plus an optax update, and the checks of its inputs."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from remat_kit.pure import (
    Factory,
    Static,
    check_argument,
    combine,
    is_array,
    is_float_array,
    is_nnx,
    partition,
    purify,
)


def argnums_of(argnums: int | Sequence[int], args: Sequence[Any]) -> tuple[int, ...]:
    """``argnums`` as a tuple, each checked against ``args``.

    Raises:
      ValueError: an index out of range; an argument with no float arrays to differentiate (or
        an NNX object with an integer ``nnx.Param``).
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in nums:
        if not 0 <= i < len(args):
            raise ValueError(f"argnums {i} out of range for a function of {len(args)} arguments")
        # an NNX object is differentiated by its nnx.Param state (:func:`diff_part`): an
        # integer nnx.Param is refused; elsewhere integer and boolean arrays (masks, position
        # ids) are carried, not differentiated, unless the argument holds nothing else
        nnx_state = is_nnx(args[i])
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
class NnxRest:
    """What an NNX parameter argument keeps besides its ``nnx.Param`` state: its graph and
    its other variables (batch statistics, RNG counters: not differentiated)."""

    graphdef: Any
    rest: Any


def diff_part(arg: Any) -> tuple[Any, Static | NnxRest | None]:
    """A parameter argument's differentiated arrays and what :func:`whole` needs to rebuild
    it: an NNX object's ``nnx.Param`` state (a pytree of arrays, so the optimizer's state
    holds no NNX object), other pytrees' array leaves (:func:`partition`)."""
    if is_nnx(arg):
        graphdef, params, rest = nnx.split(arg, nnx.Param, ...)
        return params, NnxRest(graphdef, rest)
    return partition(arg)


def whole(arrays: Any, static: Static | NnxRest | None) -> Any:
    """The argument :func:`diff_part` split, from its differentiated arrays."""
    if isinstance(static, NnxRest):  # its variables made anew here, in the current trace
        return nnx.merge(static.graphdef, arrays, jax.tree.map(lambda x: x, static.rest))
    return combine(arrays, static)


def initial_opt_state(
    tx: optax.GradientTransformation, args: Sequence[Any], nums: Sequence[int]
) -> Any:
    """The optimizer's initial state for the array leaves of the parameters ``args[nums]``."""
    # the differentiated arrays: each parameter's array leaves (filter semantics)
    params = tuple(partition(diff_part(args[i])[0], is_float_array)[0] for i in nums)
    concrete = all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    # the optimizer's own initial state on concrete parameters (abstract ones: its shapes)
    return tx.init(params) if concrete else jax.eval_shape(tx.init, params)


def loss_step_of(
    loss: Callable[..., Any],
    tx: optax.GradientTransformation,
    nums: tuple[int, ...],
    names: tuple[str, ...],
) -> Callable[..., Any]:
    """The step of :meth:`Program.from_loss` around ``loss``: gradients of the arguments
    ``nums``, then ``tx``'s update; ``names``: the step's argument names."""

    def step(opt_state, *loss_args):
        parts = [diff_part(loss_args[i]) for i in nums]
        # floats differentiated; integer and boolean arrays carried (filter semantics)
        floats = [partition(arrays, is_float_array) for arrays, _ in parts]

        def of_arrays(*diff):
            full = list(loss_args)
            for n, (i, arrays) in enumerate(zip(nums, diff, strict=True)):
                full[i] = whole(combine(arrays, floats[n][1]), parts[n][1])
            # what the loss changed in an NNX parameter's other variables (RNG
            # counters, batch statistics), carried out of the differentiated function
            changed = tuple(
                nnx.split(full[i], nnx.Param, ...)[2] if is_nnx(full[i]) else None for i in nums
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
            if is_nnx(loss_args[i]):  # updated in place: the step's NNX state out
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


def check_params(args: Sequence[Any], nums: Sequence[int], names: Sequence[str]) -> None:
    """Each differentiated argument holds arrays (one line naming what to pass otherwise)."""
    for i in nums:
        arg = args[i]
        check_argument(arg, names[i])
        if is_nnx(arg) or any(is_array(x) for x in jax.tree.leaves(arg)):
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
