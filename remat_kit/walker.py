"""One walk of a program: a jaxpr and every jaxpr JAX nests inside it.

Sub-jaxprs are found generically, not by primitive name: any equation parameter that is a
``Jaxpr`` / ``ClosedJaxpr`` (or a tuple / list of them) is walked, which covers ``scan``,
``while``, ``cond``, ``pjit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat2`` (``jax.checkpoint``), ``shard_map`` and whatever JAX nests next. Equations of JAX's
"hi" primitives (``call_hi_primitive``, used by ``jax_remat3``) carry their sub-jaxprs and
parameters on the ``_prim`` object; those are walked too.

Checkpoint names come in two forms: the ``name`` primitive (classic remat) and, under
``jax_remat3``, a ``call_hi_primitive`` whose ``_prim`` is a ``CheckpointName``
(``jax/_src/ad_checkpoint.py``). :func:`eqn_tag` reads both.

Used by residual attribution (:mod:`remat_kit.residuals`), tag discovery and the doctor
(:mod:`remat_kit.doctor`), and for the FLOPs counted here.

**FLOPs of a function as JAX traces it** (before XLA), loops and recomputation included
(:func:`traced_flops`; a program's step: :func:`remat_kit.program.step_flops`). The baseline of
the recompute ratio: the FLOPs of the step without remat, counted on its jaxpr rather than
compiled, so that (a) it costs a trace, not a compile, and (b) it is the step as written. XLA's
own rematerialisation pass, which kicks in when a program does not fit the device, adds
recomputation to the *compiled* no-remat step; a no-remat row whose compiled FLOPs exceed this
count by more than a percent or two shows XLA recomputing on its own. Counted: matmuls
(``dot_general``), convolutions (``conv_general_dilated``) and cuDNN fused attention
(``jax.nn.dot_product_attention(implementation="cudnn")``); the program is walked with
:func:`fold` (every nested jaxpr, scans times their length).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
from jax.extend import core as jcore

MemoryKind = Literal["device", "host"]


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value saved by the forward pass for the backward pass.

    Attributes:
      tag: the checkpoint name of the value, or None (untagged).
      source: "argument NAME" for an input kept as is, else the primitive that produced it.
      shape: array shape; dtype: numpy dtype name; memory: "device" or "host" (offloaded).
      nbytes: size in bytes (prod(shape) * itemsize).
    """

    tag: str | None
    source: str
    shape: tuple[int, ...]
    dtype: str
    memory: MemoryKind
    nbytes: int

    @property
    def is_argument(self) -> bool:
        return self.source.startswith("argument")


@dataclasses.dataclass(frozen=True)
class TagResiduals:
    """Residuals of one checkpoint name (or one untagged source) in one remat segment."""

    tag: str
    count: int
    shape: tuple[int, ...]
    dtype: str
    memory: MemoryKind
    nbytes: int  # total bytes over ``count`` residuals


#: Primitives whose equations bind a hi-level primitive object with its own parameters.
HI_CALL = "call_hi_primitive"


def _jaxprs_in(value: Any) -> Iterator[jcore.Jaxpr]:
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs_in(v)


def eqn_params(eqn: Any) -> dict[str, Any]:
    """An equation's parameters, with those of a hi primitive's ``_prim`` object merged in."""
    params = dict(eqn.params)
    prim = params.get("_prim")
    inner = getattr(prim, "params", None)
    if isinstance(inner, dict):
        params.update({k: v for k, v in inner.items() if k not in params})
    return params


def sub_jaxprs(eqn: Any) -> list[jcore.Jaxpr]:
    """Every jaxpr nested directly in ``eqn`` (any parameter holding one), in parameter order."""
    return [j for value in eqn_params(eqn).values() for j in _jaxprs_in(value)]


def body(eqn: Any) -> jcore.Jaxpr | None:
    """The one sub-jaxpr of a call-like equation whose outputs map one-to-one to the equation's
    outputs (a jit / closed_call / remat / custom_vjp body, a scan body without carries), or
    None when there is no such single sub-jaxpr."""
    subs = [j for j in sub_jaxprs(eqn) if len(j.outvars) == len(eqn.outvars)]
    return subs[0] if len(subs) == 1 else None


def sub_inputs(eqn: Any, v: Any) -> list[tuple[jcore.Jaxpr, Any]]:
    """Where the input ``v`` of ``eqn`` enters each jaxpr nested in it: (sub-jaxpr, its input
    variable) for every sub-jaxpr whose inputs are the equation's, position by position (jit,
    closed_call, checkpoint, custom_jvp / custom_vjp calls, scan, shard_map), or after the
    branch index (a ``cond``'s branches); a ``while`` is not mapped (its inputs are split
    between the condition and the body)."""
    out = []
    positions = [i for i, u in enumerate(eqn.invars) if u is v]
    for sub in sub_jaxprs(eqn):
        offset = len(eqn.invars) - len(sub.invars)
        if offset == 0 or (offset == 1 and eqn.primitive.name == "cond"):
            out += [(sub, sub.invars[i - offset]) for i in positions if i >= offset]
    return out


def eqn_tag(eqn: Any) -> str | None:
    """The checkpoint name an equation applies (``checkpoint_name``), in either representation
    (classic ``name`` primitive or ``jax_remat3``'s ``CheckpointName``), else None."""
    if eqn.primitive.name == "name":
        return eqn.params["name"]
    if eqn.primitive.name == HI_CALL:
        prim = eqn.params.get("_prim")
        if type(prim).__name__ == "CheckpointName":
            name = getattr(prim, "name", None) or getattr(prim, "params", {}).get("name")
            return name if isinstance(name, str) else None
    return None


def walk(jaxpr: jcore.Jaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of all jaxprs nested in it, depth first."""
    todo = [jaxpr]
    seen: set[int] = set()
    while todo:
        j = todo.pop()
        if id(j) in seen:
            continue
        seen.add(id(j))
        for eqn in j.eqns:
            yield eqn
            todo.extend(reversed(sub_jaxprs(eqn)))


def fold(jaxpr: jcore.Jaxpr, cost: Callable[[Any], float]) -> float:
    """Sum ``cost(eqn)`` over a program as it runs: a ``scan`` body times its ``length``, a
    ``cond`` its most expensive branch, a ``while`` body once (its trip count is not static),
    every other nested jaxpr (jit, checkpoint, custom_vjp, shard_map...) once per equation."""
    total = 0.0
    for eqn in jaxpr.eqns:
        total += cost(eqn)
        subs = sub_jaxprs(eqn)
        if not subs:
            continue
        name = eqn.primitive.name
        if name == "scan":
            total += eqn.params["length"] * sum(fold(j, cost) for j in subs)
        elif name == "cond":
            total += max(fold(j, cost) for j in subs)
        elif name == "while":
            body_jaxpr = eqn.params.get("body_jaxpr")
            bodies = list(_jaxprs_in(body_jaxpr)) if body_jaxpr is not None else subs
            total += sum(fold(j, cost) for j in bodies)
        elif name.startswith("custom_vjp") or name.startswith("custom_jvp"):
            total += fold(subs[0], cost)  # the primal; the fwd / jvp rules are thunks or alike
        else:
            total += sum(fold(j, cost) for j in subs)
    return total


#: Primitives of a remat segment: classic ``jax.checkpoint`` (``remat2``); under
#: ``jax_remat3`` a ``call_hi_primitive`` whose ``_prim`` is a ``RematTraced``.
REMAT_PRIMITIVES = ("remat2", "checkpoint")


def is_remat(eqn: Any) -> bool:
    """Whether ``eqn`` is a remat segment (``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat``,
    classic or ``jax_remat3``)."""
    name = eqn.primitive.name
    if name == HI_CALL:
        return "Remat" in type(eqn.params.get("_prim")).__name__
    return name in REMAT_PRIMITIVES


def remat_policy(eqn: Any) -> Any:
    """The ``policy`` a remat segment equation carries (None: saves nothing)."""
    if eqn.primitive.name == HI_CALL:
        prim = eqn.params.get("_prim")
        return getattr(prim, "params", {}).get("policy", getattr(prim, "policy", None))
    return eqn.params.get("policy")


def holds(obj: Any, target: Any, depth: int = 4) -> bool:
    """Whether ``obj`` is ``target`` or reaches it through a function's closure cells,
    ``__wrapped__``, a ``functools.partial``'s function and arguments, or a bound method's
    ``__self__`` / ``__func__`` (``depth`` steps at most): a policy wrapped by a library (a
    lambda calling it, a partial) still holds the policy it was given."""
    todo, seen = [(obj, 0)], set()
    while todo:
        x, d = todo.pop()
        if x is target:
            return True
        if d >= depth or id(x) in seen:
            continue
        seen.add(id(x))
        nxt: list[Any] = []
        for cell in getattr(x, "__closure__", None) or ():
            try:
                nxt.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for attr in ("__wrapped__", "func", "__func__", "__self__"):
            if hasattr(x, attr) and not isinstance(x, type):
                nxt.append(getattr(x, attr))
        if isinstance(x, (tuple, list)):
            nxt.extend(x)
        nxt.extend(getattr(x, "args", ()) if callable(x) else ())
        nxt.extend((getattr(x, "keywords", None) or {}).values() if callable(x) else ())
        todo.extend((y, d + 1) for y in nxt)
    return False


def remat_segments(jaxpr: Any) -> list[Any]:
    """The remat segment equations of ``jaxpr`` and its nested jaxprs (a sub-jaxpr shared by
    several equations is walked once: :func:`walk`)."""
    return [eqn for eqn in walk(jaxpr) if is_remat(eqn)]


#: Loop primitives: a ``lax.scan`` (``nn.scan``, ``nnx.scan``) or ``lax.while_loop`` /
#: ``fori_loop``.
LOOP_PRIMITIVES = ("scan", "while")


def wraps_whole_loop(eqn: Any) -> bool:
    """Whether remat segment ``eqn`` holds a whole loop (a ``scan`` of more than one iteration,
    a ``while``) whose body holds no remat segment of its own: ``jax.checkpoint`` around a
    ``lax.scan`` rather than around its body. Its backward pass re-runs the loop and stacks
    every iteration's residuals again, so it keeps what no remat keeps."""
    for sub in sub_jaxprs(eqn):
        for inner in walk(sub):
            if inner.primitive.name not in LOOP_PRIMITIVES:
                continue
            if inner.primitive.name == "scan" and eqn_params(inner).get("length", 2) < 2:
                continue
            if not any(has_remat(j) for j in sub_jaxprs(inner)):
                return True
    return False


def remat_in_loop(jaxpr: Any) -> bool:
    """Whether a remat segment of ``jaxpr`` sits in a loop's body (``scan`` / ``while``)."""
    return any(
        eqn.primitive.name in LOOP_PRIMITIVES and any(has_remat(j) for j in sub_jaxprs(eqn))
        for eqn in walk(jaxpr)
    )


def has_remat(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds a remat segment anywhere (nested jaxprs included)."""
    return any(is_remat(eqn) for eqn in walk(jaxpr))


def tags_in_remat(jaxpr: Any) -> frozenset[str]:
    """Checkpoint names applied inside a remat segment anywhere in ``jaxpr`` (nested segments
    and sub-jaxprs included)."""
    return frozenset(
        t for eqn in walk(jaxpr) if is_remat(eqn) for sub in sub_jaxprs(eqn) for t in tags_in(sub)
    )


def dots_in_remat(jaxpr: Any) -> tuple[int, int]:
    """``(unbatched, batched)``: the ``dot_general`` equations inside remat segments anywhere in
    ``jaxpr``, without and with batch dimensions (``dimension_numbers``' second pair; a matmul
    under ``vmap`` or a batched einsum has them). ``dots_with_no_batch_dims_saveable`` saves
    only the first kind, ``dots_saveable`` both (``jax/_src/ad_checkpoint.py``). A matmul in
    nested segments is counted once per segment holding it."""
    unbatched = batched = 0
    for eqn in walk(jaxpr):
        if not is_remat(eqn):
            continue
        for sub in sub_jaxprs(eqn):
            for e in walk(sub):
                if e.primitive.name == "dot_general":
                    (_, (lhs_batch, _)) = e.params["dimension_numbers"]
                    batched += bool(lhs_batch)
                    unbatched += not lhs_batch
    return unbatched, batched


def tags_in(jaxpr: jcore.Jaxpr) -> set[str]:
    """Checkpoint names applied anywhere in ``jaxpr`` (sub-jaxprs included)."""
    return {t for t in map(eqn_tag, walk(jaxpr)) if t is not None}


def emitted_tags(fn: Callable[..., Any], *args: Any) -> set[str]:
    """Checkpoint names ``fn(*args)`` emits: in its traced program and in the program of its
    forward pass for differentiation (``jax.vjp``), where ``custom_vjp`` forward rules are
    inlined (a name applied only inside a forward rule is seen there). ``args`` may be
    ``jax.ShapeDtypeStruct``; nothing is compiled."""
    tags = tags_in(jax.make_jaxpr(fn)(*args).jaxpr)
    try:
        vjp_jaxpr = jax.make_jaxpr(lambda *xs: jax.vjp(fn, *xs))(*args).jaxpr
    except (TypeError, ValueError):  # not differentiable in these arguments (e.g. int inputs)
        return tags
    return tags | tags_in(vjp_jaxpr)


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
    return fold(jaxpr, eqn_flops)


def traced_flops(fn: Callable[..., Any], *args: Any) -> float:
    """FLOPs of ``fn(*args)`` from its jaxpr (``args`` may be ``jax.ShapeDtypeStruct``;
    nothing is compiled or allocated)."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)
