"""TPU slices as targets: names and topologies, compiles through libtpu on this CPU machine, and
the TPU compiler's own figures (peak, host offload, loop trip counts).

The compiling tests need libtpu (``pip install 'remat-kit[tpu]'``) and skip without it; the
registry tests run everywhere. One tiny compile in all (a TPU compile costs seconds).
"""

from __future__ import annotations

import argparse

import jax
import pytest

import remat_kit
from remat_kit import cli, targets
from remat_kit.memory import analyze_policies, hlo
from remat_kit.memory.reading import compiled_peak_bytes
from remat_kit.pure import leaf_bytes

needs_libtpu = pytest.mark.skipif(
    not targets.libtpu_installed(),
    reason="libtpu (XLA's TPU compiler) is not installed: pip install 'remat-kit[tpu]'",
)


# -- Names, topologies, figures (no libtpu needed) --------------------------------------------


@pytest.mark.parametrize(
    ("name", "topology", "chips", "config", "wrap"),
    [  # MaxText accelerator_to_spec_map.py
        ("v4-8", "v4:2x2x1", 4, "megacore", (False, False, False)),
        ("v5p-128", "v5:4x4x4", 64, "megacore", (True, True, True)),
        ("v5litepod-16", "v5e:4x4", 16, "default", (False, False, False)),
        ("v6e-128", "v6e:8x16", 128, "default", (False, True, False)),
        ("v6e-256", "v6e:16x16", 256, "default", (True, True, False)),
        ("v6e-1", "v6e:1x1", 1, "default", (False, False, False)),
    ],
)
def test_slices_map_to_maxtexts_topologies(name, topology, chips, config, wrap):
    t = targets.get_target(name)
    assert (t.tpu.topology, t.tpu.chips, t.tpu.chip_config, t.tpu.wrap) == (
        topology,
        chips,
        config,
        wrap,
    )
    assert t.platform == "tpu" and t.deviceless and t.supports_host_offload
    assert t.num_devices == chips and t.memory_bytes > 15 * 2**30
    assert t.peak_flops_bf16 >= 197e12 and t.peak_flops_f32 == t.peak_flops_bf16
    assert t.hbm_bytes_per_s >= 800e9 and "cloud.google.com/tpu/docs" in t.source
    assert t.launch_s is None


def test_names_aliases_and_multislice():
    assert targets.get_target("V5LITEPOD-4").name == "v5e-4"
    two = targets.get_target("2xv5p-8")
    assert (two.name, two.tpu.num_slices, two.num_devices) == ("2xv5p-8", 2, 8)
    assert "2 slices of 4 chips" in two.description
    assert set(targets.slice_names()) <= set(targets.target_names())


def test_slices_flag_names_a_multislice_target():
    from remat_kit.cli.args import resolve_slices

    args = cli.build_parser().parse_args(
        ["analyze", "--model", "tiny-gpt", "--target", "v5p-8", "--slices", "2"]
    )
    resolve_slices(args)
    assert args.target == "2xv5p-8"
    assert targets.get_target(args.target).num_devices == 8


def test_unknown_slice_is_one_line_naming_valid_sizes(capsys):
    with pytest.raises(ValueError) as err:
        targets.get_target("v5p-6")
    message = str(err.value)
    assert "\n" not in message and "'v5p-6'" in message and "8, 16, 32" in message
    with pytest.raises(ValueError, match=r"^unknown target 'tpu-v7'; valid: .*v6e-N \(e\.g\."):
        targets.get_target("tpu-v7")  # an unknown name: the generations, not every size
    assert cli.main(["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "8",
                     "--target", "v6e-3"]) == 2  # fmt: skip
    assert cli.main(["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "8",
                     "--target", "h100-sxm", "--slices", "2"]) == 2  # fmt: skip
    err_text = capsys.readouterr().err
    assert "v6e-3" in err_text and "--slices applies to TPU slices" in err_text


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (479.30G) exceeds available HBM (95.74G).",
         "479.30G of HLO temporaries against 95.74G of HBM"),
        ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
         "hbm. Used 172.82G of 95.74G hbm. Exceeded hbm capacity by 77.08G.",
         "172.82G against 95.74G of HBM"),
        ("RESOURCE_EXHAUSTED: out of memory", "XLA gave no figure"),
        ("INTERNAL: Couldn't find output tile sizes", None),
    ],
)  # fmt: skip
def test_a_refusal_over_memory_is_told_from_a_failure_with_xlas_figures(message, said):
    """analyze makes a refused step a row that does not fit (not an error) from this."""
    from remat_kit.memory import CompileError

    err = CompileError("policy 'no-remat' on target 'v5p-8'", message)
    assert err.out_of_memory is (said is not None)
    assert err.over_memory() == said


def test_missing_libtpu_names_the_extra(monkeypatch):
    monkeypatch.setattr(targets, "libtpu_installed", lambda: False)
    targets.topology.cache_clear()
    try:
        with pytest.raises(targets.LibtpuMissingError, match=r"pip install 'remat-kit\[tpu\]'"):
            targets.compile_devices("v5e-4", 4)
    finally:
        targets.topology.cache_clear()


def test_trip_count_inferred_from_a_tpu_loop_condition():
    # The form XLA's TPU compiler writes (no known_trip_count; first iteration peeled: the
    # counter starts at 1), cut down from a real dump.
    text = """HloModule m

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %d = f32[8,8]{1,0:T(8,128)} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,8]{1,0:T(8,128)}) tuple(%i, %d)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %constant.9 = s32[]{:T(128)} constant(4)
  %q = (s32[], f32[8,8]{1,0:T(8,128)}) parameter(0)
  %g = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %constant.9), direction=LT
}

ENTRY %main (a: f32[8,8]) -> (s32[], f32[8,8]) {
  %a = f32[8,8]{1,0:T(8,128)} parameter(0)
  %constant.1 = s32[]{:T(128)} constant(1)
  %copy.1 = s32[]{:T(128)} copy(%constant.1)
  %tuple.1 = (s32[], f32[8,8]{1,0:T(8,128)}) tuple(%copy.1, %a)
  ROOT %while.1 = (s32[], f32[8,8]{1,0:T(8,128)}) while(%tuple.1), condition=%cond, body=%body
}
"""
    count = hlo.count_flops(hlo.parse_hlo_module(text))
    assert count.unknown_trip_counts == 0
    assert count.flops == 3 * 2 * 8 * 8 * 8  # 3 trips (4 - 1) of one [8,8] @ [8,8] dot


def test_tpu_dot_written_as_padded_convolution_counts_its_real_work():
    # query_proj of tiny-llama as XLA's TPU compiler wrote it: [b, s, d, 1] x [d, heads, hd, 1]
    # -> [b, s, heads, hd], the heads a window of 4 sliding over a padded dimension of size 1.
    shapes = {"x": "f32[4,64,16,1]{3,2,1,0}", "w": "bf16[16,4,16,1]{3,2,1,0}"}
    conv = hlo.Instruction(
        name="convolution.1", shape="f32[4,64,4,16]{1,3,2,0:T(8,128)S(1)}",
        opcode="convolution", operands=("x", "w"),
        attributes=", window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f",
        op_name="attn/query_proj/dot_general",
    )  # fmt: skip
    assert hlo.instruction_flops(conv, shapes) == 2 * 4 * 64 * 4 * 16 * 16  # b s heads hd d
    unpadded = hlo.Instruction(
        name="convolution.2", shape="f32[4,64,16,1]", opcode="convolution", operands=("y", "v"),
        attributes=", window={size=1x4}, dim_labels=0b1f_1io0->0bf1", op_name="out_proj",
    )  # fmt: skip
    shapes |= {"y": "bf16[4,64,4,16]", "v": "bf16[4,16,16,1]"}
    assert hlo.instruction_flops(unpadded, shapes) == 2 * 4 * 64 * 16 * 4 * 16
    # Grouped-query attention scores (bqgrd,btgd->bgrqt) as the TPU compiler wrote them for
    # tiny-llama (batch 1 per chip, 64 tokens, 2 kv heads x 2 query groups, head_dim 16): the
    # query groups a window over a dilated dimension.
    scores = hlo.Instruction(
        name="convolution.3", shape="f32[2,64,64,2]", opcode="convolution", operands=("q", "k"),
        attributes=", window={size=2x2 pad=0_0x1_1 lhs_dilate=2x1 rhs_reversal=0x1}, "
        "dim_labels=b0f1_o01i->0bf1",
        op_name="attn/bqgrd,btgd->bgrqt/dot_general",
    )  # fmt: skip
    shapes |= {"q": "bf16[64,2,16,1]", "k": "bf16[64,2,2,16]"}
    assert hlo.instruction_flops(scores, shapes) == 2 * 64 * 2 * 2 * 64 * 16  # q g r t d


# -- Compiled through libtpu ------------------------------------------------------------------


@needs_libtpu
def test_topologies_give_the_slices_devices():
    v4 = targets.compile_devices("v4-8", 4)  # megacore: 4 chips, 4 JAX devices
    assert len(v4) == 4 and {d.device_kind for d in v4} == {"TPU v4"}
    two = targets.compile_devices("2xv5e-4", 8)
    assert {d.device_kind for d in two} == {"TPU v5 lite"}
    assert len({getattr(d, "slice_index", None) for d in two}) == 2
    assert len(targets.compile_devices("v6e-256", 256)) == 256
    with pytest.raises(ValueError, match="has 4 devices"):
        targets.compile_devices("v5p-8", 8)


@needs_libtpu
def test_tpu_compile_per_device_params_real_offload_and_xla_peak():
    """tiny-llama on a v5e-4 slice, fsdp=4, offloading each layer's input to the host."""
    (report,) = analyze_policies(
        remat_kit.preset("tiny-llama", 4, 64, mesh="fsdp=4"), ["offload-layer-inputs"],
        target="v5e-4",
        compare_offload=False, top_k=3,
        no_remat_baseline=False,  # per-device figures of the policy's own compile
    )  # fmt: skip
    assert report.platform == "tpu" and "XLA TPU compiler" in report.backend
    # Per-device parameters: every sharded leaf split 4 ways, the replicated ones whole.
    from remat_kit import targets as T
    from remat_kit.models import get_config
    from remat_kit.training.step import abstract_train_state, make_optimizer, sharded_train_state

    config = get_config("tiny-llama")
    total = leaf_bytes(abstract_train_state(config, make_optimizer("adamw")).params)
    mesh = T.make_mesh(T.parse_mesh("fsdp=4"), targets.compile_devices("v5e-4", 4))
    sharded, _ = sharded_train_state(config, make_optimizer("adamw"), mesh)
    whole = sum(
        leaf_bytes(x) for x in jax.tree.leaves(sharded.params) if x.sharding.is_fully_replicated
    )
    assert whole < total / 4  # most bytes are sharded
    assert (total - whole) % 4 == 0
    assert report.arguments["params"] == (total - whole) // 4 + whole
    # Host offload is real on TPU: XLA puts bytes in host memory (S(5)).
    assert report.host_bytes > 0 and report.offloaded_bytes > 0
    # The peak is XLA's own TPU figure (compiled_peak_bytes), arguments included.
    assert report.peak_bytes > report.argument_bytes
    assert report.fits is True and report.budget_bytes == targets.get_target("v5e-4").memory_bytes
    # Loop trip counts read from the TPU loop conditions: no loop counted once.
    assert not any("unknown trip count" in w for w in report.warnings)
    assert report.flops and report.flops_no_remat
    assert not any("compiled on 1 of" in w for w in report.warnings)  # sharded over the 4


@needs_libtpu
def test_a_program_on_one_chip_of_a_slice_and_the_assumed_per_op_cost_are_said():
    """A user's Program is placed on one device: on a 4-chip slice the report says its figures
    are one chip running the whole step (the outside trial read them as the slice's); the
    TPU per-op cost no page cites is called assumed in analyze's time line."""
    from remat_kit.cli.analyze import _summary_lines, _time_line
    from remat_kit.examples import plain_jax

    # no unseen no-remat compiles: the placement notes and time line are the policy's own
    kw = dict(no_remat_baseline=False)
    (report,) = analyze_policies(plain_jax.program(), ["save-nothing"], target="v5e-4", **kw)
    (note,) = [w for w in report.warnings if "compiled on 1 of" in w]
    assert "v5e-4's 4 devices" in note and "one chip running the whole step" in note
    line = _time_line([report])
    assumed = line.split("assumed, not cited: ")[1]
    assert "launch 1.0 us (assumed: no published per-op figure for TPUs)" in assumed
    assert "vector units assumed at 1/10 of the matmul peak" in assumed
    # the arguments' tile padding (XLA's argument bytes beyond their values) named, not a bare
    # "other" (s19 MaxText-style trial: "other 388.74 KiB" on v5e-1)
    assert report.arguments["other"] > 0
    args = argparse.Namespace(budget=None, mesh=None)
    summary = "\n".join(_summary_lines(targets.get_target("v5e-4"), args, [report], ["x"]))
    assert "(other: XLA's argument bytes beyond the arguments' values: on a TPU, the tiled" in (
        summary
    )
    (preset,) = analyze_policies(
        remat_kit.preset("tiny-gpt", 2, 32), ["save-nothing"], "v5e-4", **kw
    )
    assert any("--mesh / mesh= shards a preset" in w for w in preset.warnings)


def test_compiled_peak_reads_the_platforms_figure():
    class Stats:
        argument_size_in_bytes, output_size_in_bytes = 100, 50
        temp_size_in_bytes, alias_size_in_bytes = 0, 40
        peak_memory_in_bytes = 400

    class Compiled:
        def memory_analysis(self):
            return Stats()

    assert compiled_peak_bytes(Compiled(), "tpu") == 400
    assert compiled_peak_bytes(Compiled(), "cuda") == 110
    Stats.peak_memory_in_bytes = -1  # unknown: None, never 0
    assert compiled_peak_bytes(Compiled(), "tpu") is None


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "16", "--target", "h100-sxm",
          "--policy", "save-nothing"], "cuda12"),
        (["doctor", "--model", "tiny-gpt", "--target", "v5e-4"], "tpu"),
    ],
)  # fmt: skip
def test_a_missing_extra_is_one_line_and_exit_2_from_every_command(
    monkeypatch, capsys, argv, extra
):
    """A GPU model without JAX's CUDA plugin (or a TPU slice without libtpu) is an install the
    user fixes: one line naming the extra, exit 2, no traceback (the CUDA case was a
    RuntimeError traceback, exit 1)."""
    from remat_kit.cli import main

    monkeypatch.setenv("REMAT_KIT_NO_CACHE", "1")
    monkeypatch.setattr(targets, "cuda_plugin_module", lambda: None)
    monkeypatch.setattr(targets, "libtpu_installed", lambda: False)
    targets._cuda_topology.cache_clear()
    targets.topology.cache_clear()
    try:
        assert main(argv) == 2
    finally:
        targets._cuda_topology.cache_clear()
        targets.topology.cache_clear()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"pip install 'remat-kit[{extra}]'" in err


@needs_libtpu
def test_the_doctor_judges_freed_memory_on_a_tpu_by_the_peak_not_xlas_temp():
    """XLA:TPU's temp figure leaves out most temporaries: judged by it, the doctor warned
    "remat-not-lowering-peak" on every policy of a two-layer unrolled model whose peak remat
    lowered (analyze showed it). It judges by the peak less the arguments there."""
    from remat_kit import doctor

    config = remat_kit.get_config("tiny-llama", scan_layers=False, num_layers=2)
    program = remat_kit.preset(config, 4, 64)
    (no_remat, save_nothing) = analyze_policies(program, ["no-remat", "save-nothing"], "v5e-1")
    assert save_nothing.peak_bytes < no_remat.peak_bytes  # remat lowers the peak here
    (findings,) = doctor.check_policies(program, ["save-nothing"], "v5e-1")
    codes = {f.code for f in findings}
    assert not codes & {"remat-not-lowering-peak", "no-op-policy"}, [f.line() for f in findings]


def _toy_program():
    """Four tanh layers of one [256, 256] f32 weight over x [1024, 256], tagged 'hidden'."""
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    def make_loss(policy):
        def layer(x, w):
            return jnp.tanh(checkpoint_name(x @ w, "hidden"))

        body = layer if policy is None else jax.checkpoint(layer, policy=policy)

        def loss(w, x):
            for _ in range(4):
                x = body(x, w)
            return x.sum()

        return loss

    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    return remat_kit.Program.from_loss(make_loss, w, x, name="toy")


@needs_libtpu
def test_a_users_program_laid_out_over_the_chips_gives_per_chip_figures():
    """A user's program on a multi-chip slice was compiled on one chip, unsharded, with no way
    to say otherwise (issue 53): a layout puts it on a mesh of the slice's chips, its batch
    split over them, and every figure is per chip."""
    import dataclasses

    from jax.sharding import PartitionSpec as P

    prog = _toy_program()
    policies = ["no-remat", "save-nothing"]
    one = analyze_policies(prog, policies, "v5e-4")
    laid = dataclasses.replace(prog, layout=remat_kit.sharded({"dp": 4}, {"x": P("dp")}))
    four = analyze_policies(laid, policies, "v5e-4")
    assert all("compiled on 1 of v5e-4's 4 devices" in " ".join(r.warnings) for r in one)
    for a, b in zip(one, four, strict=True):
        assert not any("compiled on 1 of" in w for w in b.warnings), b.warnings
        # the activations ([1024, 256] per layer) split 4 ways; the weight replicated
        assert b.peak_bytes < a.peak_bytes / 2, (a.peak_bytes, b.peak_bytes)
    # x's arguments bytes per chip: a quarter of its 1 MiB
    assert four[0].argument_bytes < one[0].argument_bytes - 700 * 1024
    bad = dataclasses.replace(prog, layout=remat_kit.sharded({"dp": 4}, {"y": P("dp")}))
    with pytest.raises(ValueError, match=r"unknown argument of the step 'y'; valid: opt_state"):
        analyze_policies(bad, ["no-remat"], "v5e-4")
    with pytest.raises(ValueError, match="axes is empty"):
        remat_kit.sharded({})
