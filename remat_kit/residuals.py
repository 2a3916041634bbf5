"""Saved residuals: what the forward pass keeps for the backward pass, by checkpoint name.

``jax.ad_checkpoint.print_saved_residuals`` prints the residuals of a function but loses the tag
of an offloaded residual (it shows "output of device_put") and of a saved matmul (it shows
"output of dot_general"). Here every residual is followed back to the ``checkpoint_name`` that
produced it or that consumes it, so a policy's promise ("saves q, k, v; offloads out_proj") can be
checked tag by tag, with the memory kind (device or pinned host) of each.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from remat_kit import walker as W
from remat_kit.models.config import ModelConfig
from remat_kit.models.transformer import BlockGroup
from remat_kit.names import CHECKPOINT_NAMES, CHECKPOINT_SHAPES
from remat_kit.sharding import LOGICAL_RULES
from remat_kit.validation import positive_int
from remat_kit.walker import MemoryKind, Residual, TagResiduals

__all__ = ["MemoryKind", "Residual", "TagResiduals"]  # data types live in remat_kit.walker

_FORWARD_THROUGH = ("add", "reshape", "transpose", "convert_element_type")
_PASS_THROUGH = ("device_put", "reduce_precision", "convert_element_type", "copy", "copy_p")
#: The dimension names of :mod:`remat_kit.names` -> the models' logical axis names.
_DIM_AXES = {
    "batch": "batch", "seq": "seq", "d_model": "embed", "heads": "heads", "kv_heads": "kv_heads",
    "head_dim": "head_dim", "d_ff": "mlp",
}  # fmt: skip


def _memory_kind(aval) -> MemoryKind:
    space = getattr(aval, "memory_space", None)
    return "host" if space is not None and "host" in str(space).lower() else "device"


def _module_tag(eqn) -> str | None:
    """The checkpoint name of the module an equation ran in: the bundled modules name each
    projection's Dense after its tag, and flax puts module paths in JAX's name stack."""
    scopes = str(eqn.source_info.name_stack).split("/")
    for scope in reversed(scopes):
        if scope in CHECKPOINT_NAMES:
            return scope
    return None


class _Graph:
    """Producers and consumers of one jaxpr's variables, for following a value to its tag.

    A residual is attributed to a checkpoint name when the name is applied to the very value
    kept: the name's output or its input (a kind-based policy such as ``dots_saveable`` keeps the
    matmul's own output variable, which ``checkpoint_name`` then binds to a new one), through
    identity ops (``reduce_precision``, copies, offloads), in whichever jaxpr the name sits: the
    body of the scan / jit / remat that produced the value or of a call that consumes it.
    """

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
        """``v`` and every variable of this jaxpr downstream of it holding the same value
        (through names and identity ops), nearest first."""
        out, todo = [v], [v]
        while todo:
            for c in self.consumers.get(todo.pop(0), []):
                if _is_identity(c) and c.outvars[0] not in out:
                    out.append(c.outvars[0])
                    todo.append(c.outvars[0])
        return out

    def _bias_add_out(self, eqn: Any, v: Any) -> Any | None:
        """The output of ``eqn`` when it only adds a bias to ``v`` or reshapes, transposes or
        casts it (the named value of a matmul kept by a dots policy often comes after its bias
        add; attention's context is its einsum's output transposed)."""
        if eqn.primitive.name not in _FORWARD_THROUGH or len(eqn.outvars) != 1:
            return None
        if eqn.primitive.name == "add":
            others = [u for u in eqn.invars if u is not v]
            size = math.prod(v.aval.shape)
            if len(others) != 1 or math.prod(getattr(others[0].aval, "shape", ())) >= size:
                return None  # a sum of two activations (a residual stream) is another value
        return eqn.outvars[0]

    def twins(self, eqn: Any, v: Any) -> list[Any]:
        """The other outputs of the call ``eqn`` (whose body is this jaxpr) that return the
        value of its output ``v``: this jaxpr returns one value twice, or a copy of it."""
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
        """The checkpoint name applied to ``v`` (or to the same value) downstream of it here
        or inside a call that consumes it; after a bias add or reshape of a single-use value."""
        if depth > 16:
            return None
        same = self._same_value(v)
        for u in same:
            for c in self.consumers.get(u, []):
                tag = W.eqn_tag(c)
                if tag is not None:
                    return tag
        for u in same:
            for c in self.consumers.get(u, []):
                for sub, inner in W.sub_inputs(c, u):
                    tag = _Graph(sub).forward_tag(inner, depth + 1)
                    if tag is not None:
                        return tag
        uses = [(c, u) for u in same for c in self.consumers.get(u, []) if not _is_identity(c)]
        if len(uses) == 1 and depth < 3:  # the value's only use (copies of it aside)
            nxt = self._bias_add_out(*uses[0])
            if nxt is not None:
                return self.forward_tag(nxt, depth + 1)
        return None

    def tag_of(self, v: Any, depth: int = 0) -> str | None:
        """The checkpoint name of ``v``: its producer's, through copies and offloads, inside
        the body of a scan / jit / remat that produced it, or the name it flows into."""
        if depth > 16 or not isinstance(v, jcore.Var):
            return None
        eqn = self.producer.get(v)
        if eqn is not None:
            tag = W.eqn_tag(eqn)
            if tag is not None:
                return tag
            if eqn.primitive.name in _PASS_THROUGH and eqn.invars and _same_bytes(eqn):
                tag = self.tag_of(eqn.invars[0], depth + 1)
                return tag if tag is not None else self.forward_tag(v)
            body = W.body(eqn)
            if body is not None:  # e.g. residuals stacked by a layer scan
                inner = _Graph(body)
                tag = inner.tag_of(body.outvars[eqn.outvars.index(v)], depth + 1)
                if tag is not None:
                    return tag
                for twin in inner.twins(eqn, v):  # the call returns the same value twice
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
    """Whether ``eqn``'s output holds its first input's bytes (a copy, an offload, a cast to
    the same dtype): a cast to another dtype (a norm's ``x.astype(float32)``) is another
    value, of another size, and does not carry the input's name."""
    x = eqn.invars[0]
    return not isinstance(x, jcore.Var) or x.aval.dtype == eqn.outvars[0].aval.dtype


def _is_identity(eqn: Any) -> bool:
    """An equation whose output is its first input's value, bytes unchanged: a checkpoint
    name, a copy or offload, a no-op ``reduce_precision`` or same-dtype cast."""
    if W.eqn_tag(eqn) is not None:
        return True
    if eqn.primitive.name not in _PASS_THROUGH or not eqn.invars or len(eqn.outvars) != 1:
        return False
    return _same_bytes(eqn)


def _inner_source(jaxpr: Any, v: Any, depth: int = 0) -> str | None:
    """The primitive that produced ``v`` inside ``jaxpr`` (through names, copies and nested
    calls); None for an input of ``jaxpr`` or a literal."""
    if depth > 16 or not isinstance(v, jcore.Var):
        return None
    eqn = _Graph(jaxpr).producer.get(v)
    if eqn is None:
        return None
    if eqn.invars and _is_identity(eqn):
        return _inner_source(jaxpr, eqn.invars[0], depth + 1)
    inner = W.body(eqn)
    if inner is not None:
        return _inner_source(inner, inner.outvars[eqn.outvars.index(v)], depth + 1)
    return eqn.primitive.name


def saved_residuals(fn: Callable[..., Any], *args: Any) -> list[Residual]:
    """The residuals ``jax.vjp(fn, *args)`` keeps, each attributed to a checkpoint name.

    Args:
      fn: a differentiable function (with ``jax.checkpoint`` / ``nn.remat`` inside or not).
      *args: real arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated).

    Returns:
      One :class:`Residual` per saved value, in the order JAX keeps them.
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
            # The argument itself is no new buffer; a copy of it (an offload) is.
            return f"{'copy of ' if copied else ''}argument {flat_names[arg_index[v]]}"
        eqn = producer.get(v)
        if eqn is None:
            return "constant"
        inner = W.body(eqn)
        if inner is not None:
            # e.g. residuals stacked by a layer scan: name the primitive inside that made them
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
        dtype = aval.dtype  # a numpy dtype, or an extended one (a PRNG key: key<fry>)
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
    """Sum residuals per (tag or source, memory kind, shape, dtype): one row per distinct array
    of a tag (a tag whose values differ in shape gets a row per shape; :func:`bytes_by_tag` sums
    them). Arguments (parameters, the segment input) are left out unless ``include_arguments``;
    untagged values are grouped as ``"<primitive>"``."""
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
    """``rows`` as a target that does not offload holds them: every host row counted on the
    device, merged with the device row of the same tag, shape and dtype (XLA:CPU, and a GPU
    without offload support, keep offloaded residuals in device memory)."""
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
    """Bytes per tag over ``rows`` (:func:`group_by_tag`), every shape of a tag summed; only
    rows in ``memory`` (``"device"`` / ``"host"``; None: both)."""
    out: dict[str, int] = {}
    for r in rows:
        if memory is None or r.memory == memory:
            out[r.tag] = out.get(r.tag, 0) + r.nbytes
    return out


def block_residuals(config: ModelConfig, batch_size: int, seq_len: int) -> list[Residual]:
    """Residuals of one remat segment (``remat_group_size`` blocks) under the config's policy.

    The segment is traced on abstract shapes (nothing allocated): input x [batch, seq, d_model]
    in the compute dtype, parameters from ``jax.eval_shape`` of the block's init. Parameters and
    the segment input appear as ``argument`` residuals; the input of each later block in the
    segment is tagged ``decoder_layer_input``. Multiply by ``num_layers // remat_group_size`` for
    the whole model.
    """
    x = jax.ShapeDtypeStruct((batch_size, seq_len, config.d_model), config.compute_dtype)
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    group = BlockGroup(config)
    params = jax.eval_shape(lambda: group.init(jax.random.key(0), x, positions)["params"])

    def segment(p, h, pos):
        return group.apply({"params": p}, h, pos)[0]

    spec = config.policy_spec
    if spec.wrap:
        segment = jax.checkpoint(segment, policy=spec.to_jax())
    pos_spec = jax.ShapeDtypeStruct((seq_len,), jnp.int32)
    return saved_residuals(segment, params, x, pos_spec)


def tag_axes(tag: str) -> tuple[str, ...] | None:
    """Logical axes of a tagged tensor, from its shape in
    :data:`remat_kit.names.CHECKPOINT_SHAPES`: ``tag_axes("query_proj") == ("batch", "seq",
    "heads", "head_dim")``; None for an unknown tag."""
    dims = CHECKPOINT_SHAPES.get(tag)
    return None if dims is None else tuple(_DIM_AXES[d] for d in dims)


def tp_split_axes() -> frozenset[str]:
    """Logical axes split over the ``tp`` mesh axis (from :data:`remat_kit.sharding.LOGICAL_RULES`:
    ``heads``, ``kv_heads``, ``mlp``, ``vocab``)."""
    return frozenset(axis for axis, mesh in LOGICAL_RULES if mesh == "tp")


def split_over_tp(residuals: list[Residual], tp: int) -> list[Residual]:
    """Per-device residuals under ``tp``-way tensor parallelism.

    A tagged residual whose documented shape (:func:`tag_axes`) has an axis that
    :data:`remat_kit.sharding.LOGICAL_RULES` maps to ``tp`` (heads, kv_heads, mlp) keeps
    ``1/tp`` of that dimension on each device: the projection's weight is split that way and
    XLA's sharding propagation splits its output (and the saved residual) likewise (Megatron-LM,
    Shoeybi et al. 2019, arXiv:1909.08053). The ``embed`` rule (fsdp) is a parameter rule only:
    FSDP all-gathers a layer's weights, and [batch, seq, d_model] activations stay whole on every
    device. Untagged residuals and those whose rank differs from the documented shape are kept
    as they are (their axes are not known).

    Args:
      residuals: from :func:`saved_residuals` (shapes as traced).
      tp: size of the ``tp`` mesh axis (>= 1).

    Returns:
      The residuals with per-device shapes and ``nbytes``, in the same order.

    Raises:
      ValueError: ``tp`` is not a positive integer.
    """
    positive_int("tp", tp)
    if tp == 1:
        return list(residuals)
    split = tp_split_axes()
    out = []
    for r in residuals:
        axes = tag_axes(r.tag) if r.tag is not None else None
        if axes is None or len(axes) != len(r.shape) or not split.intersection(axes):
            out.append(r)
            continue
        shape = tuple(-(-d // tp) if a in split else d for d, a in zip(r.shape, axes, strict=True))
        nbytes = math.prod(shape) * jnp.dtype(r.dtype).itemsize
        out.append(dataclasses.replace(r, shape=shape, nbytes=nbytes))
    return out


def activation_bytes(residuals: list[Residual], memory: MemoryKind | None = None) -> int:
    """Bytes of non-argument residuals (optionally of one memory kind)."""
    return sum(
        r.nbytes for r in residuals if not r.is_argument and (memory is None or r.memory == memory)
    )
