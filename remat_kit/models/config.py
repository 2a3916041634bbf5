"""ModelConfig and presets at the published shapes of real models, and what a config decides
before a module is built: the layer plan of partial-layer and nested remat, and which attention
implementations a target can compile.

**Layer plans.** Two ways to spend less recompute, or less memory, than one policy on every
layer (the stack itself is :class:`remat_kit.models.transformer.RematLayerStack`):

* **Partial-layer remat** (Megatron-LM's ``--recompute-method block --recompute-num-layers k``):
  ``remat_layers`` of the ``num_layers`` blocks run under the policy, the others under a second
  policy (default: not rematerialised). ``placement="first"`` puts them first (two layer scans);
  ``"interleaved"`` spreads them evenly, every ``num_layers // remat_layers``-th block (one scan
  over groups of that many blocks, each position with its static choice). See
  :func:`layer_plan`.
* **Nested remat** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
  arXiv:1604.06174, section 4; Levanter's nested scan): an outer scan over ``groups`` segments,
  each checkpointed whole (only its input is kept: the outer carry), an inner scan over the
  segment's ``num_layers // groups`` blocks under the per-layer policy. The backward pass
  recomputes one segment at a time, so stored layer inputs are ``groups + num_layers // groups``
  instead of ``num_layers``: least at ``groups = sqrt(num_layers)`` (:func:`sqrt_groups`), for one
  more forward pass of every block.

**Attention implementations** (:func:`attention_choices`). cuDNN's fused flash attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) runs on NVIDIA GPUs of compute
capability 8.0 or newer (Ampere, Ada, Hopper), in bfloat16 or float16, with a head dimension that
is a multiple of 8 and at most 128 (256 from Hopper, sm_90): the checks of
``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention`` (jax 0.10.2) and NVIDIA's
cuDNN frontend documentation for the SDPA operation. Elsewhere only ``xla`` (and JAX's own
choice, ``dot_product_attention``) compile.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp

from remat_kit import names as N
from remat_kit import targets as T
from remat_kit.policies import PolicySpec, get_policy_spec
from remat_kit.validation import positive_int, unknown_value_error

Placement = Literal["first", "interleaved"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
#: One scan of the stack: the per-position remat choice of one scan step, and the trip count.
Run = tuple[tuple[bool, ...], int]


def layer_plan(
    num_layers: int, remat_layers: int | None = None, placement: str = "first"
) -> tuple[Run, ...]:
    """The layer scans that put ``remat_layers`` of ``num_layers`` blocks under the policy.

    Returns:
      ``((pattern, repeats), ...)``: one scan per run, each step applying ``len(pattern)``
      blocks, ``pattern[i]`` True where block ``i`` of the step is rematerialised. ``None`` (all
      layers) gives ``(((True,), num_layers),)``; ``placement="first"`` with ``0 < k < L`` gives
      ``(((True,), k), ((False,), L - k))``; ``"interleaved"`` gives one run whose pattern of
      ``L // k`` blocks rematerialises its first.

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
    """The divisor of ``num_layers`` nearest ``sqrt(num_layers)`` (the smaller on a tie): the
    outer group count that minimises ``groups + num_layers / groups`` stored layer inputs
    (Chen et al. 2016). ``sqrt_groups(32) == 4``, ``sqrt_groups(36) == 6``.

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
    """Layer inputs live at the start of the backward pass's worst segment: ``num_layers`` for
    per-layer remat; ``groups + num_layers // groups`` nested (outer carries plus one segment's
    inner carries while it is recomputed). The textbook count that the measured bytes follow."""
    if groups is None:
        return num_layers
    return groups + num_layers // check_nested_groups(num_layers, groups)


Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "swiglu"]
Positions = Literal["learned", "rope"]
#: ``xla``: plain einsum attention that materialises the [batch, heads, seq, seq] scores (tagged
#: and rematerialisable); ``dot_product_attention``: ``jax.nn.dot_product_attention`` letting JAX
#: pick the implementation; ``cudnn``: the same forced to the cuDNN flash kernel (GPU only).
Attention = Literal["xla", "dot_product_attention", "cudnn"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer, passed whole to every module.

    Shapes: ``d_model`` (hidden size h), ``num_heads`` (a), ``head_dim = d_model // num_heads``.
    """

    name: str = "custom"
    vocab_size: int = 256  # tokens; logits are [batch, seq, vocab_size]
    d_model: int = 64  # residual stream width
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # query heads
    num_kv_heads: int | None = None  # key/value heads (GQA); None means num_heads
    d_ff: int = 256  # MLP hidden width
    max_seq_len: int = 128  # longest sequence (learned positions table size)
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    mlp: Mlp = "gelu"
    positions: Positions = "learned"
    rope_theta: float = 10_000.0  # RoPE base frequency (Su et al. 2021, arXiv:2104.09864)
    tied_embeddings: bool = True  # logits use the token embedding matrix transposed
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2); GPT-2 uses biases everywhere
    use_bias: bool = False  # bias on every other dense layer (GPT-2)
    dtype: str = "float32"  # compute (activation) dtype
    param_dtype: str = "float32"  # parameter storage dtype
    attention: Attention = "xla"
    remat_policy: str | PolicySpec = "no-remat"  # a name from remat_kit.policy_names() or a spec
    scan_layers: bool = True  # nn.scan over blocks (one compiled block) vs an unrolled loop
    remat_group_size: int = 1  # k consecutive blocks form one remat segment
    # Partial-layer remat (layer_plan; transformer.RematLayerStack): only ``remat_layers`` blocks
    # use ``remat_policy`` (None: all), placed first or interleaved; the rest ``rest_remat_policy``.
    remat_layers: int | None = None
    remat_placement: Placement = "first"
    rest_remat_policy: str | PolicySpec = "no-remat"
    # Nested remat: an outer scan over ``nested_groups`` checkpointed segments (None:
    # sqrt_groups(num_layers)); ``remat_layers`` then counts blocks per segment.
    nested_remat: bool = False
    nested_groups: int | None = None
    # Chunked cross-entropy (transformer.chunked_cross_entropy): LM head + loss over sequence
    # chunks of this many tokens under remat, so the [batch, seq, vocab] logits never exist
    # whole. None: whole.
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
        for field, ty in (("norm", Norm), ("mlp", Mlp), ("positions", Positions)):
            _check_choice(field, getattr(self, field), get_args(ty))
        _check_choice("attention", self.attention, get_args(Attention))
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        get_policy_spec(self.remat_policy)  # raises on an unknown name
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
        """True when partial-layer or nested remat is on (the layer stack is
        :class:`remat_kit.models.transformer.RematLayerStack`)."""
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
        """Key/value heads (``num_kv_heads`` or ``num_heads``)."""
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
        """The tags a block of this config emits."""
        return N.SWIGLU_BLOCK_NAMES if self.mlp == "swiglu" else N.GELU_BLOCK_NAMES

    def replace(self, **overrides) -> ModelConfig:
        """A copy with fields replaced (validated again).

        Raises:
          ValueError: an unknown field name (listing the valid ones) or an invalid value.
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

# Published shapes: GPT-2 (Radford et al. 2019, HF gpt2* config.json); Llama 2 (Touvron et al.
# 2023, arXiv:2307.09288); Llama 3 / 3.2 (Meta, "The Llama 3 Herd of Models", arXiv:2407.21783,
# HF config.json); Qwen2.5 (Qwen team 2024, arXiv:2412.15115, HF Qwen2.5-7B config.json).
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
        # Byte-level (vocabulary 256) models for CPU runs and tests.
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
    """Names of every preset (published shapes first, then byte-level test models)."""
    return list(PRESETS)


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied (e.g. ``remat_policy="save-dots"``).

    Presets at published shapes compute in bfloat16 and store parameters in bfloat16, as the
    memory figures in the design notes assume; override ``param_dtype`` for fp32 master weights.

    Raises:
      ValueError: unknown preset or field (message lists the valid ones and the closest match),
        or an invalid value (see :class:`ModelConfig`).

    Example::

        >>> config = get_config("llama3-8b", remat_policy="save-dots", scan_layers=True)
        >>> config.d_model, config.num_layers, config.num_kv_heads, config.remat_policy
        (4096, 32, 8, 'save-dots')
        >>> get_config("llama-8b")
        Traceback (most recent call last):
        ...
        ValueError: ...
    """
    if name not in PRESETS:
        raise N.unknown_value_error("preset", name, preset_names())
    return PRESETS[name].replace(**overrides)


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["d_model=128", "norm=rmsnorm"]`` -> ``{"d_model": 128, "norm": "rmsnorm"}``: command-line
    ``--set FIELD=VALUE`` overrides of :class:`ModelConfig` fields (values read as JSON where they
    parse, else as strings). Field names and values are checked by :func:`get_config`.

    Raises:
      ValueError: an item without ``=`` or without a field name.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set takes FIELD=VALUE (a ModelConfig field), got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


CUDNN_DTYPES = ("bfloat16", "float16")


def _compute_capability(target: T.Target) -> tuple[int, int] | None:
    if target.platform != "cuda":
        return None
    if target.gpu is not None:
        return (target.gpu.cc_major, target.gpu.cc_minor)
    # the local CUDA device describes itself
    text = getattr(jax.devices()[0], "compute_capability", None)
    if not text:
        return None
    major, minor = (int(p) for p in str(text).split(".")[:2])
    return (major, minor)


def attention_choices(target: str | T.Target, config: ModelConfig | None = None) -> tuple[str, ...]:
    """The ``ModelConfig.attention`` values worth searching on ``target``: always ``"xla"``;
    ``"cudnn"`` where cuDNN flash attention exists (CUDA, compute capability >= 8.0) and, given a
    ``config``, its dtype (bfloat16 / float16) and head_dim (multiple of 8, <= 128, or <= 256 on
    sm_90+) qualify.

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
