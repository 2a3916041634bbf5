"""The live-bytes timeline, the policy diff, and XLA's own rematerialisation told apart.

CPU tests compile tiny scanned models (remat survives on XLA:CPU only inside a scan); the GPU
test compiles tiny-llama deviceless for an H100 model with 4 MB of memory, so that XLA's own
rematerialisation pass fires and the pass-off compile runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit
from remat_kit import Program, plots, targets
from remat_kit.cli.args import add_timeline
from remat_kit.memory import MemoryReport, analyze_policies, hlo
from remat_kit.memory import timeline as T
from remat_kit.memory import xla_compile as X
from remat_kit.memory.diff import diff_reports
from remat_kit.policies import get_policy_spec, parse_policy_arg
from remat_kit.pure import argument_parts
from tests.conftest import needs_cuda_plugin


@pytest.fixture(scope="module")
def cpu_reports() -> dict[str, MemoryReport]:
    """tiny-llama, b=2, s=64, scanned, on the CPU."""
    reports = analyze_policies(
        remat_kit.preset("tiny-llama", 2, 64), ["no-remat", "save-nothing"], target="cpu"
    )
    return {r.policy: r for r in reports}


@pytest.fixture(scope="module")
def scanned_dump() -> hlo.DumpFiles:
    """XLA's dumps of the gradient of a 4-layer scanned MLP under full remat (one compile)."""

    def loss(ws, x):
        def layer(h, w):
            return jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w), None

        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h**2)

    args = (jnp.zeros((4, 64, 64)), jnp.zeros((32, 64)))
    with X.capture_compiler_log():
        result = X.compile_with_dump(jax.jit(jax.grad(loss)).lower(*args), "cpu", "mlp")
    return result.dump


def test_timeline_maximum_is_the_reported_live_peak(cpu_reports):
    for r in cpu_reports.values():
        tl = r.timeline
        assert max(tl.totals()) == tl.peak_bytes == r.live_peak_bytes
        assert r.live_peak_bytes <= r.peak_bytes  # live bytes never exceed XLA's allocations
        assert tl.peak_position in tl.positions
        assert len(tl.positions) <= T.DEFAULT_MAX_POINTS
        assert sum(tl.at_peak().values()) == tl.peak_bytes


def test_timeline_categories_and_phases(cpu_reports):
    r = cpu_reports["save-nothing"]
    tl = r.timeline
    assert [p for p, _, _ in tl.phases] == ["forward", "backward", "optimizer"]
    assert tl.phases[0][1] == 0 and tl.phases[-1][2] == tl.length
    assert all(a[2] == b[1] for a, b in zip(tl.phases, tl.phases[1:], strict=False))
    peak = tl.at_peak()
    # The donated train state is live throughout: the parameters and AdamW state at the peak
    # are exactly the arguments.
    assert peak["params"] == r.arguments["params"]
    assert peak["opt_state"] == r.arguments["opt_state"]
    # Full remat saves each layer's input, stacked over the 4 layers: [4, b, s, d] float32.
    residual = dict(zip(tl.categories, tl.device_bytes, strict=True))
    assert max(residual["residual:decoder_layer_input"]) == 4 * 2 * 64 * 64 * 4


def test_residuals_shrink_under_remat(cpu_reports):
    def most_residual(r):
        rows = [row for c, row in zip(r.timeline.categories, r.timeline.device_bytes, strict=True)
                if c.startswith("residual:")]  # fmt: skip
        return max(sum(col) for col in zip(*rows, strict=True))

    assert most_residual(cpu_reports["save-nothing"]) < most_residual(cpu_reports["no-remat"]) / 4


def test_report_with_timeline_round_trips_through_json(cpu_reports):
    r = cpu_reports["save-nothing"]
    assert MemoryReport.from_json(r.to_json()) == r


def test_timeline_at_xlas_peak_moment_matches_its_listing(scanned_dump):
    """At the moment XLA itself prints as its peak, the timeline's bytes are the values XLA
    lists there, each slot (aliases) once; the timeline's own maximum is at least that."""
    tl = T.build_timeline(scanned_dump, max_points=10**6)
    moment = int(re.search(r"Live ranges at (\d+)", scanned_dump.live_range).group(1))
    slots = hlo.parse_buffer_slots(scanned_dump.buffer_assignment)
    listed: dict[object, int] = {}
    for buf in hlo.parse_live_at_peak(scanned_dump.live_range):
        slot = slots.get(buf.value)
        key = (slot.allocation, slot.offset) if slot else buf.value
        listed[key] = max(listed.get(key, 0), buf.nbytes)
    assert tl.positions == tuple(range(tl.length))
    assert tl.totals()[moment] == sum(listed.values())
    assert tl.peak_bytes >= sum(listed.values())


def test_thinning_keeps_the_peak(scanned_dump):
    full = T.build_timeline(scanned_dump, max_points=10**6)
    thin = T.build_timeline(scanned_dump, max_points=7)
    assert len(thin.positions) <= 7
    assert thin.peak_position in thin.positions and max(thin.totals()) == full.peak_bytes


def test_live_at_peak_sums_to_the_timeline_peak(scanned_dump):
    live = T.live_at_peak(scanned_dump)
    slots = hlo.parse_buffer_slots(scanned_dump.buffer_assignment)
    by_slot: dict[object, int] = {}
    for buf in live:
        slot = slots[buf.value]
        key = (slot.allocation, slot.offset)
        by_slot[key] = max(by_slot.get(key, 0), buf.nbytes)
    assert sum(by_slot.values()) == T.build_timeline(scanned_dump).peak_bytes


def test_spans_say_what_is_live_at_each_point(scanned_dump):
    """The buffers kept with their live ranges: largest first, within the schedule; at the
    peak they are the peak's largest buffers and never sum above the peak; an older report's
    timeline (no spans in its JSON) still reads."""
    tl = T.build_timeline(scanned_dump)
    spans = tl.spans
    assert spans and len(spans) <= T.MAX_SPANS
    assert [s.nbytes for s in spans] == sorted((s.nbytes for s in spans), reverse=True)
    assert all(0 <= s.start <= s.end < tl.length for s in spans)
    assert min(s.nbytes for s in spans) >= T.SPAN_FRACTION * tl.peak_bytes
    at_peak = tl.live_at(tl.peak_position)
    assert sum(s.nbytes for s in at_peak) <= tl.peak_bytes
    assert {s.value for s in at_peak} >= {
        b.value for b in tl.peak_buffers if b.nbytes >= T.SPAN_FRACTION * tl.peak_bytes
    }
    old = dataclasses.asdict(tl)
    del old["spans"]
    assert T.Timeline.from_dict(old).spans == ()


def test_no_dump_no_timeline():
    assert T.build_timeline(hlo.DumpFiles(None, None, None, None)) is None
    assert T.live_at_peak(hlo.DumpFiles(None, None, None, None)) is None


def test_cpu_pass_does_not_fire(cpu_reports):
    for r in cpu_reports.values():
        assert r.policy_only is None
        assert r.recompute_ratio == r.compiled_recompute_ratio


def test_diff_of_two_policies(cpu_reports):
    d = diff_reports(cpu_reports["no-remat"], cpu_reports["save-nothing"])
    rows = {row.name: row for row in d.figures}
    assert rows["peak (as run)"].change < 0  # full remat lowers the peak
    assert rows["recompute ratio (policy's own)"].change > 0.1
    assert any(row.name.startswith("decoder_layer_input") for row in d.residuals)
    assert d.peak_buffers[0] and d.peak_buffers[1]
    text = d.to_text()
    assert "no-remat" in text and "save-nothing" in text and "largest buffers" in text
    other = dataclasses.replace(cpu_reports["no-remat"], target="h100-sxm")
    with pytest.raises(ValueError, match="same step and target"):
        diff_reports(other, cpu_reports["save-nothing"])


def test_timeline_figure(cpu_reports, tmp_path):
    fig = plots.timeline(list(cpu_reports.values()), tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 2
    with pytest.raises(ValueError, match="no report with a timeline"):
        plots.timeline([dataclasses.replace(cpu_reports["no-remat"], timeline=None)])


@needs_cuda_plugin
def test_xla_remat_told_apart_deviceless():
    """An H100 with 4 MB: XLA's pass fires; the policy's own FLOPs read from the one compile
    (XLA's clones told apart) are those of the step compiled with the pass off, which is made
    only for the peak of the policy alone; the timeline's maximum is the live peak on the GPU
    backend too."""
    small = dataclasses.replace(
        targets.get_target("h100-sxm"), name="h100-4mb", memory_bytes=4_000_000
    )
    program = remat_kit.preset("tiny-llama", 2, 128, "sgd")
    # no unseen no-remat compile: what is checked is the policy's own compile (and the one with
    # the pass off), not whether it frees memory against no-remat
    kw = dict(target=small, no_remat_baseline=False)
    (r,) = analyze_policies(program, ["save-nothing"], **kw)
    (off,) = analyze_policies(program, ["save-nothing"], policy_alone_peak=True, **kw)
    assert max(r.timeline.totals()) == r.live_peak_bytes
    po = r.policy_only
    assert po is not None and po.xla_remat_instructions > 0
    assert r.recompute_ratio == po.recompute_ratio < r.compiled_recompute_ratio
    assert 1.15 < po.recompute_ratio < 1.34  # one extra forward of the blocks, at most 4/3
    assert po.peak_bytes is None and po.compile_s is None  # no second compile unless asked
    assert off.policy_only.flops == po.flops and off.recompute_ratio == r.recompute_ratio
    assert off.policy_only.peak_bytes > 0 and off.policy_only.compile_s is not None
    assert off.peak_bytes == r.peak_bytes and off.flops == r.flops
    line = next(w for w in r.warnings if w.startswith("XLA's remat pass recomputed"))
    assert "the policy alone x1." in line, line
    assert "the policy alone peaking at" in next(
        w for w in off.warnings if w.startswith("XLA's remat pass recomputed")
    )


def test_timeline_cli_argument():
    parser = argparse.ArgumentParser()
    add_timeline(parser)
    assert parser.parse_args(["--timeline", "out.png"]).timeline == "out.png"
    assert parser.parse_args([]).timeline is None


def test_cli_analyze_writes_the_timeline_png(tmp_path, capsys):
    from remat_kit import cli

    png = tmp_path / "t.png"
    argv = ["analyze", "--model", "tiny-llama", "--batch", "1", "--seq", "16", "--target", "cpu",
            "--set", "scan_layers=true", "--policy", "save-nothing", "--policy", "no-remat",
            "--timeline", str(png), "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    import json

    reports = json.loads(capsys.readouterr().out)["reports"]
    assert all(r["timeline"]["peak_bytes"] == r["live_peak_bytes"] for r in reports)


def _proj_program() -> Program:
    """A user's scanned layers, ``proj`` [batch 32, 96] named on a matmul: under
    ``proj=save`` the residuals are ``proj`` stacked [4, 32, 96] and the untagged layer input
    [4, 32, 64]."""

    def layer(h, w):
        return h + jnp.tanh(checkpoint_name(h @ w, "proj")) @ w.T

    def make_loss(policy):
        f = layer if policy is None else jax.checkpoint(layer, policy=policy)

        def loss(ws, x):
            h, _ = jax.lax.scan(lambda c, w: (f(c, w), None), x, ws)
            return (h**2).mean()

        return loss

    return Program.from_loss(make_loss, jnp.zeros((4, 64, 96)), jnp.zeros((32, 64)),
                             optimizer="sgd", name="proj")  # fmt: skip


def test_program_residuals_are_named_by_its_own_checkpoint_names():
    """The compiled buffers of a program's residuals take its own tags (from the walker's rows
    of their shape), every untagged one is ``residual:untagged`` (never an op kind: mul...)."""
    specs = [parse_policy_arg("proj=save"), parse_policy_arg("save-nothing")]
    saved, nothing = analyze_policies(_proj_program(), specs, target="cpu")
    rows = dict(zip(saved.timeline.categories, saved.timeline.device_bytes, strict=True))
    assert max(rows["residual:proj"]) == 4 * 32 * 96 * 4
    for r in (saved, nothing):
        kinds = {c for c in r.timeline.categories if c.startswith("residual:")}
        assert kinds <= {"residual:proj", "residual:untagged", "residual:other"}, kinds
    assert "residual:proj" not in nothing.timeline.categories
    assert "residual:untagged" in nothing.timeline.categories


def test_timeline_figure_titles_and_budget_line(cpu_reports):
    """Panels titled as given; the y-axis scaled to the data, the budget drawn only when within
    2x of the panel's highest point, else stated in its title."""
    r = cpu_reports["save-nothing"]
    peak = r.timeline.peak_bytes
    far = dataclasses.replace(r, budget_bytes=100 * peak)
    near = dataclasses.replace(r, budget_bytes=peak * 3 // 2)
    fig = plots.timeline([far, near], titles=["custom: proj=save", "minimal (cut)"])
    ax_far, ax_near = [ax for ax in fig.axes if ax.get_visible()][:2]
    assert ax_far.get_title().startswith("custom: proj=save")
    assert "off scale" in ax_far.get_title() and "off scale" not in ax_near.get_title()
    unit = 2**20  # MiB: the data are a few MiB
    assert ax_far.get_ylim()[1] < 2 * peak / unit
    assert ax_near.get_ylim()[1] >= near.budget_bytes / unit
    assert any(line.get_ydata()[0] == near.budget_bytes / unit for line in ax_near.lines)
    assert not any(line.get_ydata()[0] == far.budget_bytes / unit for line in ax_far.lines)
    with pytest.raises(ValueError, match="titles"):
        plots.timeline([far, near], titles=["one"])


def test_a_user_programs_gradients_are_named_gradients():
    """A user's program names its parameters as its loss does (not ``state.params``): the
    timeline still tells its gradients from residuals by the parameters' shapes (an outside
    trial's nn.scan LM had 14 MiB of gradients filed as untagged residuals at the peak)."""
    from tests.user_models import plain_jax

    (r,) = analyze_policies(plain_jax.program(), ["save-nothing"], target="cpu")
    at_peak = r.timeline.at_peak()
    leaves = jax.tree.leaves(plain_jax.program().loss_args[0])
    params = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    assert at_peak.get("gradients", 0) >= params // 2
    assert at_peak.get("residual:untagged", 0) < params // 2
    # the arguments named as the loss names them (JAX's debug info read "loss_args[1]")
    assert "tokens" in at_peak and not any(c.startswith("loss_args") for c in at_peak)


def test_an_argument_xla_copies_aside_keeps_its_name():
    """XLA copies a donated argument aside when the output aliasing its buffer is written
    first (the plain-JAX step returns its parameters before its optimizer state, which it takes
    first): the copies of the second moments, shaped like the parameters, were filed as
    ``params`` and the timeline showed params and opt_state swapped (1.38 MiB vs 704 KiB)."""
    from tests.user_models import plain_jax

    program = plain_jax.program()
    (r,) = analyze_policies(program, ["save-nothing"], target="cpu")
    at_peak = r.timeline.at_peak()
    parts = argument_parts(program.step(get_policy_spec("save-nothing")), program.args)
    assert parts["params"] < parts["opt_state"]  # AdamW: two moments per parameter
    assert at_peak["params"] == parts["params"] and at_peak["opt_state"] == parts["opt_state"]


def test_a_buffer_shaped_like_a_parameter_and_a_stacked_residual():
    """A scan saves its weights' slices stacked, so a gradient can share a stacked residual's
    shape: made by the backward pass it is parameter-shaped (a gradient), made forward the
    residual."""
    from remat_kit.memory import reading

    shape = "f32[4,256,768]"
    hints = reading.Hints(stacked={shape: ("untagged",)}, param_shapes=frozenset({shape}))
    comp = hlo.Computation("body", False, [], {})

    def kind(op_name: str) -> str:
        instr = hlo.Instruction("fusion.4", shape, "fusion", [], "", op_name)
        return reading._kind_and_phase((instr, comp), "fusion.4", shape, hints)[0]

    assert kind("jit(step)/transpose(jvp(Decoder))/while/body/add_any") == "param_shaped"
    assert kind("jit(step)/jvp(Decoder)/while/body/dynamic_update_slice") == "stacked:untagged"
    # recomputed inside JAX's remat: the same shape is neither a saved stack nor a parameter
    remat = "jit(step)/transpose(jvp(Decoder))/while/body/checkpoint/rematted_computation"
    assert kind(f"{remat}/layers/mlp/gelu") == "other"
    assert kind(f"{remat}/layers/attn/softmax") == "attention"


def test_diff_flops_in_a_unit_that_shows_them():
    """A small model's FLOPs read 0.0 TFLOP in the diff; they take the prefix that shows them."""
    from remat_kit.memory.diff import _fmt

    assert _fmt(12.08e9, "flops") == "12.1 GFLOP"
    assert _fmt(7.4653e14, "flops") == "746.5 TFLOP"
    assert _fmt(512.0, "flops") == "512.0 FLOP"


def test_a_policy_keeping_fewer_residuals_yet_peaking_higher_is_explained():
    """A user's 2-layer model peaked lower under 'mlp_hidden=save' than under save-nothing,
    with nothing said (a peak is not the residuals alone); tiny-gpt b=4 s=64 does the same
    (save-out-proj 5.89 MiB, save-nothing 6.40 MiB: the logits live at save-nothing's peak).
    The note names the pair, the gap, where each peak falls and the categories that differ."""
    import types

    from remat_kit.memory.diff import peak_inversions
    from remat_kit.memory.timeline import Timeline

    cats = ("params", "residual:decoder_layer_input", "residual:out_proj", "logits", "gradients")
    phases = (("forward", 0, 10), ("backward", 10, 20))

    def report(peak_at, residuals, logits, kept):
        at_peak = (1000, residuals - kept, kept, logits, 300)
        tl = Timeline(length=20, positions=(peak_at,), categories=cats,
                      device_bytes=tuple((b,) for b in at_peak), host_bytes=None, phases=phases,
                      peak_bytes=sum(at_peak), peak_position=peak_at, peak_instruction="",
                      peak_buffers=())  # fmt: skip
        return types.SimpleNamespace(
            timeline=tl, activation_bytes=residuals, peak_bytes=sum(at_peak)
        )

    nothing = report(15, 256, 1024, 0)  # fewer residuals, the logits at its peak
    out_proj = report(5, 512, 0, 256)  # more residuals, its peak in the forward pass
    more = report(12, 2048, 0, 0)  # more residuals and a higher peak: no inversion
    lines = peak_inversions([nothing, out_proj, more], ["save-nothing", "save-out-proj", "big"])
    line = (
        "peaks 768 B above save-out-proj though it keeps 256 B fewer residuals (its in the "
        "backward, save-out-proj's in the forward): at the two peaks it holds logits +1.00 KiB, "
        "residuals -256 B against save-out-proj; a peak is everything live at one point of "
        "XLA's schedule"
    )
    assert lines == [f"save-nothing: {line}"]
    # one program under several names (the CPU compiles save-nothing and save-layer-inputs to
    # one): one line naming them, not the same sentence twice
    labels = ["save-nothing", "save-out-proj", "big", "save-layer-inputs"]
    assert peak_inversions([nothing, out_proj, more, nothing], labels) == [
        f"save-nothing, save-layer-inputs: {line}"
    ]
    assert peak_inversions([out_proj, more], ["a", "b"]) == []  # more kept, higher peak
    no_timeline = types.SimpleNamespace(timeline=None, activation_bytes=0, peak_bytes=10**9)
    assert peak_inversions([no_timeline, out_proj], ["x", "y"]) == []
    with pytest.raises(ValueError, match="2 reports but 1 labels"):
        peak_inversions([nothing, out_proj], ["one"])
