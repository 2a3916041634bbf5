"""The checkpoint-name vocabulary: tags the bundled modules put on intermediate values, and the
other names MaxText's layers emit.

Each tag is applied with :func:`jax.ad_checkpoint.checkpoint_name` inside a transformer block, so
a rematerialization policy can refer to a tensor by name. The names are MaxText's
(``maxtext/layers/*.py``), so a per-tensor configuration written for MaxText ports over
unchanged; the table also holds every name MaxText emits that the bundled modules do not
(``attention_out``, fused, MLA and MoE projections, ``iteration_input``), so a MaxText
model's program is read in the same vocabulary.

Shapes use ``batch``, ``seq``, ``d_model``, ``heads`` (query heads), ``kv_heads`` (key/value
heads, ``== heads`` without grouped-query attention), ``head_dim = d_model // heads``, ``d_ff``
(MLP hidden width) and, for MaxText's multi-head latent attention (MLA), ``q_lora_rank`` and
``kv_lora_rank`` (the latent widths). A name whose layout depends on MaxText's configuration
(a fused projection, an MoE implementation) has none (:data:`CHECKPOINT_SHAPES` leaves it out).
Every tagged tensor of the bundled modules has the block's compute dtype (``ModelConfig.dtype``).
"""

from __future__ import annotations

from typing import Final

from remat_kit.validation import closest as closest  # noqa: F401  (re-export)
from remat_kit.validation import unknown_value_error as unknown_value_error

DECODER_LAYER_INPUT: Final = "decoder_layer_input"
QUERY_PROJ: Final = "query_proj"
KEY_PROJ: Final = "key_proj"
VALUE_PROJ: Final = "value_proj"
CONTEXT: Final = "context"
OUT_PROJ: Final = "out_proj"
MLPWI: Final = "mlpwi"
MLPWI_0: Final = "mlpwi_0"
MLPWI_1: Final = "mlpwi_1"
MLPWO: Final = "mlpwo"
# Emitted by MaxText's layers, not by the bundled modules.
ATTENTION_OUT: Final = "attention_out"
QKV_PROJ: Final = "qkv_proj"
KV_PROJ: Final = "kv_proj"
QUERY_WA_PROJ: Final = "query_wa_proj"
KV_WA_PROJ: Final = "kv_wa_proj"
MLA_Q: Final = "mla_q"
MLA_KV: Final = "mla_kv"
MOE_MLPWI_0: Final = "moe_mlpwi_0"
MOE_MLPWI_1: Final = "moe_mlpwi_1"
MOE_MLPWO: Final = "moe_mlpwo"
INDEXER_CUTOFF_THRESHOLD: Final = "indexer_cutoff_threshold"
ITERATION_INPUT: Final = "iteration_input"

#: Every tag the bundled modules can emit, then MaxText's others: the tensor it names and its
#: shape (dimension names; None where MaxText's configuration decides the layout).
_TAGS: Final[dict[str, tuple[str, tuple[str, ...] | None]]] = {
    DECODER_LAYER_INPUT: ("input of a transformer block (residual stream)",
                          ("batch", "seq", "d_model")),
    QUERY_PROJ: ("query projection output x @ W_q (before RoPE)",
                 ("batch", "seq", "heads", "head_dim")),
    KEY_PROJ: ("key projection output x @ W_k (before RoPE)",
               ("batch", "seq", "kv_heads", "head_dim")),
    VALUE_PROJ: ("value projection output x @ W_v", ("batch", "seq", "kv_heads", "head_dim")),
    CONTEXT: ("attention output softmax(q k^T) v before the output projection",
              ("batch", "seq", "heads", "head_dim")),
    OUT_PROJ: ("attention output projection context @ W_o", ("batch", "seq", "d_model")),
    MLPWI: ("plain (GELU) MLP input projection x @ W_i, before the activation",
            ("batch", "seq", "d_ff")),
    MLPWI_0: ("gated (SwiGLU) MLP gate projection x @ W_gate, before SiLU",
              ("batch", "seq", "d_ff")),
    MLPWI_1: ("gated (SwiGLU) MLP up projection x @ W_up", ("batch", "seq", "d_ff")),
    MLPWO: ("MLP output projection h @ W_o", ("batch", "seq", "d_model")),
    ATTENTION_OUT: ("attention output before the output projection, as MaxText's attention "
                    "layers tag it (they tag context inside the cuDNN flash kernel only)",
                    ("batch", "seq", "heads", "head_dim")),
    QKV_PROJ: ("fused query/key/value projection output (MaxText's fused_qkv; [batch, seq, "
               "heads + 2 kv_heads, head_dim], or [batch, seq, 3, heads, head_dim] in its GPT-3)",
               None),
    KV_PROJ: ("fused key/value projection output (MaxText's compressed attention)", None),
    QUERY_WA_PROJ: ("MLA query down-projection x @ W_qa, before its norm",
                    ("batch", "seq", "q_lora_rank")),
    KV_WA_PROJ: ("MLA key/value down-projection x @ W_kva, before its norm ([batch, seq, "
                 "kv_lora_rank + the RoPE head width])", None),
    MLA_Q: ("MLA query latent after its norm", ("batch", "seq", "q_lora_rank")),
    MLA_KV: ("MLA key/value latent after its norm", ("batch", "seq", "kv_lora_rank")),
    MOE_MLPWI_0: ("MoE experts' gate projection output (also tagged mlpwi_0; the layout is the "
                  "MoE implementation's)", None),
    MOE_MLPWI_1: ("MoE experts' up projection output (also tagged mlpwi_1)", None),
    MOE_MLPWO: ("MoE experts' output projection (also tagged mlpwo)", None),
    INDEXER_CUTOFF_THRESHOLD: ("sparse attention indexer's top-k cutoff score per query "
                               "(MaxText's DeepSeek MLA)", ("batch", "seq")),
    ITERATION_INPUT: ("pipeline stages' input at each iteration (MaxText's pipeline "
                      "parallelism, [stages, microbatch, seq, d_model])", None),
}  # fmt: skip

#: Tag -> its shape as dimension names (``("batch", "seq", "heads", "head_dim")``), for every
#: tag whose layout is fixed.
CHECKPOINT_SHAPES: Final[dict[str, tuple[str, ...]]] = {
    t: shape for t, (_, shape) in _TAGS.items() if shape is not None
}

#: Tag -> the tensor it names and its shape, e.g. ``"value projection output x @ W_v, [batch,
#: seq, kv_heads, head_dim]"``.
CHECKPOINT_NAMES: Final[dict[str, str]] = {
    t: what if shape is None else f"{what}, [{', '.join(shape)}]"
    for t, (what, shape) in _TAGS.items()
}

#: The MLP input projection's names in the other family: a plain MLP's ``mlpwi`` and a gated
#: one's ``mlpwi_0`` / ``mlpwi_1`` (a registered policy names both families; a program emits one).
MLP_ALTERNATES: Final[dict[str, frozenset[str]]] = {
    MLPWI: frozenset({MLPWI_0, MLPWI_1}),
    MLPWI_0: frozenset({MLPWI}),
    MLPWI_1: frozenset({MLPWI}),
}

#: Tags emitted by a block with a plain GELU MLP (GPT-2 family).
GELU_BLOCK_NAMES: Final = (
    DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, CONTEXT, OUT_PROJ, MLPWI, MLPWO,
)  # fmt: skip
#: Tags emitted by a block with a gated SwiGLU MLP (Llama family).
SWIGLU_BLOCK_NAMES: Final = (
    DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, CONTEXT, OUT_PROJ, MLPWI_0, MLPWI_1,
    MLPWO,
)  # fmt: skip


def validate_name(name: object) -> str:
    """Return ``name`` if it can be a ``checkpoint_name``: a non-empty string without surrounding
    whitespace. Any such name is accepted (the vocabulary is open: a user's model tags its own
    tensors); whether a program emits it is checked where the program is at hand
    (:func:`remat_kit.policies.check_tags`, the doctor's ``unknown-tag``).

    Raises:
      ValueError: ``name`` is not a non-empty string, or has leading/trailing whitespace.

    Example::

        >>> validate_name("query_proj"), validate_name("my_own_tag")
        ('query_proj', 'my_own_tag')
        >>> validate_name(" query_proj")
        Traceback (most recent call last):
        ...
        ValueError: checkpoint name must be a non-empty string without surrounding spaces, ...
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(
            f"checkpoint name must be a non-empty string without surrounding spaces, got {name!r}"
        )
    return name
