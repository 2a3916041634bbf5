"""Which ``attention`` implementations (``ModelConfig.attention``) a target can compile.

cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) runs on
NVIDIA GPUs of compute capability 8.0 or newer (Ampere, Ada, Hopper), in bfloat16 or float16, with
a head dimension that is a multiple of 8 and at most 128 (256 from Hopper, sm_90): the checks of
``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention`` (jax 0.10.2) and NVIDIA's
cuDNN frontend documentation for the SDPA operation. Elsewhere only ``xla`` (and JAX's own choice,
``dot_product_attention``) compile.
"""

from __future__ import annotations

import jax

from remat_kit import targets as T
from remat_kit.models.config import ModelConfig

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
