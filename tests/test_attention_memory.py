"""The "xla" attention's causal mask must not cost a full-size buffer outside the layer loop."""

import math
import re

import optax
import pytest

import remat_kit
from tests.conftest import needs_cuda_plugin


def _elements(shape: str) -> int:
    dims = re.fullmatch(r"\w+\[([\d,]*)\].*", shape)
    return math.prod(int(d) for d in dims.group(1).split(",") if d) if dims else 0


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100-sxm", marks=needs_cuda_plugin)])
def test_causal_mask_is_not_a_full_size_loop_invariant(target):
    # jnp.where(causal, scores, finfo.min) broadcast the mask and the fill value to the full
    # [b, g, r, s, s] shape; neither depends on the layer's inputs, so the layer scan's partial
    # evaluation hoisted both out of the loop and kept them live (llama3-8b, s=8192: an 8 GiB f32
    # and a 2 GiB pred buffer at the peak). The mask is now an [s, s] additive bias.
    b, s = 1, 1024
    cfg = remat_kit.get_config("tiny-llama", scan_layers=True, num_layers=2, max_seq_len=s)
    scores = b * cfg.kv_heads * (cfg.num_heads // cfg.kv_heads) * s * s
    r = remat_kit.analyze_model(cfg, b, s, "save-nothing", target, optax.sgd(1e-3), top_k=1000)
    outside = [x for x in r.peak_buffers if "while" not in x.op_name and x.phase != "argument"]
    assert outside, "expected some buffers live at the peak outside the layer loop"
    assert all(_elements(x.shape) < scores for x in outside), outside
