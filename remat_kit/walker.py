"""One walk of a jaxpr and every jaxpr nested in it: any equation parameter holding a
``Jaxpr`` / ``ClosedJaxpr``, including a hi primitive's ``_prim`` (``jax_remat3``).

:func:`saved_residuals`: what the forward pass keeps, by checkpoint name and memory kind (the
tags ``jax.ad_checkpoint.print_saved_residuals`` loses). :func:`traced_flops`: matmul,
convolution and fused-attention FLOPs of the jaxpr, before XLA. docs/architecture.md ("The
walker").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import jax
from jax.extend import core as jcore

from remat_kit.names import CHECKPOINT_NAMES

MemoryKind = Literal["device", "host"]


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value saved by the forward pass for the backward pass.

    Attributes:
      tag: checkpoint name, or None.
      source: "argument NAME" for an input kept as is, else the producing primitive.
      memory: "device" or "host" (offloaded).
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
    nbytes: int  # over ``count`` residuals


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
    """Every jaxpr nested directly in ``eqn``, in parameter order."""
    return [j for value in eqn_params(eqn).values() for j in _jaxprs_in(value)]


def body(eqn: Any) -> jcore.Jaxpr | None:
    """The one sub-jaxpr whose outputs are the equation's (a jit / remat / custom_vjp body), or
    None."""
    subs = [j for j in sub_jaxprs(eqn) if len(j.outvars) == len(eqn.outvars)]
    return subs[0] if len(subs) == 1 else None


def sub_inputs(eqn: Any, v: Any) -> list[tuple[jcore.Jaxpr, Any]]:
    """``(sub-jaxpr, its variable)`` where input ``v`` of ``eqn`` enters each sub-jaxpr taking
    the equation's inputs in order (after a ``cond``'s index; ``while`` is not mapped)."""
    out = []
    positions = [i for i, u in enumerate(eqn.invars) if u is v]
    for sub in sub_jaxprs(eqn):
        offset = len(eqn.invars) - len(sub.invars)
        if offset == 0 or (offset == 1 and eqn.primitive.name == "cond"):
            out += [(sub, sub.invars[i - offset]) for i in positions if i >= offset]
    return out


def eqn_tag(eqn: Any) -> str | None:
    """The checkpoint name ``eqn`` applies (``name`` primitive or ``CheckpointName`` hi
    primitive, ``jax/_src/ad_checkpoint.py``), else None."""
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


def _kernel_estimate(eqn: Any) -> Any:
    """A ``pallas_call``'s ``cost_estimate`` (``pl.CostEstimate``), or None."""
    return eqn.params.get("cost_estimate") if eqn.primitive.name == "pallas_call" else None


def fold(jaxpr: jcore.Jaxpr, cost: Callable[[Any], float], tpu: bool = False) -> float:
    """Sum ``cost(eqn)`` as the program runs: a ``scan`` body ``length`` times, a ``cond``'s
    costliest branch, a ``while`` body once (trip count not static), other sub-jaxprs once;
    ``tpu``: a Pallas kernel is ``cost``'s alone (its body not walked)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        total += cost(eqn)
        subs = [] if tpu and eqn.primitive.name == "pallas_call" else sub_jaxprs(eqn)
        if not subs:
            continue
        name = eqn.primitive.name
        if name == "scan":
            total += eqn.params["length"] * sum(fold(j, cost, tpu) for j in subs)
        elif name == "cond":
            total += max(fold(j, cost, tpu) for j in subs)
        elif name == "while":
            body_jaxpr = eqn.params.get("body_jaxpr")
            bodies = list(_jaxprs_in(body_jaxpr)) if body_jaxpr is not None else subs
            total += sum(fold(j, cost, tpu) for j in bodies)
        elif name.startswith("custom_vjp") or name.startswith("custom_jvp"):
            total += fold(subs[0], cost, tpu)  # the primal only
        else:
            total += sum(fold(j, cost, tpu) for j in subs)
    return total


#: Classic remat segment primitives (``jax_remat3``: a ``RematTraced`` hi primitive).
REMAT_PRIMITIVES = ("remat2", "checkpoint")


def is_remat(eqn: Any) -> bool:
    """Whether ``eqn`` is a remat segment (classic or ``jax_remat3``)."""
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
    """Whether ``obj`` is ``target`` or reaches it within ``depth`` steps through closure
    cells, ``__wrapped__``, a partial's function and arguments, a bound method (a policy
    wrapped by a library)."""
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
            except ValueError:
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
    """The remat segment equations of ``jaxpr``, nested ones included."""
    return [eqn for eqn in walk(jaxpr) if is_remat(eqn)]


LOOP_PRIMITIVES = ("scan", "while")


def wraps_whole_loop(eqn: Any) -> bool:
    """Whether remat segment ``eqn`` wraps a whole loop (``jax.checkpoint`` around a scan of
    more than one step, not its body): its backward pass keeps what no remat keeps."""
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


@dataclasses.dataclass(frozen=True)
class RematPlacement:
    """Remat regions of a step's jaxpr: ``in_loop`` inside a scan / while body, ``outside``
    not, ``no_cse_outside`` of those outside with ``prevent_cse=False``."""

    in_loop: int
    outside: int
    no_cse_outside: int = 0
    #: Regions that wrap a whole loop with no remat in its body
    #: (:func:`wraps_whole_loop`).
    around_loop: int = 0

    @property
    def lone(self) -> bool:
        """One remat region, outside every loop
        (:data:`remat_kit.memory.undone.LONE_SEGMENT_CAUSE`)."""
        return self.in_loop == 0 and self.outside == 1 and self.around_loop == 0


def remat_placement(jaxpr: Any) -> RematPlacement:
    """Counts of a jaxpr's ``remat`` regions inside / outside a loop body, and of those outside
    with ``prevent_cse=False``."""
    counts = {"inside": 0, "outside": 0, "no_cse": 0, "around_loop": 0}

    def visit(j: Any, in_loop: bool) -> None:
        for eqn in j.eqns:
            name = eqn.primitive.name
            if is_remat(eqn):
                counts["inside" if in_loop else "outside"] += 1
                if not in_loop and eqn.params.get("prevent_cse") is False:
                    counts["no_cse"] += 1
                counts["around_loop"] += wraps_whole_loop(eqn)
            for sub in sub_jaxprs(eqn):
                visit(sub, in_loop or name in LOOP_PRIMITIVES)

    visit(jaxpr, False)
    return RematPlacement(
        counts["inside"], counts["outside"], counts["no_cse"], counts["around_loop"]
    )


def tags_in_remat(jaxpr: Any) -> frozenset[str]:
    """Checkpoint names applied inside any remat segment of ``jaxpr``."""
    return frozenset(
        t for eqn in walk(jaxpr) if is_remat(eqn) for sub in sub_jaxprs(eqn) for t in tags_in(sub)
    )


def dots_in_remat(jaxpr: Any) -> tuple[int, int, int]:
    """``(unbatched, batched, ragged)`` matmul counts inside remat segments (once per enclosing
    segment): the ``dot_general`` equations ``dots_with_no_batch_dims_saveable`` /
    ``dots_saveable`` keep, and the ``ragged_dot_general`` ones (``lax.ragged_dot``: MoE
    experts grouped by expert) neither keeps."""
    unbatched = batched = ragged = 0
    for eqn in walk(jaxpr):
        if not is_remat(eqn):
            continue
        for sub in sub_jaxprs(eqn):
            for e in walk(sub):
                if e.primitive.name == "dot_general":
                    (_, (lhs_batch, _)) = e.params["dimension_numbers"]
                    batched += bool(lhs_batch)
                    unbatched += not lhs_batch
                ragged += e.primitive.name == "ragged_dot_general"
    return unbatched, batched, ragged


def tags_in(jaxpr: jcore.Jaxpr) -> set[str]:
    """Checkpoint names applied anywhere in ``jaxpr``."""
    return {t for t in map(eqn_tag, walk(jaxpr)) if t is not None}


def emitted_tags(fn: Callable[..., Any], *args: Any) -> set[str]:
    """Checkpoint names ``fn(*args)`` emits, in its jaxpr and its ``jax.vjp`` (where
    ``custom_vjp`` forward rules are inlined); ``args`` may be abstract."""
    tags = tags_in(jax.make_jaxpr(fn)(*args).jaxpr)
    try:
        vjp_jaxpr = jax.make_jaxpr(lambda *xs: jax.vjp(fn, *xs))(*args).jaxpr
    except (TypeError, ValueError):  # not differentiable (int inputs)
        return tags
    return tags | tags_in(vjp_jaxpr)


#: cuDNN fused attention (``jax/_src/cudnn/fused_attention_stablehlo.py``).
FUSED_ATTENTION_FWD = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")
FUSED_ATTENTION_BWD = ("dot_product_attention_bwd", "dot_product_attention_bwd_wrapper")
#: Backward over forward matmul work of fused attention (FlashAttention-2, arXiv:2307.08691).
BACKWARD_FACTOR = 2.5


def _dot_general_flops(eqn) -> float:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    out = eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)


def _ragged_dot_flops(eqn, routed: bool) -> float:
    """``lax.ragged_dot_general``: ``2 * prod(out) * prod(contracting) * prod(rhs group dims)``,
    the dense dot over every group (each row masked to its own) that JAX's CPU lowering and
    XLA's GPU rewrite run; ``routed``: that over the number of groups (``group_sizes``' last
    dimension), the ``2 * rows * K * N`` of the routed rows only, as libtpu's ragged-dot kernel
    runs it (:func:`remat_kit.memory.hlo.instruction_flops`). Either way the jaxpr's count
    matches the compiled program's on that target."""
    dims = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = dims.dot_dimension_numbers
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    out = eqn.outvars[0].aval
    groups = math.prod(rhs.shape[d] for d in dims.rhs_group_dimensions)
    dense = 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract) * groups
    return dense / max(eqn.invars[2].aval.shape[-1], 1) if routed else dense


def _conv_flops(eqn) -> float:
    """``2 * prod(out) * prod(kernel) / kernel_out_features``."""
    rhs = eqn.invars[1].aval
    out = eqn.outvars[0].aval
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    per_output = math.prod(rhs.shape) / max(rhs.shape[out_feature_dim], 1)
    return 2.0 * math.prod(out.shape) * per_output


def _fused_attention_flops(eqn) -> float:
    """``4 * batch * heads * q_len * kv_len * head_dim`` (causal: half), for q, k as [batch,
    seq, heads, head_dim] or [batch, heads, seq, head_dim] (BNTH)."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if len(q) != 4 or len(k) != 4:
        return 0.0
    bnth = "BNTH" in str(eqn.params.get("layout", ""))
    b, t, n, d = (q[0], q[2], q[1], q[3]) if bnth else q
    s = k[2] if bnth else k[1]
    causal = "CAUSAL" in str(eqn.params.get("mask_type", "")).upper()
    return 4.0 * b * n * t * s * d * (0.5 if causal else 1.0)


def eqn_flops(eqn: Any, tpu: bool = False) -> float:
    """FLOPs of one equation (0 for anything but a matmul, a ragged matmul, a convolution,
    fused attention or a Pallas kernel). ``tpu``: counted as the compiled TPU program is: a
    ragged matmul's routed rows only, a Pallas kernel at its author's ``cost_estimate`` (0
    without one: :func:`remat_kit.memory.hlo.uncounted_kernels` names it); else the dense dot
    over every group a CPU or GPU runs (:func:`_ragged_dot_flops`), and a Pallas kernel by its
    body (:func:`fold`)."""
    name = eqn.primitive.name
    if tpu and name == "pallas_call":  # as the compiled Mosaic call is counted
        estimate = _kernel_estimate(eqn)
        return float(estimate.flops) if estimate is not None else 0.0
    if name == "dot_general":
        return _dot_general_flops(eqn)
    if name == "ragged_dot_general":
        return _ragged_dot_flops(eqn, tpu)
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    if name in FUSED_ATTENTION_FWD:
        return _fused_attention_flops(eqn)
    if name in FUSED_ATTENTION_BWD:
        return BACKWARD_FACTOR * _fused_attention_flops(eqn)
    return 0.0


def jaxpr_flops(jaxpr: jcore.Jaxpr, tpu: bool = False) -> float:
    """FLOPs of ``jaxpr`` (a matmul: ``2 * prod(out) * prod(contracting)``), by :func:`fold`;
    ``tpu`` as in :func:`eqn_flops`."""
    return fold(jaxpr, functools.partial(eqn_flops, tpu=tpu), tpu)


def traced_flops(fn: Callable[..., Any], *args: Any, tpu: bool = False) -> float:
    """FLOPs of ``fn(*args)`` from its jaxpr (``args`` may be abstract); ``tpu`` as
    in :func:`eqn_flops`."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr, tpu)


_FORWARD_THROUGH = ("add", "reshape", "transpose", "convert_element_type")
_LAYOUT_ONLY = ("reshape", "transpose")
_BROADCAST_THROUGH = ("broadcast_in_dim", "convert_element_type")
_PASS_THROUGH = ("device_put", "reduce_precision", "convert_element_type", "copy", "copy_p")


def _memory_kind(aval) -> MemoryKind:
    space = getattr(aval, "memory_space", None)
    return "host" if space is not None and "host" in str(space).lower() else "device"


def _module_tag(eqn) -> str | None:
    """The checkpoint name of the module ``eqn`` ran in (from JAX's name stack)."""
    scopes = str(eqn.source_info.name_stack).split("/")
    for scope in reversed(scopes):
        if scope in CHECKPOINT_NAMES:
            return scope
    return None


class _Graph:
    """Producers and consumers of one jaxpr's variables. A residual gets the checkpoint name
    applied to the same value (before or after the name, through identity ops), in the jaxpr
    that made it or one that consumes it."""

    def __init__(self, jaxpr: Any):
        self.jaxpr = jaxpr
        self.producer: dict[Any, Any] = {}
        self.consumers: dict[Any, list[Any]] = defaultdict(list)
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                self.producer[v] = eqn
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    self.consumers[v].append(eqn)

    def _same_value(self, v: Any) -> list[Any]:
        """``v`` and the variables downstream holding its value, nearest first."""
        out, todo = [v], [v]
        while todo:
            for c in self.consumers.get(todo.pop(0), []):
                if _is_identity(c) and c.outvars[0] not in out:
                    out.append(c.outvars[0])
                    todo.append(c.outvars[0])
        return out

    def _bias_add_out(self, eqn: Any, v: Any) -> Any | None:
        """The output of ``eqn`` when it only adds a bias (a smaller or broadcast operand, as
        Haiku's ``hk.Linear``) to ``v``, or reshapes, transposes or casts it."""
        if eqn.primitive.name not in _FORWARD_THROUGH or len(eqn.outvars) != 1:
            return None
        if eqn.primitive.name == "add":
            others = [u for u in eqn.invars if u is not v]
            size = math.prod(v.aval.shape)
            if len(others) != 1 or self._broadcast_from(others[0]) >= size:
                return None  # two activations' sum is another value
        return eqn.outvars[0]

    def _broadcast_from(self, u: Any) -> int:
        """``u``'s size, or that of the array it was broadcast from."""
        size = math.prod(getattr(u.aval, "shape", ()))
        for _ in range(8):
            eqn = self.producer.get(u) if isinstance(u, jcore.Var) else None
            if eqn is None or not eqn.invars:
                break
            if eqn.primitive.name not in _BROADCAST_THROUGH and not _is_identity(eqn):
                break
            u = eqn.invars[0]
            size = min(size, math.prod(getattr(u.aval, "shape", ())))
        return size

    def twins(self, eqn: Any, v: Any) -> list[Any]:
        """The other outputs of call ``eqn`` (body: this jaxpr) returning ``v``'s value."""
        root = self.jaxpr.outvars[eqn.outvars.index(v)]
        while isinstance(root, jcore.Var) and root in self.producer:
            e = self.producer[root]
            if not (_is_identity(e) and isinstance(e.invars[0], jcore.Var)):
                break
            root = e.invars[0]
        same = set(self._same_value(root)) if isinstance(root, jcore.Var) else set()
        return [u for u, o in zip(eqn.outvars, self.jaxpr.outvars, strict=True)
                if u is not v and o in same]  # fmt: skip

    def forward_tag(self, v: Any, depth: int = 0) -> str | None:
        """The checkpoint name applied downstream of ``v``, here or in a consuming call."""
        if depth > 16:
            return None
        same = self._same_value(v)
        for u in same:
            for c in self.consumers.get(u, []):
                tag = eqn_tag(c)
                if tag is not None:
                    return tag
        for u in same:
            for c in self.consumers.get(u, []):
                for sub, inner in sub_inputs(c, u):
                    tag = _Graph(sub).forward_tag(inner, depth + 1)
                    if tag is not None:
                        return tag
        uses = [(c, u) for u in same for c in self.consumers.get(u, []) if not _is_identity(c)]
        if len(uses) == 1 and depth < 3:
            nxt = self._bias_add_out(*uses[0])
            if nxt is not None:
                return self.forward_tag(nxt, depth + 1)
        return None

    def _named_upstream(self, v: Any) -> str | None:
        """The checkpoint name ``v`` is, through copies, reshapes and transposes; or None."""
        for _ in range(8):
            eqn = self.producer.get(v) if isinstance(v, jcore.Var) else None
            if eqn is None or not eqn.invars:
                return None
            tag = eqn_tag(eqn)
            if tag is not None:
                return tag
            if eqn.primitive.name not in _LAYOUT_ONLY and not _is_identity(eqn):
                return None
            v = eqn.invars[0]
        return None

    def tag_of(self, v: Any, depth: int = 0) -> str | None:
        """The checkpoint name of ``v``: its producer's (through copies and call bodies), or
        the name it flows into."""
        if depth > 16 or not isinstance(v, jcore.Var):
            return None
        eqn = self.producer.get(v)
        if eqn is not None:
            tag = eqn_tag(eqn)
            if tag is not None:
                return tag
            if eqn.primitive.name in _PASS_THROUGH and eqn.invars and _same_bytes(eqn):
                tag = self.tag_of(eqn.invars[0], depth + 1)
                return tag if tag is not None else self.forward_tag(v)
            if eqn.primitive.name in _LAYOUT_ONLY:  # e.g. a named projection split into heads
                tag = self._named_upstream(eqn.invars[0])
                if tag is not None:
                    return tag
            sub = body(eqn)
            if sub is not None:  # e.g. residuals stacked by a layer scan
                inner = _Graph(sub)
                tag = inner.tag_of(sub.outvars[eqn.outvars.index(v)], depth + 1)
                if tag is not None:
                    return tag
                for twin in inner.twins(eqn, v):
                    tag = self.forward_tag(twin)
                    if tag is not None:
                        return tag
        forward = self.forward_tag(v)
        if forward is not None:
            return forward
        if eqn is not None:  # e.g. a dots policy keeps the raw matmul output, not the named one
            return _module_tag(eqn)
        return None


def _same_bytes(eqn: Any) -> bool:
    """Whether ``eqn``'s output keeps its first input's dtype (a cast is another value)."""
    x = eqn.invars[0]
    return not isinstance(x, jcore.Var) or x.aval.dtype == eqn.outvars[0].aval.dtype


def _is_identity(eqn: Any) -> bool:
    """Whether ``eqn`` outputs its first input unchanged (a name, copy, offload, no-op cast)."""
    if eqn_tag(eqn) is not None:
        return True
    if eqn.primitive.name not in _PASS_THROUGH or not eqn.invars or len(eqn.outvars) != 1:
        return False
    return _same_bytes(eqn)


def _inner_source(jaxpr: Any, v: Any, depth: int = 0) -> str | None:
    """The primitive that made ``v`` in ``jaxpr`` (through copies and calls), or None."""
    if depth > 16 or not isinstance(v, jcore.Var):
        return None
    eqn = _Graph(jaxpr).producer.get(v)
    if eqn is None:
        return None
    if eqn.invars and _is_identity(eqn):
        return _inner_source(jaxpr, eqn.invars[0], depth + 1)
    inner = body(eqn)
    if inner is not None:
        return _inner_source(inner, inner.outvars[eqn.outvars.index(v)], depth + 1)
    return eqn.primitive.name


def saved_residuals(fn: Callable[..., Any], *args: Any) -> list[Residual]:
    """The residuals ``jax.vjp(fn, *args)`` keeps, each attributed to a checkpoint name.

    ``args`` may be ``jax.ShapeDtypeStruct``. One :class:`Residual` per value, in JAX's order.
    """
    leaves, tree = jax.tree.flatten(args)
    flat_names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]

    def flat_fn(*xs):
        return fn(*jax.tree.unflatten(tree, xs))

    closed, out_shape = jax.make_jaxpr(lambda *xs: jax.vjp(flat_fn, *xs), return_shape=True)(
        *leaves
    )
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(out_shape[1]))
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]

    top = _Graph(jaxpr)
    producer = top.producer
    arg_index = {v: i for i, v in enumerate(jaxpr.invars)}

    def _source(v, copied=False) -> str:
        if not isinstance(v, jcore.Var):
            return "literal"
        if v in arg_index:
            return f"{'copy of ' if copied else ''}argument {flat_names[arg_index[v]]}"
        eqn = producer.get(v)
        if eqn is None:
            return "constant"
        inner = body(eqn)
        if inner is not None:
            found = _inner_source(inner, inner.outvars[eqn.outvars.index(v)])
            if found is not None:
                return found
        if eqn.invars and _is_identity(eqn):
            if not isinstance(eqn.invars[0], jcore.Var):
                return "literal"
            return _source(eqn.invars[0], copied or eqn.primitive.name == "device_put")
        return eqn.primitive.name

    out = []
    for v in res_vars:
        aval = v.aval
        tag = top.tag_of(v)
        source = _source(v)
        shape = tuple(int(d) for d in aval.shape)
        dtype = aval.dtype  # numpy or extended (PRNG key)
        out.append(
            Residual(
                tag=tag,
                source=source,
                shape=shape,
                dtype=dtype.name,
                memory=_memory_kind(aval),
                nbytes=math.prod(shape) * dtype.itemsize,
            )
        )
    return out


def group_by_tag(residuals: list[Residual], include_arguments: bool = False) -> list[TagResiduals]:
    """Residuals summed per (tag or ``"<primitive>"``, memory, shape, dtype), largest first;
    arguments only with ``include_arguments``."""
    groups: dict[tuple[str, str, tuple[int, ...], str], list[Residual]] = defaultdict(list)
    for r in residuals:
        if r.is_argument and not include_arguments:
            continue
        key = r.tag if r.tag is not None else f"<{r.source}>"
        groups[(key, r.memory, tuple(r.shape), str(r.dtype))].append(r)
    rows = [
        TagResiduals(
            tag=key,
            count=len(rs),
            shape=rs[0].shape,
            dtype=rs[0].dtype,
            memory=mem,
            nbytes=sum(r.nbytes for r in rs),
        )
        for (key, mem, _, _), rs in groups.items()
    ]
    return _largest_first(rows)


def _largest_first(rows: Iterable[TagResiduals]) -> list[TagResiduals]:
    return sorted(rows, key=lambda t: (-t.nbytes, t.tag))


def held_on_device(rows: Iterable[TagResiduals]) -> tuple[TagResiduals, ...]:
    """``rows`` with host rows merged into device rows, as a target without offload holds them."""
    merged: dict[tuple, TagResiduals] = {}
    for r in rows:
        key = (r.tag, tuple(r.shape), str(r.dtype))
        if key in merged:
            m = merged[key]
            merged[key] = dataclasses.replace(
                m, count=m.count + r.count, nbytes=m.nbytes + r.nbytes, memory="device"
            )
        else:
            merged[key] = dataclasses.replace(r, memory="device")
    return tuple(_largest_first(merged.values()))


def bytes_by_tag(rows: Iterable[TagResiduals], memory: str | None = "device") -> dict[str, int]:
    """Bytes per tag of ``rows`` in ``memory`` (None: both)."""
    out: dict[str, int] = {}
    for r in rows:
        if memory is None or r.memory == memory:
            out[r.tag] = out.get(r.tag, 0) + r.nbytes
    return out


def activation_bytes(residuals: list[Residual], memory: MemoryKind | None = None) -> int:
    """Bytes of non-argument residuals (optionally of one memory kind)."""
    return sum(
        r.nbytes for r in residuals if not r.is_argument and (memory is None or r.memory == memory)
    )
