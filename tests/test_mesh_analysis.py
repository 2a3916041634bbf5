"""The analyzer on a (dp, fsdp, tp) mesh: per-device residuals under tp, per-device recompute ratio.

GPU-target tests compile deviceless for the H100 model (8 compile-only GPUs) a tiny llama-like
model (8 heads, 4 kv heads, d_ff 256, two layers); each compile takes a few seconds.
"""

from __future__ import annotations

import contextlib

import pytest

from remat_kit import names as N
from remat_kit import targets
from remat_kit.memory import analyze_policies, api, hlo
from remat_kit.memory.xla_compile import capture_compiler_log, compile_with_dump
from remat_kit.models import get_config
from remat_kit.targets import get_target
from remat_kit.walker import Residual
from remat_kit.zoo import model_residuals, preset, split_over_tp, tag_axes
from tests.conftest import needs_cuda_plugin

CONFIG = get_config(
    "tiny-llama", num_heads=8, num_kv_heads=4, d_ff=256, num_layers=2, dtype="bfloat16",
    param_dtype="bfloat16",
)  # fmt: skip
#: Tags with a heads / kv_heads / d_ff dimension (split over tp) and those [batch, seq, d_model].
SPLIT = {N.QUERY_PROJ, N.KEY_PROJ, N.VALUE_PROJ, N.CONTEXT, N.MLPWI, N.MLPWI_0, N.MLPWI_1,
         N.ATTENTION_OUT}  # fmt: skip
WHOLE = {N.DECODER_LAYER_INPUT, N.OUT_PROJ, N.MLPWO}


def test_every_tag_has_axes_read_from_its_documented_shape():
    for tag in N.CHECKPOINT_SHAPES:
        axes = tag_axes(tag)
        assert axes is not None and axes[:2] == ("batch", "seq"), (tag, axes)
        assert bool({"heads", "kv_heads", "mlp"} & set(axes)) == (tag in SPLIT), (tag, axes)
    assert tag_axes("no_such_tag") is None
    assert tag_axes(N.QKV_PROJ) is None  # its layout is MaxText's configuration's: not split


#: Every literal name of MaxText's checkpoint_name calls (src/maxtext/layers, models, kernels)
#: and of its 'custom' policy's list (configs/base.yml), less 'engram' (a config field no layer
#: emits).
MAXTEXT_NAMES = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj",
    "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "attention_out", "qkv_proj", "kv_proj",
    "query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo",
    "indexer_cutoff_threshold", "iteration_input",
)  # fmt: skip


def test_the_name_table_holds_every_name_maxtext_emits():
    """MaxText's attention layers tag attention_out, which the table lacked (a MaxText trial):
    every name MaxText emits is described there, and attention_out splits over tp by heads."""
    missing = [t for t in MAXTEXT_NAMES if t not in N.CHECKPOINT_NAMES]
    assert not missing
    assert N.CHECKPOINT_NAMES["attention_out"].endswith("[batch, seq, heads, head_dim]")
    row = Residual("attention_out", "dot_general", (2, 8, 4, 16), "float32", "device", 4096)
    (half,) = split_over_tp([row], 2)
    assert half.shape == (2, 8, 2, 16) and half.nbytes == row.nbytes // 2


def test_residual_rows_under_tp_halve_head_and_mlp_tags_only():
    config = CONFIG.replace(remat_policy="save-dots-except-mlp")
    one = {r.tag: r for r in model_residuals(config, 4, 32)}
    two = {r.tag: r for r in model_residuals(config, 4, 32, tp=2)}
    assert set(one) == set(two) and set(one) & SPLIT and set(one) & WHOLE
    for tag, row in one.items():
        if tag in SPLIT:
            assert two[tag].nbytes * 2 == row.nbytes, tag
            assert two[tag].shape[:2] == row.shape[:2]  # batch and seq are not tp's
        elif tag in WHOLE:
            assert two[tag] == row, tag
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        split_over_tp([], 0)


_HLO_REMAT = """HloModule m

%fused_dot (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/layers/mlp/mlpwo/dot_general"}
}

ENTRY %main (x: f32[8,16], w: f32[16,4]) -> f32[8,4] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %fwd = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(Transformer)/layers/attn/query_proj/dot_general"}
  %again = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(Transformer))/layers/rematted_computation/attn/query_proj/dot_general"}
  %fusion.7 = f32[8,4]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %fusion.7.remat = f32[8,4]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  ROOT %sum = f32[8,4]{1,0} add(%fwd, %again)
}
"""


def test_hlo_counts_jax_and_xla_recomputation_apart():
    count = hlo.count_flops(hlo.parse_hlo_module(_HLO_REMAT))
    one = 2 * 8 * 4 * 16
    assert count.flops == 4 * one
    assert count.recomputed_flops == 2 * one  # the rematted_computation dot, the .remat clone


@needs_cuda_plugin
def test_compiled_stacked_residuals_have_the_analyzers_per_device_shapes():
    """What XLA compiles for tp=2: the forward layer scan stacks each saved residual per device
    as [layers, *shape]; every row of the residual table must be one of them."""
    program = preset(CONFIG, 8, 64, mesh="tp=2")
    setup = api.trace.trace_program(program, get_target("h100-sxm"))
    with targets.activation_sharding(setup.placement.mesh), capture_compiler_log():
        job = api._program_job(setup, api.get_policy_spec("minimal"))
        result = compile_with_dump(job.lower(), "cuda", "minimal on tp=2")
    comps = hlo.parse_hlo_module(result.dump.hlo)
    entry = next(c for c in comps.values() if c.is_entry)
    forward = next(i for i in entry.instructions if i.opcode == "while")
    stacked = set(hlo.array_shapes(forward.shape))
    rows = {r.tag: r for r in job.residuals}
    assert rows[N.QUERY_PROJ].shape == (8, 64, 4, 8) and rows[N.MLPWI_0].shape == (8, 64, 128)
    for row in job.residuals:
        assert ("bf16", (CONFIG.num_layers, *row.shape)) in stacked, (row.tag, sorted(stacked))


@pytest.fixture(scope="module")
def single_device():
    """save-nothing on one device (its ``flops_no_remat`` is the traced step's); no unseen
    no-remat compile (it only judges freed memory; the ratios are the policy's own compile's)."""
    (report,) = analyze_policies(
        preset(CONFIG, 8, 64), ["save-nothing"], "h100-sxm", no_remat_baseline=False
    )
    return report


@needs_cuda_plugin
def test_recompute_ratio_on_a_mesh_matches_one_device(single_device):
    reports = analyze_policies(
        preset(CONFIG, 8, 64, mesh="dp=2,fsdp=2,tp=2"), ["no-remat", "save-nothing"], "h100-sxm"
    )
    mesh = {r.policy: r for r in reports}
    assert mesh["no-remat"].recompute_ratio == pytest.approx(1.0, abs=0.01)
    full = mesh["save-nothing"].recompute_ratio
    assert 1.1 < full < 1.45
    assert full == pytest.approx(single_device.recompute_ratio, rel=0.03)
    assert not any("even share" in w for r in reports for w in r.warnings)


@needs_cuda_plugin
def test_recompute_ratio_is_per_device_when_xla_replicates_work(single_device, monkeypatch):
    """Without the batch constraint on block inputs XLA keeps activations whole across fsdp, so
    each device computes about twice its even share of the matmuls, remat or not. That is not
    recomputation: the ratio must stay that of one device (it read ~2.6 when the baseline was
    the traced FLOPs divided by the device count), and a warning must name the replication."""
    monkeypatch.setattr(targets, "activation_sharding", lambda mesh: contextlib.nullcontext())
    (report,) = analyze_policies(
        preset(CONFIG, 8, 64, mesh="fsdp=8"), ["save-nothing"], "h100-sxm", no_remat_baseline=False
    )
    assert report.recompute_ratio == pytest.approx(single_device.recompute_ratio, rel=0.1)
    assert any("its even share (1/8)" in w for w in report.warnings), report.warnings
    # the per-device baseline is more than the even split: the work XLA left replicated
    assert report.flops_no_remat > 1.1 * single_device.flops_no_remat / 8
