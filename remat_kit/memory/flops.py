"""FLOPs of a function as JAX traces it (before XLA), loops and recomputation included.

The baseline of the recompute ratio: the FLOPs of the step without remat, counted on its jaxpr
rather than compiled, so that (a) it costs a trace, not a compile, and (b) it is the step as
written. XLA's own rematerialisation pass, which kicks in when a program does not fit the device,
adds recomputation to the *compiled* no-remat step; a no-remat row whose compiled FLOPs exceed
this count by more than a percent or two shows XLA recomputing on its own.

Counted: matmuls (``dot_general``), convolutions (``conv_general_dilated``) and cuDNN fused
attention (``jax.nn.dot_product_attention(implementation="cudnn")``); the program is walked with
:func:`remat_kit.walker.fold` (every nested jaxpr, scans times their length).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.extend import core as jcore

from remat_kit import walker as W

if TYPE_CHECKING:
    from remat_kit.policies import PolicySpec
    from remat_kit.program import Program

#: JAX primitives of the cuDNN fused attention forward pass
#: (``jax/_src/cudnn/fused_attention_stablehlo.py``).
FUSED_ATTENTION_FWD = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")
FUSED_ATTENTION_BWD = ("dot_product_attention_bwd", "dot_product_attention_bwd_wrapper")
#: Backward over forward matmul work of fused attention (FlashAttention-2, arXiv:2307.08691).
BACKWARD_FACTOR = 2.5


def _dot_general_flops(eqn) -> float:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    out = eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)


def _conv_flops(eqn) -> float:
    """``2 * prod(out) * prod(kernel) / kernel_out_features``: each output element is a dot of
    the kernel's spatial window and its input features (per feature group)."""
    rhs = eqn.invars[1].aval
    out = eqn.outvars[0].aval
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    per_output = math.prod(rhs.shape) / max(rhs.shape[out_feature_dim], 1)
    return 2.0 * math.prod(out.shape) * per_output


def _fused_attention_flops(eqn) -> float:
    """The two matmuls of attention, ``4 * batch * heads * q_len * kv_len * head_dim`` (halved
    under a causal mask), for query and key laid out [batch, seq, heads, head_dim] (BTNH) or
    [batch, heads, seq, head_dim] (BNTH)."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if len(q) != 4 or len(k) != 4:
        return 0.0
    bnth = "BNTH" in str(eqn.params.get("layout", ""))
    b, t, n, d = (q[0], q[2], q[1], q[3]) if bnth else q
    s = k[2] if bnth else k[1]
    causal = "CAUSAL" in str(eqn.params.get("mask_type", "")).upper()
    return 4.0 * b * n * t * s * d * (0.5 if causal else 1.0)


def eqn_flops(eqn: Any) -> float:
    """FLOPs of one equation (0 for anything but a matmul, convolution or fused attention)."""
    name = eqn.primitive.name
    if name == "dot_general":
        return _dot_general_flops(eqn)
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    if name in FUSED_ATTENTION_FWD:
        return _fused_attention_flops(eqn)
    if name in FUSED_ATTENTION_BWD:
        return BACKWARD_FACTOR * _fused_attention_flops(eqn)
    return 0.0


def jaxpr_flops(jaxpr: jcore.Jaxpr) -> float:
    """FLOPs of ``jaxpr`` (matmuls ``2 * prod(out) * prod(contracting)``, convolutions, fused
    attention): ``scan`` bodies times their length, ``cond`` its most expensive branch, ``while``
    bodies once (their trip count is not static), every other sub-jaxpr once."""
    return W.fold(jaxpr, eqn_flops)


def traced_flops(fn: Callable[..., Any], *args: Any) -> float:
    """FLOPs of ``fn(*args)`` from its jaxpr (``args`` may be ``jax.ShapeDtypeStruct``;
    nothing is compiled or allocated)."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def step_flops(program: Program, spec: PolicySpec) -> float:
    """Matmul FLOPs of ``program``'s whole step under ``spec`` (forward, backward and update;
    the global step, not one device's share), counted on its jaxpr (:func:`traced_flops`):
    nothing is compiled. Saving a tag lowers it only where the backward pass then stops
    recomputing the matmul under the tag; the solver's per-tag costs
    (:func:`remat_kit.recommend.tag_costs`) and the doctor's "tags whose saving removes
    recompute" (:func:`remat_kit.doctor.tags.recompute_savers`) both judge by it."""
    pure = program.step(spec)
    return traced_flops(pure.fn, *pure.args)
