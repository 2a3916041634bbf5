"""The bundled decoder-only transformer (flax.linen, MaxText checkpoint names), its
:class:`ModelConfig` and presets at published shapes.

Layer plans (:func:`layer_plan`): partial-layer remat (Megatron-LM's ``--recompute-num-layers``)
or nested remat (Chen et al. 2016, arXiv:1604.06174), run by :class:`RematLayerStack` for any
linen block; :func:`chunked_cross_entropy`: the LM head and loss over sequence chunks. How
each works and costs: docs/structure.md.

Shapes: ``b`` batch, ``s`` sequence, ``h`` d_model, ``a`` query heads, ``g`` key/value heads,
``r = a // g``, ``d`` head_dim, ``f`` d_ff, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from remat_kit import names as N
from remat_kit import targets as T
from remat_kit.policies import PolicySpec, get_policy_spec
from remat_kit.validation import check_seq_len, positive_int, unknown_value_error

Placement = Literal["first", "interleaved"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
#: One scan: per-block remat choice of a step, and the trip count.
Run = tuple[tuple[bool, ...], int]


def layer_plan(
    num_layers: int, remat_layers: int | None = None, placement: str = "first"
) -> tuple[Run, ...]:
    """The layer scans that put ``remat_layers`` of ``num_layers`` blocks under the policy.

    Returns:
      ``((pattern, repeats), ...)``, one scan each; ``pattern[i]``: block ``i`` of a step is
      rematerialised. ``"first"``: ``(((True,), k), ((False,), L - k))``; ``"interleaved"``:
      one run of ``L // k`` blocks, the first rematerialised.

    Raises:
      ValueError: a non-positive ``num_layers``; ``remat_layers`` outside ``0..num_layers``; an
        unknown placement; ``"interleaved"`` with ``remat_layers`` not dividing ``num_layers``.
    """
    positive_int("num_layers", num_layers)
    if placement not in PLACEMENTS:
        raise unknown_value_error("remat placement", placement, PLACEMENTS)
    k = num_layers if remat_layers is None else remat_layers
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= num_layers:
        raise ValueError(f"remat_layers must be an integer in 0..{num_layers}, got {k!r}")
    if k in (0, num_layers):
        return (((k > 0,), num_layers),)
    if placement == "first":
        return (((True,), k), ((False,), num_layers - k))
    if num_layers % k:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"interleaved remat_layers={k} does not divide num_layers={num_layers}; valid: {valid}"
        )
    period = num_layers // k
    return (((True,) + (False,) * (period - 1), k),)


def sqrt_groups(num_layers: int) -> int:
    """The divisor of ``num_layers`` nearest its square root (smaller on a tie), minimising
    ``groups + num_layers / groups`` stored layer inputs (Chen et al. 2016).

    Raises:
      ValueError: ``num_layers`` is not a positive integer.
    """
    positive_int("num_layers", num_layers)
    root = math.sqrt(num_layers)
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    return min(divisors, key=lambda d: (abs(d - root), d))


def check_nested_groups(num_layers: int, groups: int) -> int:
    """``groups`` if it divides ``num_layers``.

    Raises:
      ValueError: ``groups`` not a positive divisor of ``num_layers`` (listing the valid ones).
    """
    positive_int("nested_groups", groups)
    if num_layers % groups:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"nested_groups={groups} does not divide num_layers={num_layers}; valid: {valid}"
        )
    return groups


def stored_layer_inputs(num_layers: int, groups: int | None = None) -> int:
    """Layer inputs live in the backward pass's worst segment: ``num_layers`` per-layer;
    ``groups + num_layers // groups`` nested (outer carries plus one segment's inner ones)."""
    if groups is None:
        return num_layers
    return groups + num_layers // check_nested_groups(num_layers, groups)


Norm = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu"]
Positions = Literal["learned", "rope"]
#: ``xla``: einsum attention materialising [b, heads, s, s] scores; ``dot_product_attention``:
#: ``jax.nn.dot_product_attention``; ``cudnn``: its cuDNN flash kernel (GPU only).
AttentionImpl = Literal["xla", "dot_product_attention", "cudnn"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer, passed whole to every module; ``head_dim = d_model //
    num_heads``."""

    name: str = "custom"
    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4  # query heads
    num_kv_heads: int | None = None  # GQA; None: num_heads
    d_ff: int = 256
    max_seq_len: int = 128
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    mlp: MlpKind = "gelu"
    positions: Positions = "learned"
    rope_theta: float = 10_000.0  # RoPE base frequency (Su et al. 2021, arXiv:2104.09864)
    tied_embeddings: bool = True
    qkv_bias: bool = False  # on q/k/v only (Qwen2)
    use_bias: bool = False  # on every other dense layer (GPT-2)
    dtype: str = "float32"  # compute
    param_dtype: str = "float32"
    attention: AttentionImpl = "xla"
    remat_policy: str | PolicySpec = "no-remat"
    scan_layers: bool = True  # nn.scan over blocks, else unrolled
    remat_group_size: int = 1  # consecutive blocks per remat segment
    # Partial-layer remat (:func:`layer_plan`): ``remat_layers`` blocks (None: all) under
    # ``remat_policy``, the rest under ``rest_remat_policy``.
    remat_layers: int | None = None
    remat_placement: Placement = "first"
    rest_remat_policy: str | PolicySpec = "no-remat"
    # Nested remat over ``nested_groups`` segments (None: sqrt_groups); remat_layers per segment.
    nested_remat: bool = False
    nested_groups: int | None = None
    # Tokens per chunk of :func:`chunked_cross_entropy` (None: whole logits).
    loss_chunk_size: int | None = None

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_seq_len"):
            positive_int(field, getattr(self, field))
        if self.num_kv_heads is not None:
            positive_int("num_kv_heads", self.num_kv_heads)
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"valid num_heads divide {self.d_model}"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.kv_heads}; "
                f"valid num_kv_heads: {_divisors(self.num_heads)}"
            )
        positive_int("remat_group_size", self.remat_group_size)
        if self.num_layers % self.remat_group_size:
            raise ValueError(
                f"remat_group_size={self.remat_group_size} does not divide "
                f"num_layers={self.num_layers}; valid: {_divisors(self.num_layers)}"
            )
        for field, ty in (("norm", Norm), ("mlp", MlpKind), ("positions", Positions)):
            _check_choice(field, getattr(self, field), get_args(ty))
        _check_choice("attention", self.attention, get_args(AttentionImpl))
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        get_policy_spec(self.remat_policy)
        self._check_structure()

    def _check_structure(self) -> None:
        """Validate the partial / nested remat and chunked-loss fields."""
        get_policy_spec(self.rest_remat_policy)
        _check_choice("remat_placement", self.remat_placement, get_args(Placement))
        if self.loss_chunk_size is not None and (
            not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size <= 0
        ):
            raise ValueError(
                f"loss_chunk_size must be a positive integer or None, got {self.loss_chunk_size!r}"
            )
        if self.nested_groups is not None and not self.nested_remat:
            raise ValueError("nested_groups is set but nested_remat is False; set nested_remat")
        if not self.layer_structure:
            return
        if self.remat_group_size != 1 or not self.scan_layers:
            raise ValueError(
                "remat_layers / nested_remat need scan_layers=True and remat_group_size=1, got "
                f"scan_layers={self.scan_layers}, remat_group_size={self.remat_group_size}"
            )
        per_segment = self.num_layers
        if self.nested_remat:
            per_segment //= check_nested_groups(self.num_layers, self.outer_groups)
        layer_plan(per_segment, self.remat_layers, self.remat_placement)

    @property
    def layer_structure(self) -> bool:
        """True when partial-layer or nested remat is on (:class:`RematLayerStack`)."""
        return self.remat_layers is not None or self.nested_remat

    @property
    def outer_groups(self) -> int | None:
        """Nested remat's outer segment count (None when off)."""
        if not self.nested_remat:
            return None
        return (
            self.nested_groups if self.nested_groups is not None else sqrt_groups(self.num_layers)
        )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def policy_spec(self) -> PolicySpec:
        return get_policy_spec(self.remat_policy)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """The checkpoint names a block emits."""
        return N.SWIGLU_BLOCK_NAMES if self.mlp == "swiglu" else N.GELU_BLOCK_NAMES

    def replace(self, **overrides) -> ModelConfig:
        """A validated copy with fields replaced.

        Raises:
          ValueError: an unknown field (listing the valid ones) or an invalid value.
        """
        _check_fields(overrides)
        return dataclasses.replace(self, **overrides)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_choice(field: str, value, valid) -> None:
    if value not in valid:
        raise N.unknown_value_error(field, value, tuple(valid))


def _check_fields(overrides: dict) -> None:
    valid = tuple(f.name for f in dataclasses.fields(ModelConfig))
    for key in overrides:
        if key not in valid:
            raise N.unknown_value_error("ModelConfig field", key, valid)


_GPT2 = dict(
    vocab_size=50257, max_seq_len=1024, norm="layernorm", mlp="gelu", positions="learned",
    tied_embeddings=True, use_bias=True, qkv_bias=True, dtype="bfloat16", param_dtype="bfloat16",
)  # fmt: skip
_LLAMA3 = dict(
    vocab_size=128256, max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu",
    positions="rope", rope_theta=500_000.0, tied_embeddings=False, dtype="bfloat16",
    param_dtype="bfloat16",
)  # fmt: skip
_LLAMA2 = {**_LLAMA3, "vocab_size": 32000, "max_seq_len": 4096, "rope_theta": 10_000.0}

# Shapes: GPT-2 (Radford et al. 2019, HF config.json); Llama 2 (arXiv:2307.09288); Llama 3 /
# 3.2 (arXiv:2407.21783, HF config.json); Qwen2.5 (arXiv:2412.15115, HF Qwen2.5-7B config.json).
PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig("gpt2-small", d_model=768, num_layers=12, num_heads=12, d_ff=3072, **_GPT2),
        ModelConfig("gpt2-medium", d_model=1024, num_layers=24, num_heads=16, d_ff=4096, **_GPT2),
        ModelConfig("gpt2-large", d_model=1280, num_layers=36, num_heads=20, d_ff=5120, **_GPT2),
        ModelConfig("gpt2-xl", d_model=1600, num_layers=48, num_heads=25, d_ff=6400, **_GPT2),
        ModelConfig(
            "llama3.2-1b",
            d_model=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            d_ff=8192,
            **{**_LLAMA3, "tied_embeddings": True, "max_seq_len": 131072},
        ),  # fmt: skip
        ModelConfig(
            "llama3.2-3b",
            d_model=3072,
            num_layers=28,
            num_heads=24,
            num_kv_heads=8,
            d_ff=8192,
            **{**_LLAMA3, "tied_embeddings": True, "max_seq_len": 131072},
        ),  # fmt: skip
        ModelConfig(
            "llama3-8b",
            d_model=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            d_ff=14336,
            **_LLAMA3,
        ),  # fmt: skip
        ModelConfig(
            "llama3-70b",
            d_model=8192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            d_ff=28672,
            **_LLAMA3,
        ),  # fmt: skip
        ModelConfig("llama2-7b", d_model=4096, num_layers=32, num_heads=32, d_ff=11008, **_LLAMA2),
        ModelConfig("llama2-13b", d_model=5120, num_layers=40, num_heads=40, d_ff=13824, **_LLAMA2),
        ModelConfig(
            "qwen2.5-7b",
            d_model=3584,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            d_ff=18944,
            **{
                **_LLAMA3,
                "vocab_size": 152064,
                "max_seq_len": 32768,
                "rope_theta": 1_000_000.0,
                "norm_eps": 1e-6,
                "qkv_bias": True,
            },
        ),  # fmt: skip
        # Byte-level models for CPU runs and tests.
        ModelConfig(
            "gpt-10m",
            vocab_size=256,
            d_model=384,
            num_layers=6,
            num_heads=6,
            d_ff=1536,
            max_seq_len=1024,
            use_bias=True,
            qkv_bias=True,
        ),  # fmt: skip
        ModelConfig(
            "tiny-gpt",
            vocab_size=256,
            d_model=64,
            num_layers=4,
            num_heads=4,
            d_ff=256,
            max_seq_len=128,
            use_bias=True,
            qkv_bias=True,
        ),  # fmt: skip
        ModelConfig(
            "tiny-llama",
            vocab_size=256,
            d_model=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            d_ff=172,
            max_seq_len=128,
            norm="rmsnorm",
            mlp="swiglu",
            positions="rope",
            tied_embeddings=False,
        ),  # fmt: skip
    ]
}


def preset_names() -> list[str]:
    """Preset names (published shapes first)."""
    return list(PRESETS)


def get_config(name: str | ModelConfig, **overrides) -> ModelConfig:
    """The preset (or :class:`ModelConfig`) ``name`` with ``overrides``. Published-shape presets
    are bfloat16 throughout; ``param_dtype="float32"`` for fp32 master weights::

        >>> config = get_config("llama3-8b", remat_policy="save-dots", scan_layers=True)
        >>> config.d_model, config.num_layers, config.num_kv_heads, config.remat_policy
        (4096, 32, 8, 'save-dots')
        >>> get_config("llama-8b")
        Traceback (most recent call last):
        ...
        ValueError: ...

    Raises:
      ValueError: unknown preset or field (listing the valid ones and the closest), or an
        invalid value.
    """
    if isinstance(name, ModelConfig):
        return name.replace(**overrides)
    if name not in PRESETS:
        raise N.unknown_value_error("preset", name, preset_names())
    return PRESETS[name].replace(**overrides)


CUDNN_DTYPES = ("bfloat16", "float16")


def _compute_capability(target: T.Target) -> tuple[int, int] | None:
    if target.platform != "cuda":
        return None
    if target.gpu is not None:
        return (target.gpu.cc_major, target.gpu.cc_minor)
    text = getattr(jax.devices()[0], "compute_capability", None)
    if not text:
        return None
    major, minor = (int(p) for p in str(text).split(".")[:2])
    return (major, minor)


def attention_choices(target: str | T.Target, config: ModelConfig | None = None) -> tuple[str, ...]:
    """``"xla"``, and ``"cudnn"`` where cuDNN flash attention compiles: CUDA cc >= 8.0, bf16/f16,
    head_dim a multiple of 8 up to 128 (256 from sm_90)
    (``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention``).

    Raises:
      ValueError: unknown target name.
    """
    cc = _compute_capability(T.get_target(target))
    if cc is None or cc < (8, 0):
        return ("xla",)
    if config is not None:
        max_head_dim = 256 if cc >= (9, 0) else 128
        if config.dtype not in CUDNN_DTYPES:
            return ("xla",)
        if config.head_dim % 8 or config.head_dim > max_head_dim:
            return ("xla",)
    return ("xla", "cudnn")


_EMBED_INIT = nn.initializers.normal(stddev=0.02)  # GPT-2's initialisation (Radford et al. 2019)


def _partitioned(init, names: tuple[str, ...]):
    """``init`` with logical axis ``names``; ``rules=()``: never constrained inside the model
    (its layout is the step's input sharding; ``DenseGeneral`` flattens its kernel to 2-d)."""
    return nn.with_logical_partitioning(init, names, rules=())


# Logical axes (remat_kit.targets.LOGICAL_RULES / activation_sharding; inert without rules).
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
    """Dense projection named after its checkpoint tag, its output tagged."""
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

    ``x`` [b, s, heads, d], ``positions`` [s] -> [b, s, heads, d] in ``x``'s dtype.
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

    ``q`` [b, s, a, d], ``k``, ``v`` [b, s, g, d] -> [b, s, a, d]; softmax in float32.
    """
    b, s, a, d = q.shape
    g = k.shape[2]
    q = q.reshape(b, s, g, a // g, d)  # (b, s, g, r, d)
    scores = jnp.einsum("bqgrd,btgd->bgrqt", q, k) / jnp.sqrt(d).astype(q.dtype)
    # An additive [s, s] bias: a jnp.where over the scores is hoisted out of the scan whole.
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
    """Pre-norm block, [b, s, h] -> [b, s, h]. Its input is tagged ``decoder_layer_input``;
    each projection and its Dense carry the MaxText tag (:mod:`remat_kit.names`), so the walker
    attributes untagged copies from JAX's name stack."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)  # (b, s, h)
        x = checkpoint_name(x, N.DECODER_LAYER_INPUT)
        x = x + Attention(c, name="attn")(_norm(c, "attn_norm")(x), positions)
        return x + Mlp(c, name="mlp")(_norm(c, "mlp_norm")(x))


class BlockGroup(nn.Module):
    """``remat_group_size`` blocks: one remat segment, one ``nn.scan`` step (``(x, None)``)."""

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
    # prevent_cse only under a loop-free stack: CSE cannot cross scan iterations, and the
    # barriers cost speed (flax.linen.remat docstring).
    return nn.remat(BlockGroup, policy=spec.to_jax(), prevent_cse=not config.scan_layers)


def structured_stack(config: ModelConfig) -> RematLayerStack:
    """The :class:`RematLayerStack` of ``config``."""
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
    """tokens [b, s] int32 -> logits [b, s, V]; ``return_hidden``: the LM head's input [b, s, h]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, return_hidden: bool = False) -> jax.Array:
        c = self.config
        seq = tokens.shape[-1]
        check_seq_len(seq, c.max_seq_len, c.name, how=f"config.replace(max_seq_len={seq})")
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
    """The :class:`Transformer` for ``config`` (64 cached, so jitted functions see one module)."""
    return Transformer(config)


def resolve_block_policy(policy: Any) -> PolicySpec | Callable[..., bool] | None:
    """A block's policy as the stack applies it: None (no remat), a jax policy callable as
    given, else the :class:`PolicySpec` of a name, spec or mapping.

    Raises:
      ValueError: as :func:`get_policy_spec`.
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
    """One scan step: block ``i`` under ``specs[i]`` (:func:`resolve_block_policy`)."""

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
                # prevent_cse=False under a scan: see remat_group
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
    """Nested remat's outer step: a segment's inner runs."""

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
    """``num_layers`` blocks in layer scans with partial-layer or nested remat (docs/structure.md).

    ``block(name)`` returns a fresh linen module, ``x [batch, seq, d_model]`` and broadcast
    ``*args`` (positions [seq]) -> ``[batch, seq, d_model]``.

    Attributes:
      policy: of the rematerialised blocks (:func:`resolve_block_policy`).
      remat_layers: blocks under ``policy`` (None: all; nested: per segment); the rest under
        ``rest_policy``. ``placement``: see :func:`layer_plan`.
      nested_groups: outer segments (a divisor of ``num_layers``), each checkpointed whole.
      axis_name: logical axis of the stacked parameters (nested outer: ``axis_name + "_outer"``).

    Parameters: ``layers/block_0/...`` (leading dimension L), ``layers_0``, ``layers_1``, ... for
    several runs, nested ``layers/inner/...`` ([groups, L // groups]).

    Raises (when called):
      ValueError: as :func:`layer_plan`, :func:`check_nested_groups`; unknown policy names.
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
            # a logical axis name may appear once: the outer one gets its own (unsplit)
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
      logits_fn: ``[batch, chunk, d_model] -> [batch, chunk, vocab]``, a function of arrays
        (may close over parameters). It must not call a linen submodule (flax's
        ``UnexpectedTracerError``): use the kernel, ``lambda x: x @ self.param(...)``.
      chunk_size: tokens per chunk; must divide ``seq``.

    Returns:
      float32 scalar: ``optax.softmax_cross_entropy_with_integer_labels(logits_fn(hidden),
      targets).mean()`` up to summation order.

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

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_loss(x, t):
        logits = logits_fn(x).astype(jnp.float32)  # (b, c, V)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).sum()

    def body(total, xt):
        return total + chunk_loss(*xt), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts))
    return total / (b * s)


def lm_head_logits(config: ModelConfig, params: Any, x: jax.Array) -> jax.Array:
    """The bundled Transformer's LM head: ``x [..., d_model]`` -> ``[..., vocab]``."""
    dtype = config.compute_dtype
    if config.tied_embeddings:
        return jnp.dot(x.astype(dtype), params["embed"]["embedding"].astype(dtype).T)
    return jnp.dot(x.astype(dtype), params["lm_head"]["kernel"].astype(dtype))


def chunked_model_loss(params: Any, config: ModelConfig, batch: dict[str, jax.Array]) -> jax.Array:
    """The bundled model's mean loss on ``batch`` (``inputs``, ``targets`` [batch, seq] int32),
    chunked by ``config.loss_chunk_size``.

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
