"""The checkpoint-name vocabulary: tags the bundled modules put on intermediate values.

Each tag is applied with :func:`jax.ad_checkpoint.checkpoint_name` inside a transformer block, so
a rematerialization policy can refer to a tensor by name (``save_only_these_names``,
``save_and_offload_only_these_names``). The names are MaxText's (``maxtext/layers/*.py``), so a
per-tensor configuration written for MaxText ports over unchanged.

Shapes use ``batch``, ``seq``, ``d_model``, ``heads`` (query heads), ``kv_heads`` (key/value
heads, ``== heads`` without grouped-query attention), ``head_dim = d_model // heads`` and ``d_ff``
(MLP hidden width). Every tagged tensor has the block's compute dtype (``ModelConfig.dtype``).
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

#: Every tag the bundled modules can emit: the tensor it names and its shape (dimension names).
_TAGS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
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
}  # fmt: skip

#: Tag -> its shape as dimension names (``("batch", "seq", "heads", "head_dim")``).
CHECKPOINT_SHAPES: Final[dict[str, tuple[str, ...]]] = {t: shape for t, (_, shape) in _TAGS.items()}

#: Tag -> the tensor it names and its shape, e.g. ``"value projection output x @ W_v, [batch,
#: seq, kv_heads, head_dim]"``.
CHECKPOINT_NAMES: Final[dict[str, str]] = {
    t: f"{what}, [{', '.join(shape)}]" for t, (what, shape) in _TAGS.items()
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
