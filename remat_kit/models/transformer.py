"""Decoder-only transformer in flax.linen whose intermediate tensors carry checkpoint names, the
layer stack it scans its blocks with, and its chunked cross-entropy.

Shapes: ``b`` batch, ``s`` sequence, ``h`` d_model, ``a`` query heads, ``g`` key/value heads,
``r = a // g`` query heads per key/value head, ``d`` head_dim, ``f`` d_ff, ``V`` vocabulary.

**The layer stack.** :class:`RematLayerStack` is a flax.linen module any linen model can use for
its layer stack, with partial-layer or nested remat (the plans of
:func:`remat_kit.models.config.layer_plan`): it takes a factory ``block(name) -> nn.Module`` whose
module maps ``x [batch, seq, d_model]`` (plus broadcast arguments) to the same shape. Parameters
are stacked along a leading axis named ``layers`` (``nn.with_logical_partitioning`` metadata), one
stack per scan.

**Chunked cross-entropy** (:func:`chunked_cross_entropy`): the LM head and the loss over sequence
chunks, under remat. The whole-sequence loss materialises the logits [batch, seq, vocab] in the
compute dtype, a float32 copy for the softmax, and the logits' gradient: remat policies inside the
layer stack do not touch them (llama3-8b, b=1, s=8192: 2 GiB bf16 logits plus a 4 GiB float32
copy). Here a ``lax.scan`` runs over ``seq // chunk_size`` chunks; each step computes one chunk's
logits [batch, chunk, vocab] and the summed loss inside ``jax.checkpoint`` (nothing saved), so the
forward keeps only the scan's inputs (the hidden states [batch, seq, d_model]) and the backward
recomputes one chunk's logits at a time. Cost: the LM head's matmul runs once more (forward again
in the backward pass). Same idea as Liger-Kernel's fused linear cross-entropy and MaxText's
``num_vocab_tiling``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from remat_kit import names as N
from remat_kit.models.config import ModelConfig, check_nested_groups, layer_plan
from remat_kit.policies import PolicySpec, get_policy_spec

_EMBED_INIT = nn.initializers.normal(stddev=0.02)  # GPT-2's initialisation (Radford et al. 2019)


def _partitioned(init, names: tuple[str, ...]):
    """``init`` with logical axis ``names`` on its output. ``rules=()``: a parameter is never
    constrained inside the model, also while :func:`remat_kit.sharding.activation_sharding`'s
    rules are in force (its layout is the jitted step's input sharding; and flax's
    ``DenseGeneral`` would apply an N-d constraint to its flattened 2-d kernel)."""
    return nn.with_logical_partitioning(init, names, rules=())


# Logical axis names of every parameter dimension (mapped to mesh axes by
# remat_kit.sharding.LOGICAL_RULES; without rules they are inert metadata). Scanned parameters get
# a leading "layers" axis. Activations: ACTIVATION_AXES, constrained only while flax logical axis
# rules are in force (remat_kit.sharding.activation_sharding), a no-op otherwise.
ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")  # [b, s, h]
_KERNEL_AXES = {
    N.QUERY_PROJ: ("embed", "heads", "head_dim"),
    N.KEY_PROJ: ("embed", "kv_heads", "head_dim"),
    N.VALUE_PROJ: ("embed", "kv_heads", "head_dim"),
    N.OUT_PROJ: ("heads", "head_dim", "embed"),
    N.MLPWI: ("embed", "mlp"),
    N.MLPWI_0: ("embed", "mlp"),
    N.MLPWI_1: ("embed", "mlp"),
    N.MLPWO: ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
}


def _dense(config: ModelConfig, features, *, name: str, axis=-1, use_bias: bool | None = None):
    axes = _KERNEL_AXES[name]
    n_out = 1 if isinstance(features, int) else len(features)
    return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=config.use_bias if use_bias is None else use_bias,
        dtype=config.compute_dtype,
        param_dtype=config.params_dtype,
        kernel_init=_partitioned(nn.initializers.lecun_normal(), axes),
        bias_init=_partitioned(nn.initializers.zeros_init(), axes[-n_out:]),
        name=name,
    )


def _proj(config: ModelConfig, x: jax.Array, features, tag: str, **kw) -> jax.Array:
    """Dense projection named after its checkpoint tag, output tagged with ``checkpoint_name``."""
    return checkpoint_name(_dense(config, features, name=tag, **kw)(x), tag)


def _norm(config: ModelConfig, name: str) -> nn.Module:
    kw = dict(epsilon=config.norm_eps, dtype=config.compute_dtype, param_dtype=config.params_dtype)
    kw["scale_init"] = _partitioned(nn.initializers.ones_init(), ("norm",))
    if config.norm == "rmsnorm":
        return nn.RMSNorm(name=name, **kw)
    return nn.LayerNorm(
        name=name, bias_init=_partitioned(nn.initializers.zeros_init(), ("norm",)), **kw
    )


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864), half-split layout.

    Args:
      x: [b, s, heads, d] queries or keys.
      positions: [s] integer positions.
      theta: base frequency.

    Returns:
      [b, s, heads, d], the dtype of ``x``.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [d/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [s, d/2]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention that materialises the [b, g, r, s, s] scores.

    Args:
      q: [b, s, a, d]; k, v: [b, s, g, d] with ``a % g == 0`` (grouped-query attention).

    Returns:
      context [b, s, a, d]. Softmax runs in float32.
    """
    b, s, a, d = q.shape
    g = k.shape[2]
    q = q.reshape(b, s, g, a // g, d)  # (b, s, g, r, d)
    scores = jnp.einsum("bqgrd,btgd->bgrqt", q, k) / jnp.sqrt(d).astype(q.dtype)
    # Causal mask as an additive [s, s] bias (0 on and below the diagonal, float32 min above),
    # added with implicit size-1 broadcasting. ``jnp.where(causal, scores, min)`` broadcast the
    # mask and the fill value to the full [b, g, r, s, s] shape in the jaxpr; as neither depends
    # on the layer's inputs, the layer scan's partial evaluation hoisted both out of the loop as
    # constants of the forward scan (llama3-8b, s=8192: an 8 GiB f32 and a 2 GiB pred buffer live
    # at the peak). Now only the [s, s] bias is hoisted. Same probabilities (exp underflows to 0 on
    # masked entries either way) and gradients; bitwise equal op by op.
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    bias = jnp.where(causal, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)  # (s, s)
    scores = scores.astype(jnp.float32) + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # (b, g, r, s, s)
    ctx = jnp.einsum("bgrqt,btgd->bqgrd", probs, v)
    return ctx.reshape(b, s, a, d)


class Attention(nn.Module):
    """Multi-head (grouped-query) causal self-attention. [b, s, h] -> [b, s, h]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        a, g, d = c.num_heads, c.kv_heads, c.head_dim
        q = _proj(c, x, (a, d), N.QUERY_PROJ, use_bias=c.qkv_bias)  # (b, s, a, d)
        k = _proj(c, x, (g, d), N.KEY_PROJ, use_bias=c.qkv_bias)  # (b, s, g, d)
        v = _proj(c, x, (g, d), N.VALUE_PROJ, use_bias=c.qkv_bias)  # (b, s, g, d)
        if c.positions == "rope":
            q = apply_rope(q, positions, c.rope_theta)
            k = apply_rope(k, positions, c.rope_theta)
        if c.attention == "xla":
            ctx = xla_attention(q, k, v)
        else:
            impl = "cudnn" if c.attention == "cudnn" else None
            ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        ctx = checkpoint_name(ctx, N.CONTEXT)  # (b, s, a, d)
        return _proj(c, ctx, c.d_model, N.OUT_PROJ, axis=(-2, -1))  # (b, s, h)


class Mlp(nn.Module):
    """GELU MLP (GPT-2) or SwiGLU (Shazeer 2020, arXiv:2002.05202). [b, s, h] -> [b, s, h]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        if c.mlp == "swiglu":
            hidden = nn.silu(_proj(c, x, c.d_ff, N.MLPWI_0)) * _proj(c, x, c.d_ff, N.MLPWI_1)
        else:
            hidden = nn.gelu(_proj(c, x, c.d_ff, N.MLPWI))  # (b, s, f)
        return _proj(c, hidden, c.d_model, N.MLPWO)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)). [b, s, h] -> same.

    The block input is tagged ``decoder_layer_input``; every projection carries its MaxText tag
    (see :mod:`remat_kit.names`), and the Dense module producing it is named after the tag, so
    untagged copies of a projection (a matmul output kept by a dots policy) can be attributed from
    JAX's name stack.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)  # (b, s, h)
        x = checkpoint_name(x, N.DECODER_LAYER_INPUT)
        x = x + Attention(c, name="attn")(_norm(c, "attn_norm")(x), positions)
        return x + Mlp(c, name="mlp")(_norm(c, "mlp_norm")(x))


class BlockGroup(nn.Module):
    """``remat_group_size`` consecutive blocks: one remat segment, one step of the layer scan.

    Returns ``(x, None)`` so it can be the body of ``nn.scan``.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array):
        for i in range(self.config.remat_group_size):
            x = Block(self.config, name=f"block_{i}")(x, positions)
        return x, None


def remat_group(config: ModelConfig) -> type[nn.Module]:
    """``BlockGroup`` wrapped in ``nn.remat`` with the config's policy (or bare for no-remat)."""
    spec = config.policy_spec
    if not spec.wrap:
        return BlockGroup
    # Under nn.scan, prevent_cse=False: the scan already keeps XLA from merging the recompute
    # into the forward pass (CSE cannot cross loop iterations), and the optimisation barriers
    # prevent_cse inserts only cost speed there (flax.linen.remat docstring). Unrolled, the
    # barriers are what keeps XLA from undoing the remat, so they stay on.
    return nn.remat(BlockGroup, policy=spec.to_jax(), prevent_cse=not config.scan_layers)


def structured_stack(config: ModelConfig) -> RematLayerStack:
    """The layer stack with partial-layer / nested remat (``config.layer_structure``)."""
    return RematLayerStack(
        lambda name: Block(config, name=name),
        num_layers=config.num_layers,
        policy=config.policy_spec,
        remat_layers=config.remat_layers,
        placement=config.remat_placement,
        rest_policy=config.rest_remat_policy,
        nested_groups=config.outer_groups,
        name="stack",
    )


class Transformer(nn.Module):
    """Decoder-only language model. tokens [b, s] int32 -> logits [b, s, V] (compute dtype), or
    with ``return_hidden`` the final-norm output [b, s, h] (the LM head's input, for
    :func:`chunked_cross_entropy`)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, return_hidden: bool = False) -> jax.Array:
        c = self.config
        seq = tokens.shape[-1]
        if seq > c.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={c.max_seq_len}")
        positions = jnp.arange(seq, dtype=jnp.int32)
        embed = nn.Embed(
            c.vocab_size, c.d_model, embedding_init=_partitioned(_EMBED_INIT, ("vocab", "embed")),
            dtype=c.compute_dtype, param_dtype=c.params_dtype, name="embed",
        )  # fmt: skip
        x = embed(tokens)  # (b, s, h)
        if c.positions == "learned":
            pos = nn.Embed(
                c.max_seq_len, c.d_model,
                embedding_init=_partitioned(_EMBED_INIT, ("positions", "embed")),
                dtype=c.compute_dtype, param_dtype=c.params_dtype, name="pos_embed",
            )  # fmt: skip
            x = x + pos(positions)[None]
        group = remat_group(c)
        num_groups = c.num_layers // c.remat_group_size
        if c.layer_structure:
            x = structured_stack(c)(x, positions)
        elif c.scan_layers:
            stack = nn.scan(
                group,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,
                length=num_groups,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = stack(c, name="layers")(x, positions)
        else:
            for i in range(num_groups):
                x, _ = group(c, name=f"layers_{i}")(x, positions)
        x = _norm(c, "final_norm")(x)
        if return_hidden:
            return x  # (b, s, h)
        if c.tied_embeddings:
            logits = embed.attend(x)  # (b, s, V)
        else:
            logits = _dense(c, c.vocab_size, name="lm_head", use_bias=False)(x)
        return logits


@functools.lru_cache(maxsize=64)
def make_model(config: ModelConfig) -> Transformer:
    """The :class:`Transformer` for ``config`` (the last 64 configs cached, so jitted functions
    see the same module object; ``make_model.cache_clear()`` empties the cache)."""
    return Transformer(config)


def resolve_block_policy(policy: Any) -> PolicySpec | Callable[..., bool] | None:
    """A block's policy as the stack applies it: None for no remat (``"no-remat"``, or None as
    a :class:`~remat_kit.program.Program` factory receives for no-remat), a jax policy callable
    as given (``jax.checkpoint_policies.*``, :func:`remat_kit.custom_policy`: what a factory
    receives otherwise), else the :class:`PolicySpec` of a name, spec or per-tag mapping.

    Raises:
      ValueError: an unknown policy name or a bad mapping (:func:`get_policy_spec`).
    """
    if policy is None:
        return None
    if callable(policy) and not isinstance(policy, (str, PolicySpec)):
        return policy
    spec = get_policy_spec(policy)
    return spec if spec.wrap else None


def _apply(module: nn.Module, x: jax.Array, *args: Any) -> jax.Array:
    return module(x, *args)


class _Step(nn.Module):
    """One scan step: ``len(specs)`` blocks, block ``i`` under ``specs[i]`` (None: no remat; see
    :func:`resolve_block_policy`)."""

    block: Callable[[str], nn.Module]
    specs: tuple[PolicySpec | Callable[..., bool] | None, ...]

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any):
        for i, spec in enumerate(self.specs):
            module = self.block(f"block_{i}")
            if spec is None:
                x = module(x, *args)
            else:
                policy = spec.to_jax() if isinstance(spec, PolicySpec) else spec
                # Under a scan, prevent_cse=False: CSE cannot merge the recompute across loop
                # iterations, and the barriers only cost speed (flax.linen.remat docstring).
                x = nn.remat(_apply, policy=policy, prevent_cse=False)(module, x, *args)
        return x, None


def _scan(body: Any, length: int, axis_name: str) -> Any:
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=nn.broadcast,
        length=length,
        metadata_params={nn.PARTITION_NAME: axis_name},
    )


class _Segment(nn.Module):
    """Nested remat's outer step: the inner runs (a segment of blocks), returned as a carry."""

    block: Callable[[str], nn.Module]
    runs: tuple[tuple[tuple[PolicySpec | None, ...], int], ...]
    axis_name: str

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any):
        for j, (specs, repeats) in enumerate(self.runs):
            name = "inner" if len(self.runs) == 1 else f"inner_{j}"
            scan = _scan(_Step, repeats, self.axis_name)
            x, _ = scan(self.block, specs, name=name)(x, *args)
        return x, None


class RematLayerStack(nn.Module):
    """``num_layers`` blocks in layer scans with partial-layer or nested remat.

    ``block(name)`` must return a fresh linen module mapping ``x [batch, seq, d_model]`` and the
    broadcast ``*args`` (e.g. positions [seq]) to ``[batch, seq, d_model]``; for example
    ``lambda name: MyBlock(features=64, name=name)``.

    Attributes:
      block: the block factory.
      num_layers: blocks in the stack (L).
      policy: remat policy of the rematerialised blocks: a name, :class:`PolicySpec`, per-tag
        mapping, or what a :class:`~remat_kit.program.Program` factory receives (a jax policy
        callable, None for no remat); see :func:`resolve_block_policy`.
      remat_layers: how many blocks use ``policy`` (None: all); the rest use ``rest_policy``.
      placement: ``"first"`` or ``"interleaved"`` (see :func:`layer_plan`).
      rest_policy: policy of the other blocks (default ``"no-remat"``).
      nested_groups: if set, nested remat with this many outer segments (a divisor of L; see
        :func:`~remat_kit.models.config.sqrt_groups`), each checkpointed whole (nothing saved
        but its input), the blocks inside under ``policy`` / ``rest_policy`` as
        ``remat_layers`` says (counted per segment:
        ``remat_layers`` must then be given per segment, i.e. at most ``L // nested_groups``).
      axis_name: logical axis name of the stacked parameters' leading dimension (nested: the
        outer one is ``axis_name + "_outer"``).

    Parameters: ``layers/block_0/...`` with leading dimension L for one run (the plain per-layer
    scan); ``layers_0``, ``layers_1``, ... for several runs; nested: ``layers/inner/...`` with
    leading dimensions ``[groups, L // groups]``.

    Raises (when called):
      ValueError: see :func:`layer_plan` and :func:`check_nested_groups`; unknown policy names.
    """

    block: Callable[[str], nn.Module]
    num_layers: int
    policy: Any = "save-nothing"
    remat_layers: int | None = None
    placement: str = "first"
    rest_policy: Any = "no-remat"
    nested_groups: int | None = None
    axis_name: str = "layers"

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        spec, rest = resolve_block_policy(self.policy), resolve_block_policy(self.rest_policy)
        per_scan = self.num_layers
        if self.nested_groups is not None:
            per_scan //= check_nested_groups(self.num_layers, self.nested_groups)
        runs = tuple(
            (tuple(spec if r else rest for r in pattern), repeats)
            for pattern, repeats in layer_plan(per_scan, self.remat_layers, self.placement)
        )
        if self.nested_groups is not None:
            outer = nn.remat(
                _Segment, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
            )
            # Flax's logical-to-mesh mapping rejects a name used twice: the outer axis gets its
            # own (absent from the rules, so not split).
            scan = _scan(outer, self.nested_groups, f"{self.axis_name}_outer")
            x, _ = scan(self.block, runs, self.axis_name, name="layers")(x, *args)
            return x
        for j, (specs, repeats) in enumerate(runs):
            name = "layers" if len(runs) == 1 else f"layers_{j}"
            x, _ = _scan(_Step, repeats, self.axis_name)(self.block, specs, name=name)(x, *args)
        return x


def chunked_cross_entropy(
    hidden: jax.Array,
    targets: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk_size: int,
) -> jax.Array:
    """Mean next-token cross-entropy (nats) computed chunk by chunk along the sequence.

    Args:
      hidden: [batch, seq, d_model], the LM head's input.
      targets: [batch, seq] int token ids.
      logits_fn: ``x [batch, chunk, d_model] -> logits [batch, chunk, vocab]`` (any float dtype,
        upcast to float32); may close over traced parameters (their gradients flow). A function
        of arrays: inside a linen module it must not call a submodule (``nn.Dense`` called
        under this function's ``jax.checkpoint`` / ``lax.scan`` leaks tracers, flax's
        ``UnexpectedTracerError``); take the head's kernel as an array instead, e.g.
        ``kernel = self.param("head", init, (d_model, vocab))`` then
        ``lambda x: x @ kernel``, or call it outside ``apply`` with the params tree.
      chunk_size: tokens per chunk; must divide ``seq``.

    Returns:
      float32 scalar, equal (within float32 summation order) to
      ``optax.softmax_cross_entropy_with_integer_labels(logits_fn(hidden), targets).mean()``.

    Raises:
      ValueError: ``chunk_size`` not a positive divisor of ``seq``; shapes that disagree.
    """
    b, s, h = hidden.shape
    if targets.shape != (b, s):
        raise ValueError(f"targets shape {targets.shape} does not match hidden {hidden.shape}")
    if not isinstance(chunk_size, int) or chunk_size <= 0 or s % chunk_size:
        valid = [d for d in range(1, s + 1) if s % d == 0]
        raise ValueError(
            f"chunk_size={chunk_size!r} does not divide seq={s}; valid chunk sizes: {valid}"
        )
    n = s // chunk_size
    xs = hidden.reshape(b, n, chunk_size, h).swapaxes(0, 1)  # (n, b, c, h)
    ts = targets.reshape(b, n, chunk_size).swapaxes(0, 1)  # (n, b, c)

    # Nothing saved but the inputs; under the scan CSE cannot merge the recompute back.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_loss(x, t):
        logits = logits_fn(x).astype(jnp.float32)  # (b, c, V)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).sum()

    def body(total, xt):
        return total + chunk_loss(*xt), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts))
    return total / (b * s)


def lm_head_logits(config: ModelConfig, params: Any, x: jax.Array) -> jax.Array:
    """The bundled Transformer's LM head on ``x [..., d_model]`` -> ``[..., vocab]`` in the
    compute dtype: the tied embedding transposed, or the ``lm_head`` kernel [d_model, vocab]."""
    dtype = config.compute_dtype
    if config.tied_embeddings:
        return jnp.dot(x.astype(dtype), params["embed"]["embedding"].astype(dtype).T)
    return jnp.dot(x.astype(dtype), params["lm_head"]["kernel"].astype(dtype))


def chunked_model_loss(params: Any, config: ModelConfig, batch: dict[str, jax.Array]) -> jax.Array:
    """The bundled model's mean loss on ``batch`` ({"inputs", "targets"}: [batch, seq] int32)
    with the LM head and cross-entropy chunked by ``config.loss_chunk_size`` tokens.

    Raises:
      ValueError: ``config.loss_chunk_size`` is None or does not divide the sequence length.
    """
    if config.loss_chunk_size is None:
        raise ValueError("config.loss_chunk_size is None; set it to a divisor of the sequence")
    hidden = make_model(config).apply({"params": params}, batch["inputs"], return_hidden=True)
    return chunked_cross_entropy(
        hidden,
        batch["targets"],
        lambda x: lm_head_logits(config, params, x),
        config.loss_chunk_size,
    )
