"""analyze -> MemoryReport: XLA's figures, the residual table, FLOPs, XLA's dumps and log.

CPU tests compile tiny scanned models (remat only survives on XLA:CPU inside a scan); GPU-target
tests compile deviceless for the H100 model with the CUDA plugin, at b=1, s=2048, d_model=2048,
two and four layers, plain SGD (fewer kernels, faster compiles; memory is the same question).
"""

from __future__ import annotations

import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import optax
import pytest

import remat_kit
from remat_kit import names as N
from remat_kit import targets
from remat_kit.memory import (
    CompileError,
    MemoryReport,
    analyze,
    analyze_model,
    analyze_policies,
    hlo,
    korthikanti_bytes,
    per_layer_activations,
)
from remat_kit.memory import xla_compile as mc
from remat_kit.policies import policy_specs
from remat_kit.walker import traced_flops
from remat_kit.zoo import model_residuals

needs_cuda_plugin = pytest.mark.skipif(
    targets.cuda_plugin_module() is None,
    reason="JAX's CUDA plugin is not installed (pip install 'remat-kit[cuda12]')",
)
ORDERED = ["save-nothing", "save-dots-no-batch", "save-dots", "no-remat"]
_PROJECTIONS = {N.QUERY_PROJ, N.KEY_PROJ, N.VALUE_PROJ, N.OUT_PROJ, N.MLPWI, N.MLPWI_0}
_PROJECTIONS |= {N.MLPWI_1, N.MLPWO}


@pytest.fixture(scope="module")
def cpu_reports() -> dict[str, MemoryReport]:
    """tiny-llama, b=2, s=64, scanned, on the CPU: four policies compiled concurrently."""
    reports = analyze_policies(remat_kit.preset("tiny-llama", 2, 64), ORDERED, target="cpu")
    return {r.policy: r for r in reports}


# -- XLA's figures --------------------------------------------------------------------------


def test_peak_is_argument_plus_output_plus_temp_minus_alias(cpu_reports):
    for r in cpu_reports.values():
        assert r.peak_bytes == r.argument_bytes + r.output_bytes + r.temp_bytes - r.alias_bytes
        assert r.target == "cpu" and r.platform == "cpu" and "CPU" in r.backend
        assert r.host_bytes == 0  # offload is not real on the CPU backend
        assert r.fits is None and r.memory_bytes is None
        assert r.compile_s > 0


def test_argument_split_sums_to_argument_bytes(cpu_reports):
    r = cpu_reports["save-nothing"]
    assert set(r.arguments) == {"params", "opt_state", "batch"}
    assert sum(r.arguments.values()) == r.argument_bytes
    assert r.arguments["batch"] == 2 * 2 * 64 * 4  # inputs and targets, int32
    # AdamW keeps two moments in the parameter dtype, plus two int32 counters.
    assert r.arguments["opt_state"] == 2 * r.arguments["params"] + 4 + 4
    assert r.alias_bytes >= r.arguments["params"] + r.arguments["opt_state"] - 8  # donated


def test_policy_order_holds_under_scan(cpu_reports):
    temps = [cpu_reports[p].temp_bytes for p in ORDERED]
    assert temps == sorted(temps), dict(zip(ORDERED, temps, strict=True))
    assert temps[0] < temps[-1]


def test_flops_and_recompute_ratio(cpu_reports):
    base = cpu_reports["no-remat"]
    assert base.flops == pytest.approx(base.flops_no_remat, rel=1e-6)  # XLA:CPU: same dots
    assert base.recompute_ratio == pytest.approx(1.0, rel=1e-6)
    full = cpu_reports["save-nothing"].recompute_ratio
    assert 1.15 < full < 1.4  # the forward of the blocks (not the logits) runs twice
    assert 1.0 <= cpu_reports["save-dots-no-batch"].recompute_ratio < full


def test_logits_line_and_peak_buffers(cpu_reports):
    r = cpu_reports["no-remat"]
    assert r.logits.shape == (2, 64, 256)
    assert r.logits.logits_bytes == 2 * 64 * 256 * 4 and r.logits.f32_bytes == 2 * 64 * 256 * 4
    assert 0 < len(r.peak_buffers) <= 10
    sizes = [b.nbytes for b in r.peak_buffers]
    assert sizes == sorted(sizes, reverse=True)
    assert r.live_peak_bytes >= sum(sizes)
    assert all(b.shape and b.kind and b.phase for b in r.peak_buffers)
    kinds = {b.kind for b in r.peak_buffers}
    assert kinds & {"params", "opt_state"}, kinds


def test_report_round_trips_through_json(cpu_reports):
    r = cpu_reports["save-dots-no-batch"]
    text = r.to_json()
    assert json.loads(text)["peak_bytes"] == r.peak_bytes
    assert MemoryReport.from_json(text) == r


# -- The residual table ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(policy_specs()))
@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
def test_each_policy_residual_table_matches_its_promise(model, name):
    spec = policy_specs()[name]
    config = remat_kit.get_config(model, remat_policy=name)
    emitted = set(config.checkpoint_names)
    rows = model_residuals(config, 2, 16)
    device = {r.tag for r in rows if r.memory == "device"}
    host = {r.tag for r in rows if r.memory == "host"}
    assert all(r.count % config.num_layers == 0 for r in rows)
    # The MLP output projection feeds only the residual add: the backward pass never needs it,
    # so no policy keeps it, whatever it allows.
    needed = emitted - {N.MLPWO}
    assert N.MLPWO not in device | host
    projections = _PROJECTIONS & needed
    if spec.base == "names":
        layer_input = {N.DECODER_LAYER_INPUT} - spec.offload  # the scan keeps segment inputs
        assert device == (spec.save & needed) | layer_input, device
        assert host == spec.offload & needed, host
    elif spec.base == "dots_no_batch":  # weight matmuls only: no attention scores or context
        assert device == projections | {N.DECODER_LAYER_INPUT} and not host
    elif spec.base == "dots":  # ... plus the batched attention matmuls: the scores (untagged)
        # and context (its matmul's output before the transpose the name is applied after)
        kept = {N.DECODER_LAYER_INPUT, N.CONTEXT, "<dot_general>"}
        assert device == projections | kept and not host
    else:  # no-remat keeps what the backward pass needs, including untagged values
        assert projections - {N.QUERY_PROJ, N.KEY_PROJ, N.OUT_PROJ, N.MLPWO} <= device
        assert any(tag.startswith("<") for tag in device) and not host


# -- Any function ---------------------------------------------------------------------------


def _mlp_grad(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)


def test_analyze_any_function_on_abstract_or_real_arguments():
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    x = jnp.ones((64, 256), jnp.float32)
    r = analyze(_mlp_grad, w, x, target="cpu")
    assert r.name == "_mlp_grad" and r.policy is None and r.residuals == ()
    assert r.arguments == {"w": 256 * 256 * 4, "x": 64 * 256 * 4}
    assert r.output_bytes == 256 * 256 * 4
    assert r.flops == pytest.approx(traced_flops(_mlp_grad, w, x))
    slow = analyze(jax.jit(_mlp_grad), w, x, target="cpu", fast_compile=False)
    parts = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")
    assert [getattr(slow, p) for p in parts] == [getattr(r, p) for p in parts]


def test_compile_failure_names_the_policy_and_xla_first_line(monkeypatch, fresh_compile_cache):
    class Broken:
        def compile(self, compiler_options=None):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nwhile compiling\n...")

        def as_text(self):
            return "broken"

    with pytest.raises(CompileError) as err:
        mc.compile_with_dump(Broken(), "cpu", "policy 'save-dots' on target 'cpu'")
    assert str(err.value) == (
        "policy 'save-dots' on target 'cpu' failed to compile: RESOURCE_EXHAUSTED: out of memory"
    )
    monkeypatch.setattr(jax.stages.Lowered, "compile", Broken.compile)
    results = analyze_policies(
        remat_kit.preset("tiny-gpt", 1, 8), ["save-nothing"], target="cpu", raise_errors=False
    )
    assert isinstance(results[0], CompileError) and results[0].policy == "save-nothing"
    assert "policy 'save-nothing'" in str(results[0]) and "\n" not in str(results[0])


@pytest.mark.parametrize(
    ("xla_message", "over_memory"),
    [
        ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 31.2G of 30.75G", True),
        ("resource_exhausted: XLA:TPU compile permanent error", True),
        ("INTERNAL: Ran out of memory while allocating scratch", True),
        ("INTERNAL: ptxas exited with status 1", False),
        ("UNIMPLEMENTED: GetCostAnalysis is not supported", False),
    ],
)
def test_compile_error_says_whether_xla_refused_the_step_for_memory(xla_message, over_memory):
    assert CompileError("policy 'x' on target 'v5p-8'", xla_message).out_of_memory is over_memory


def test_bad_model_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        analyze_model("tiny-gpt", 0, 8, "save-nothing", target="cpu")
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        analyze_model("tiny-gpt", 1, 4096, "save-nothing", target="cpu")
    with pytest.raises(ValueError, match="unknown policy"):
        analyze_policies(remat_kit.preset("tiny-gpt", 1, 8), ["save-everything"], target="cpu")
    with pytest.raises(ValueError, match="unknown target"):
        analyze_model("tiny-gpt", 1, 8, "save-nothing", target="h100")


# -- XLA's dumps and log --------------------------------------------------------------------

_HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/layers/attn/query_proj/dot_general"}
}

%body (arg_tuple: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %arg_tuple = (s32[], f32[8,16]{1,0}) parameter(0)
  %gte = f32[8,16]{1,0} get-tuple-element(%arg_tuple), index=1
  %w = f32[16,4]{1,0} constant({...})
  %fusion.1 = f32[8,4]{1,0} fusion(%gte, %w), kind=kOutput, calls=%fused_dot
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%arg_tuple, %gte)
}

%cond (arg_tuple.1: (s32[], f32[8,16])) -> pred[] {
  %arg_tuple.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)
  %while.3 = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%while.3), index=1
}
"""


def test_hlo_flops_multiply_loop_bodies_by_trip_count():
    comps = hlo.parse_hlo_module(_HLO)
    assert set(comps) == {"fused_dot", "body", "cond", "main"}
    count = hlo.count_flops(comps)
    assert count.flops == 6 * 2 * 8 * 4 * 16 and count.unknown_trip_counts == 0
    unknown = hlo.count_flops(
        hlo.parse_hlo_module(_HLO.replace(', backend_config={"known_trip_count":{"n":"6"}}', ""))
    )
    assert unknown.flops == 2 * 8 * 4 * 16 and unknown.unknown_trip_counts == 1
    instr, comp = hlo.instructions_by_name(comps)["dot.1"]
    assert instr.op_name.endswith("query_proj/dot_general") and comp.name == "fused_dot"


_CLONES_HLO = """HloModule jit_step, is_scheduled=true

%body (arg_tuple: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %arg_tuple = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%arg_tuple), index=1
  %w = f32[16,16]{1,0} constant({...})
  %dot.1 = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.1.remat = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.2.remat = f32[8,16]{1,0} dot(%dot.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.2.remat2 = f32[8,16]{1,0} dot(%dot.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.3.remat2 = f32[8,16]{1,0} dot(%dot.1.remat, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%arg_tuple, %dot.3.remat2)
}

%cond (arg_tuple.1: (s32[], f32[8,16])) -> pred[] {
  %arg_tuple.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x.1 = f32[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x.1)
  %while.3 = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%while.3), index=1
}
"""


def test_flops_added_by_xla_remat_are_every_clone_but_one_per_original():
    """XLA's remat pass names clones after their original and removes an original once a
    clone took all its uses: ``dot.1`` and a clone (1 added), ``dot.2`` gone with two clones
    left (1 added), ``dot.3`` gone with one clone left (a move: none added); in a loop of 4."""
    dot = 2 * 8 * 16 * 16
    count = hlo.count_flops(hlo.parse_hlo_module(_CLONES_HLO))
    assert count.flops == 4 * 5 * dot
    assert count.xla_remat_flops == 4 * 2 * dot  # the policy's own: 3 dots a trip
    assert count.recomputed_flops == 4 * 4 * dot  # every clone is recomputation as run
    assert hlo.count_flops(hlo.parse_hlo_module(_HLO)).xla_remat_flops == 0


_SPLIT_K_HLO = """HloModule jit_step, is_scheduled=true

%fused_pad (param_0.1: f32[520,64]) -> f32[544,64] {
  %param_0.1 = f32[520,64]{1,0} parameter(0)
  %zero.1 = f32[] constant(0)
  ROOT %pad.1 = f32[544,64]{1,0} pad(%param_0.1, %zero.1), padding=0_24x0_0
}

%fused_pad.2 (param_0.2: f32[520,256]) -> f32[544,256] {
  %param_0.2 = f32[520,256]{1,0} parameter(0)
  %zero.2 = f32[] constant(0)
  ROOT %pad.2 = f32[544,256]{1,0} pad(%param_0.2, %zero.2), padding=0_24x0_0
}

%gemm (p0: f32[8,68,64], p1: f32[8,68,256]) -> f32[8,64,256] {
  %p0 = f32[8,68,64]{2,1,0} parameter(0)
  %p1 = f32[8,68,256]{2,1,0} parameter(1)
  ROOT %dot.59 = f32[8,64,256]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (x: f32[520,64], g: f32[520,256]) -> f32[8,64,256] {
  %x = f32[520,64]{1,0} parameter(0)
  %g = f32[520,256]{1,0} parameter(1)
  %loop_pad_fusion = f32[544,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_pad
  %loop_pad_fusion.2 = f32[544,256]{1,0} fusion(%g), kind=kLoop, calls=%fused_pad.2
  %bitcast.1 = f32[8,68,64]{2,1,0} bitcast(%loop_pad_fusion)
  %bitcast.2 = f32[8,68,256]{2,1,0} bitcast(%loop_pad_fusion.2)
  ROOT %gemm_fusion_dot.41 = f32[8,64,256]{2,1,0} fusion(%bitcast.1, %bitcast.2), kind=kCustom, calls=%gemm
}
"""


def test_flops_leave_out_the_zeros_xla_pads_a_split_k_gemm_with():
    """XLA's GPU split-K rewrite pads a weight gradient's contracting dimension (520 tokens to
    8 x 68 = 544) in a fusion of its own before the gemm fusion: the step's FLOPs are the
    program's 2 * 520 * 64 * 256, as its jaxpr counts them, not the padded 544 (a no-remat
    step would otherwise show a recompute ratio of 1.05)."""
    comps = hlo.parse_hlo_module(_SPLIT_K_HLO)
    assert hlo.count_flops(comps).flops == 2 * 520 * 64 * 256
    unpadded = _SPLIT_K_HLO.replace("calls=%fused_pad.2", "calls=%gemm_input")
    # a producer that is not a pad fusion: only the other operand's share applies (the same)
    assert hlo.count_flops(hlo.parse_hlo_module(unpadded)).flops == 2 * 520 * 64 * 256
    # the program's own pads (a JAX op_name: jnp.pad) are in its jaxpr too: counted padded
    own = _SPLIT_K_HLO.replace(
        "padding=0_24x0_0", 'padding=0_24x0_0, metadata={op_name="jit(step)/pad"}'
    )
    assert hlo.count_flops(hlo.parse_hlo_module(own)).flops == 2 * 544 * 64 * 256
    # a gemm in the same computation as XLA's pads (no fusion around it): the same share
    inline = (
        _SPLIT_K_HLO.replace(", kind=kCustom, calls=%gemm", "")
        .replace("fusion(%bitcast.1, %bitcast.2)", "dot(%bitcast.1, %bitcast.2)")
        .replace("%gemm_fusion_dot.41 = f32[8,64,256]{2,1,0} dot(%bitcast.1, %bitcast.2)",
                 "%gemm_fusion_dot.41 = f32[8,64,256]{2,1,0} dot(%bitcast.1, %bitcast.2), "
                 "lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, "
                 "rhs_contracting_dims={1}")
    )  # fmt: skip
    assert "calls=%gemm\n" not in inline and " dot(%bitcast.1" in inline
    assert hlo.count_flops(hlo.parse_hlo_module(inline)).flops == 2 * 520 * 64 * 256
    assert hlo.count_flops(hlo.parse_hlo_module(_HLO)).flops == 6 * 2 * 8 * 4 * 16


def test_live_range_and_buffer_assignment_parsing():
    live = hlo.parse_live_at_peak(
        "HloLiveRange (max 9):\n  Live ranges at 4 (peak):\n"
        "    fusion.2{}: 1024 bytes (cumulative: 1024 bytes)\n"
        "    while.3{1}: 512 bytes (cumulative: 1536 bytes)\n"
        "  Stack trace breakdown for peak usage: 1536 bytes\n"
    )
    assert [(b.value, b.nbytes) for b in live] == [("fusion.2", 1024), ("while.3{1}", 512)]
    slots = hlo.parse_buffer_slots(
        "allocation 0: size 2048, preallocated-temp:\n"
        " value: <7 fusion.2 @0> (size=1024,offset=0): f32[16,16]{1,0}\n"
        " value: <8 while.3{1} (phi) @0> (size=512,offset=1024): f32[8,16]{1,0}\n"
        "allocation 1: size 512, parameter 0:\n"
        " value: <9 x @0> (size=512,offset=0): f32[8,16]{1,0}\n"
    )
    assert slots["fusion.2"] == hlo.BufferSlot("f32[16,16]{1,0}", 0, 0, 1024)
    assert slots["while.3{1}"] == hlo.BufferSlot("f32[8,16]{1,0}", 0, 1024, 512)
    assert slots["x"].allocation == 1
    assert hlo.shape_bytes("bf16", (4, 8)) == 64


def test_compiler_log_lines_go_to_the_compile_that_logged_them(capfd):
    def log(message):
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
        os.write(2, f"W{stamp}.000001 {threading.get_native_id()} x.cc:1] {message}\n".encode())

    with mc.capture_compiler_log():
        start = time.time() - 1
        log("Can't reduce memory use below 1GiB")
        mc.capture_compiler_log.claim(threading.get_native_id(), start, time.time() + 1)
        other = threading.Thread(target=log, args=("from another thread",))
        other.start()
        other.join()
        os.write(2, b"plain line\n")
    mine = mc.capture_compiler_log.lines_for(threading.get_native_id(), start, time.time())
    assert [str(line) for line in mine] == ["x.cc: Can't reduce memory use below 1GiB"]
    err = capfd.readouterr().err
    assert "from another thread" in err and "plain line" in err and "Can't reduce" not in err


_PROGRESS_DURING_CAPTURE = """
import os, sys
from remat_kit.memory import xla_compile as mc
path = sys.argv[1]
with mc.capture_compiler_log():
    print("progress line", file=sys.stderr)
    os.write(2, b"compiler line\\n")
    with open(path) as f:
        print("seen during capture:", repr(f.read()))
print("after:", repr(open(path).read()))
"""


def test_python_stderr_reaches_the_terminal_while_compiles_are_captured(tmp_path):
    """A progress line printed while fd 2 is captured is written at once, not when it ends."""
    import subprocess
    import sys

    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        out = subprocess.run(
            [sys.executable, "-c", _PROGRESS_DURING_CAPTURE, str(err)],
            stderr=f,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        ).stdout
    during, after = out.splitlines()
    assert "progress line" in during and "compiler line" not in during
    assert "progress line" in after and "compiler line" in after


# -- Textbook -------------------------------------------------------------------------------


def test_korthikanti_formula():
    s, b, h, a = 2048, 1, 2048, 16
    assert korthikanti_bytes(s, b, h, a, "no-remat") == s * b * h * 34 + 5 * a * s * s * b
    assert korthikanti_bytes(s, b, h, a, "save-dots-no-batch") == 34 * s * b * h
    assert korthikanti_bytes(s, b, h, a, "save-nothing") == 2 * s * b * h
    assert korthikanti_bytes(s, b, h, a, "save-nothing", itemsize=4) == 4 * s * b * h
    assert korthikanti_bytes(s, b, h, a, "minimal") is None


# -- GPU target (deviceless H100) -----------------------------------------------------------

_B, _S, _H = 1, 2048, 2048


def _gpu_config(**kw):
    """A scanned bf16 GPT-style model at d_model=2048 with few heads and a small vocabulary."""
    base = dict(
        vocab_size=512, d_model=_H, num_heads=8, d_ff=4096, num_layers=2, max_seq_len=_S,
        norm="rmsnorm", use_bias=False, qkv_bias=False, dtype="bfloat16", param_dtype="bfloat16",
    )  # fmt: skip
    return remat_kit.ModelConfig("gpu-test", **{**base, **kw})


_SGD = optax.sgd(1e-3)


@needs_cuda_plugin
def test_gpu_full_remat_keeps_2sbh_per_layer():
    program = remat_kit.preset(_gpu_config(), _B, _S, _SGD)
    (x,) = per_layer_activations(program, policies=["save-nothing"], target="h100-sxm")
    assert x.target == "h100-sxm"
    assert x.textbook_bytes == 2 * _S * _B * _H
    assert x.compiled_bytes == pytest.approx(2 * _S * _B * _H, rel=0.01)
    assert x.ratio == pytest.approx(1.0, rel=0.01)
    assert x.jaxpr_bytes == 2 * _S * _B * _H


@needs_cuda_plugin
def test_per_layer_takes_per_tag_specs_each_with_its_own_figures():
    """Two per-tag specs (both named ``custom``) get a row each, under their labels, with their
    own compiled bytes (keyed by name, the second's report stood for both; ``analyze
    --per-layer --policy query_proj=save`` failed: unknown policy 'custom')."""
    one, two = {"query_proj": "save"}, {"query_proj": "save", "out_proj": "save"}
    program = remat_kit.preset(_gpu_config(), _B, _S, _SGD)
    rows = per_layer_activations(program, policies=[one, two], target="h100-sxm")
    assert [x.policy for x in rows] == ["custom: query_proj=save",
                                        "custom: out_proj=save, query_proj=save"]  # fmt: skip
    sbh = 2 * _S * _B * _H  # one [b, s, d_model] bf16 tensor
    assert [x.jaxpr_bytes for x in rows] == [2 * sbh, 3 * sbh]
    for x in rows:
        assert x.compiled_bytes == pytest.approx(x.jaxpr_bytes, rel=0.01), x


@needs_cuda_plugin
def test_gpu_offload_reports_host_bytes_and_whether_it_helped():
    r = analyze_model(_gpu_config(), _B, _S, "offload-layer-inputs", "h100-sxm", optimizer=_SGD)
    assert r.platform == "cuda" and "deviceless" in r.backend
    assert r.host_bytes == 2 * _B * _S * _H * 2  # layers * b * s * d_model * bf16
    assert r.offloaded_bytes == r.host_bytes
    # Reported, not assumed: the device peak keeping the same tensors on device.
    assert r.peak_bytes_without_offload is not None
    did_not_help = any("offloading did not lower the device peak" in w for w in r.warnings)
    assert did_not_help == (r.peak_bytes >= r.peak_bytes_without_offload)
    cpu = analyze_model("tiny-gpt", 1, 8, "offload-layer-inputs", "cpu", optimizer=_SGD)
    assert cpu.host_bytes == 0 and cpu.peak_bytes_without_offload is None  # not real on CPU


@needs_cuda_plugin
def test_gpu_config_far_too_large_does_not_fit():
    big = _gpu_config(vocab_size=128256)
    r = analyze_model(big, 32, _S, "save-nothing", target="l4", optimizer=_SGD)
    assert r.target == "l4" and r.memory_bytes == targets.get_target("l4").memory_bytes
    assert r.fits is False and r.peak_bytes > r.memory_bytes
    assert r.logits.f32_bytes == 32 * _S * 128256 * 4  # the logits alone exceed the L4


def test_unknown_memory_figures_are_none_and_a_missing_dump_says_so():
    from types import SimpleNamespace

    from remat_kit.memory import hlo, reading

    class Compiled:
        def __init__(self, analysis):
            self.analysis = analysis

        def memory_analysis(self):
            return self.analysis

    partial = SimpleNamespace(
        argument_size_in_bytes=10, output_size_in_bytes=-1, temp_size_in_bytes=None,
        alias_size_in_bytes=0,
    )  # fmt: skip
    parts = reading.memory_parts(Compiled(partial), unknown_as_none=True)
    assert parts["argument_bytes"] == 10
    assert parts["output_bytes"] is None and parts["temp_bytes"] is None
    assert reading.peak_bytes_of(parts) is None  # never a figure that "fits"
    assert reading.unknown_memory_fields(Compiled(partial)) == [
        "output_size_in_bytes", "temp_size_in_bytes",
    ]  # fmt: skip
    assert len(reading.unknown_memory_fields(Compiled(None))) == 4
    reading_ = reading.read_dump(hlo.DumpFiles(None, None, None, None), 5, reading.Hints())
    assert reading_.flops is None and reading_.peak_buffers == ()
    assert reading_.warnings[0].startswith("XLA wrote no dump of this compile")


def test_no_dump_warning_names_the_users_dump_flags(monkeypatch):
    """A compile that left no dump is said with the --xla_dump* flags of XLA_FLAGS, the likely
    cause (it blamed JAX's persistent compilation cache, which the analysis never reads)."""
    from remat_kit.memory import hlo, reading

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true --xla_dump_hlo_module_re=x")
    (line,) = reading.read_dump(hlo.DumpFiles(None, None, None, None), 5, reading.Hints()).warnings
    assert "XLA_FLAGS sets --xla_dump_hlo_module_re=x, which" in line and "thunk" not in line
    assert "cache" not in line


#: A tiny scanned step analysed in a fresh process (XLA_FLAGS is read when the backend starts).
_ANALYZE_UNDER_FLAGS = """
import jax, jax.numpy as jnp, remat_kit

def loss(w, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0].sum()

r = remat_kit.analyze(jax.grad(loss), jnp.ones((2, 16, 16)), jnp.ones((4, 16)), target="cpu")
print(r.flops, len(r.peak_buffers), any(b.op_name for b in r.peak_buffers))
print(r.warnings)
"""


def test_the_users_xla_dump_flags_leave_the_analysis_whole(tmp_path):
    """MaxText's pyconfig sets XLA_FLAGS to dump only its own train step into a folder of its
    own: the analysis compiles' dumps were filtered out (FLOPs None, no buffers at the peak).
    The analysis overrides the dump flags for its own compiles (xla_compile.DUMP_OPTIONS)."""
    import subprocess
    import sys

    flags = (
        f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=jit_train_step "
        "--xla_dump_max_hlo_modules=0 --xla_dump_disable_metadata=true"
    )
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}"}
    run = subprocess.run(
        [sys.executable, "-c", _ANALYZE_UNDER_FLAGS], env=env, capture_output=True, text=True,
        timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    flops, buffers, named = run.stdout.splitlines()[0].split()
    assert float(flops) == 2 * (2 * 4 * 16 * 16) * 3  # 2 layers: forward + 2 backward matmuls
    assert int(buffers) > 0 and named == "True", run.stdout
    assert "no dump" not in run.stdout


@pytest.mark.parametrize("analysis", ["none", "minus_one"])
def test_unknown_memory_figures_are_none_never_fits(monkeypatch, analysis, fresh_compile_cache):
    """jax#18954 / #12848: memory_analysis() is None or has -1 fields on some backends. The
    report then has peak None, fits None and a warning naming the unknown fields, never 0."""
    import jax.stages

    real = jax.stages.Compiled.memory_analysis

    def fake(self):
        if analysis == "none":
            return None
        m = real(self)
        m.temp_size_in_bytes = -1
        return m

    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", fake)
    r = remat_kit.analyze(
        lambda x: jnp.sin(x) @ x, jnp.ones((8, 8)), target="cpu", budget_bytes=2**30
    )
    assert r.peak_bytes is None and r.fits is None
    assert any("unknown" in w and "temp" in w for w in r.warnings), r.warnings
