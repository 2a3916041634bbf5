"""Hand a policy to a model that rematerializes without one: :func:`inject_policy`.

Some models call ``jax.checkpoint`` / ``flax.linen.remat`` / ``eqx.filter_checkpoint``
themselves, with no ``policy`` (Hugging Face's Flax models with ``gradient_checkpointing=True``):
a factory ``make_loss(policy)`` around one has nowhere to put the policy, so every policy
compiles to the same program (:class:`remat_kit.reach.PolicyReach`). ``inject_policy(loss)``
is the factory for it::

    program = Program.from_loss(remat_kit.inject_policy(loss), params, batch)

``loss`` is traced to a jaxpr and every equation of JAX's ``remat`` primitive in it
(``jax.extend.core.primitives.remat_p``), wherever nested, gets the policy as its ``policy``
parameter; for ``None`` (``no-remat``) the segment becomes a plain call of its body. The
rewritten jaxpr is evaluated before anything differentiates it, so
``inject_policy(make_loss(p))(q)`` traces to the same program as ``make_loss(q)``. Limits: a
segment inside a ``custom_vjp`` / ``custom_jvp`` rule is not reached; under ``jax_remat3`` the
rewrite is refused with an error. Why a rewrite rather than an interception:
docs/own-model-no-policy-hook.md. Arguments follow :class:`remat_kit.program.Program`'s filter
semantics (array leaves traced, the rest static).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun, new_jaxpr_eqn
from jax.extend.core.primitives import closed_call_p, remat_p

from remat_kit.pure import Factory, combine, partition
from remat_kit.walker import HI_CALL, is_remat

__all__ = ["inject_policy"]


def inject_policy(fn: Callable[..., Any]) -> Factory:
    """The factory ``policy -> fn'`` for a function whose remat segments take no policy.

    Args:
      fn: the function to differentiate (a loss ``fn(*args) -> scalar``), with remat segments
        of its own (``nn.remat`` / ``jax.checkpoint`` / ``eqx.filter_checkpoint`` without
        ``policy``, or with one to override). Its arguments may be pytrees with non-array
        leaves (static); its outputs must be arrays.

    Returns:
      ``make(policy)``: ``fn`` with every remat segment's policy set to ``policy`` (a
      ``jax.checkpoint`` policy callable), or with no remat for ``None``; same signature and
      results as ``fn``. Use it as the ``make_loss`` of :meth:`Program.from_loss`, or call it
      inside your own ``make_step(policy)``: ``loss = inject_policy(raw_loss)(policy)``.

    Raises:
      ValueError: ``fn`` or the policy is not callable; when called, ``jax_remat3`` segments
        (not rewritable: switch ``jax_remat3`` off).
    """
    if not callable(fn):
        raise ValueError(f"inject_policy takes the function to differentiate, got {fn!r}")

    def make(policy: Callable[..., Any] | None) -> Callable[..., Any]:
        if policy is not None and not callable(policy):
            raise ValueError(
                f"policy must be a jax.checkpoint policy (a callable) or None, got {policy!r}"
            )

        @functools.wraps(fn)
        def with_policy(*args: Any, **kwargs: Any) -> Any:
            arrays, static = partition((args, kwargs))
            leaves, treedef = jax.tree.flatten(arrays)

            def flat(*xs: Any) -> Any:
                a, k = combine(jax.tree.unflatten(treedef, xs), static)
                return fn(*a, **k)

            closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
            jaxpr = _Rewrite(policy).jaxpr(closed.jaxpr)
            out = jaxpr_as_fun(ClosedJaxpr(jaxpr, closed.consts))(*leaves)
            return jax.tree.unflatten(jax.tree.structure(out_shape), out)

        return with_policy

    make.__name__ = getattr(fn, "__name__", "inject_policy")
    make.__qualname__ = getattr(fn, "__qualname__", make.__name__)
    make.__wrapped__ = fn  # the loss's parameter names for reports (inspect.unwrap)
    return make


class _Rewrite:
    """One rewrite of a jaxpr tree: each (sub-)jaxpr rewritten once (shared ones stay shared)."""

    def __init__(self, policy: Callable[..., Any] | None):
        self.policy = policy
        self.done: dict[int, Any] = {}

    def jaxpr(self, jaxpr: Jaxpr) -> Jaxpr:
        if id(jaxpr) in self.done:
            return self.done[id(jaxpr)]
        eqns = [self.eqn(e) for e in jaxpr.eqns]
        out = jaxpr.replace(eqns=eqns)
        self.done[id(jaxpr)] = out
        return out

    def param(self, value: Any) -> Any:
        if isinstance(value, ClosedJaxpr):
            if id(value) not in self.done:
                self.done[id(value)] = ClosedJaxpr(self.jaxpr(value.jaxpr), value.consts)
            return self.done[id(value)]
        if isinstance(value, Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, (tuple, list)) and any(
            isinstance(v, (Jaxpr, ClosedJaxpr)) for v in value
        ):
            return type(value)(self.param(v) for v in value)
        return value

    def eqn(self, eqn: Any) -> Any:
        if eqn.primitive.name == HI_CALL and is_remat(eqn):
            raise ValueError(
                "inject_policy rewrites jax.checkpoint's remat primitive; this program was traced "
                "with jax_remat3 on (remat as a hi-level primitive): set "
                "jax.config.update('jax_remat3', False)"
            )
        params = {k: self.param(v) for k, v in eqn.params.items()}
        if eqn.primitive is not remat_p:
            return eqn.replace(params=params)
        if self.policy is None:  # no remat: the segment's body, called as it is
            call = {"call_jaxpr": ClosedJaxpr(params["jaxpr"], ())}
            return new_jaxpr_eqn(
                eqn.invars, eqn.outvars, closed_call_p, call, eqn.effects, eqn.source_info,
                eqn.ctx,
            )  # fmt: skip
        return eqn.replace(params={**params, "policy": self.policy})
