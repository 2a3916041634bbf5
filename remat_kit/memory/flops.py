"""Matmul FLOPs of a function as JAX traces it (before XLA), loops and recomputation included.

The baseline of the recompute ratio: the FLOPs of the step without remat, counted on its jaxpr
rather than compiled, so that (a) it costs a trace, not a compile, and (b) it is the step as
written. XLA's own rematerialisation pass, which kicks in when a program does not fit the device,
adds recomputation to the *compiled* no-remat step; a no-remat row whose compiled FLOPs exceed
this count by more than a percent or two shows XLA recomputing on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore


def _dot_general_flops(eqn) -> float:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    out = eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)


def _sub_jaxprs(value: Any):
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def jaxpr_flops(jaxpr: jcore.Jaxpr) -> float:
    """Matmul FLOPs (``dot_general``: ``2 * prod(out) * prod(contracting)``) of ``jaxpr``:
    ``scan`` bodies times their length, ``cond`` its most expensive branch, ``while`` bodies once
    (their trip count is not static), every other sub-jaxpr (jit, checkpoint, custom_vjp) once."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_general_flops(eqn)
        elif name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max((jaxpr_flops(b.jaxpr) for b in eqn.params["branches"]), default=0.0)
        else:
            for value in eqn.params.values():
                for sub in _sub_jaxprs(value):
                    total += jaxpr_flops(sub)
    return total


def traced_flops(fn: Callable[..., Any], *args: Any) -> float:
    """Matmul FLOPs of ``fn(*args)`` from its jaxpr (``args`` may be ``jax.ShapeDtypeStruct``;
    nothing is compiled or allocated)."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)
