"""The sweep's figures tell the truth per target: host bytes are drawn only where the compiled
program put bytes in host memory (the committed CPU sweep's offload rows keep them on device)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from remat_kit import plots  # noqa: E402
from remat_kit.sweep import results  # noqa: E402

ROWS = Path(__file__).resolve().parents[1] / "experiments" / "results" / "cpu" / "sweep.jsonl"


def _rows(policy: str, seq: int) -> list[dict]:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    return [
        r
        for r in rows
        if r["status"] == "ok" and r["target"] == "local" and r["seq_len"] == seq
        and r["policy"] in ("no-remat", policy)
    ]  # fmt: skip


def _bars(fig) -> dict[str, list[float]]:
    (ax, *_) = fig.axes
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_cpu_offload_is_drawn_on_the_device_not_as_host_bars():
    rows = _rows("offload-to-host", 128)
    offload = next(r for r in rows if r["policy"] == "offload-to-host")
    assert offload["host_bytes"] == 0  # the CPU ignores the offload
    assert results.offload_stayed_on_device(offload)
    bars = _bars(plots.memory_breakdown(rows))
    assert "host (compiled)" not in bars
    # the tags the policy offloads are stacked on the device bar of offload-to-host, with the
    # tags it keeps (rows written before 2026-12-03 marked them "host" with offloaded_bytes;
    # the analyzer now counts them as device memory on a target that does not offload)
    i = [r["policy"] for r in rows].index("offload-to-host")
    unit, _ = plots.units.table_unit([r["peak_bytes"] for r in rows])
    others = ("params", "opt_state", "gradients / other", plots.UNTAGGED)
    tagged = sum(v[i] for k, v in bars.items() if k not in others)
    residuals = offload["report"]["residuals"]
    kept = sum(x["nbytes"] for x in residuals if x["memory"] in ("device", "host"))
    assert bars["residual mlpwi"][i] > 0  # an offloaded tag, drawn on the device
    assert abs(tagged - kept / unit) < 1e-6


def test_host_bytes_of_a_compiled_offload_are_a_host_bar():
    """A row from a target that offloads: its offloaded residuals marked host, its compiled
    program's host bytes a hatched bar beside the device bar, not stacked on it."""
    rows = copy.deepcopy(_rows("offload-to-host", 128))
    offload = next(r for r in rows if r["policy"] == "offload-to-host")
    moved = {"mlpwi", "key_proj", "out_proj"}
    for x in offload["report"]["residuals"]:
        if x["tag"] in moved:
            x["memory"] = "host"
    host = [x["nbytes"] for x in offload["report"]["residuals"] if x["memory"] == "host"]
    assert host, offload["report"]["residuals"]
    offload["offloaded_bytes"] = sum(host)
    offload["host_bytes"] = sum(host) // 2  # as a target that offloads gives
    assert not results.offload_stayed_on_device(offload)
    bars = _bars(plots.memory_breakdown(rows))
    unit, _ = plots.units.table_unit([r["peak_bytes"] for r in rows])
    i = [r["policy"] for r in rows].index("offload-to-host")
    assert bars.get("residual mlpwi", [0] * len(rows))[i] == 0  # on the host, not the device
    assert abs(bars["host (compiled)"][i] - offload["host_bytes"] / unit) < 1e-6


def test_labels_of_points_a_few_pixels_apart_do_not_overlap():
    """The sweep's figures wrote policy names on top of each other where policies measured
    alike (a newcomer's slowdown_vs_flops.png); label_points nudges them apart by whole lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    from remat_kit.plots import label_points

    fig = Figure(figsize=(5, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = ["save-nothing", "offload-layer-inputs", "save-layer-inputs", "minimal", "save-dots"]
    points = [(1.2, -30 + 0.05 * i, n) for i, n in enumerate(names)] + [(1.0, 0.0, "no-remat")]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    ax.set_xlim(0.9, 1.4)
    ax.set_ylim(-60, 20)
    label_points(ax, points)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text, not its line
    assert sorted(t.get_text() for t in ax.texts) == sorted(p[2] for p in points)
    overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)]
    assert overlaps == [], overlaps


# -- Every figure save_figures writes, read as a newcomer reads it ------------------------------


def _captured(rows, folder, monkeypatch) -> dict[str, object]:
    """``save_figures(rows, folder)``'s figures by file name (each figure as saved)."""
    figures: dict[str, object] = {}
    save = plots._save

    def keep(fig, path, *args, **kwargs):
        if path is not None:
            figures[Path(path).name] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(plots, "_save", keep)
    written = plots.save_figures(rows, folder)
    assert sorted(p.name for p in written) == sorted(figures)
    return figures


def _read_texts(fig) -> list[tuple[object, object]]:
    """Every text a reader reads, as drawn, with a group: the title, panel titles, axis and
    tick labels, the labels written on the panels, legends, the footnote. The tick labels of
    one axis share a group (rotated ones' boxes overlap where their letters do not)."""
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    texts = [(t, None) for t in (fig._suptitle, *fig.texts)]
    for legend in fig.legends:
        texts += [(t, None) for t in (legend.get_title(), *legend.get_texts())]
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        own = [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        own += ax.texts + (ax.get_legend().get_texts() if ax.get_legend() else [])
        texts += [(t, None) for t in own]
        for axis, labels, (lo, hi), k in ((ax.xaxis, ax.get_xticklabels(), ax.get_xlim(), 0),
                                          (ax.yaxis, ax.get_yticklabels(), ax.get_ylim(), 1)):  # fmt: skip
            lo, hi = min(lo, hi), max(lo, hi)
            texts += [(t, axis) for t in labels if lo <= t.get_position()[k] <= hi]  # drawn
    unique = {id(t): (t, g) for t, g in texts if isinstance(t, Text)}.values()
    return [(t, g) for t, g in unique if t.get_visible() and t.get_text().strip()]


def _overlapping_texts(fig) -> list[tuple[str, str]]:
    texts = _read_texts(fig)
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t, _ in texts]  # not a label's line
    return [
        (texts[i][0].get_text(), texts[j][0].get_text())
        for i, a in enumerate(boxes)
        for j, b in enumerate(boxes[i + 1 :], start=i + 1)
        if (texts[i][1] is None or texts[i][1] is not texts[j][1])
        and a.x0 + 0.5 < b.x1
        and b.x0 + 0.5 < a.x1
        and a.y0 + 0.5 < b.y1
        and b.y0 + 0.5 < a.y1
    ]


def _lines_through_texts(fig) -> list[tuple[str, str]]:
    """Labels whose line back to their point passes through another text of the panel."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        boxes = [(t, Text.get_window_extent(t, renderer).shrunk(0.9, 0.8)) for t in ax.texts]
        for t, own in boxes:
            if getattr(t, "arrow_patch", None) is None:
                continue
            (xa, ya), (xb, yb) = ax.transData.transform(t.xy), own.get_points().mean(axis=0)
            steps = [(xa + (xb - xa) * i / 40, ya + (yb - ya) * i / 40) for i in range(41)]
            out += [(t.get_text(), o.get_text()) for o, box in boxes
                    if o is not t and any(box.contains(x, y) for x, y in steps)]  # fmt: skip
    return out


def _read_as_a_newcomer(name: str, fig) -> None:
    assert fig.get_suptitle().strip(), f"{name}: no title"
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert len(legends) == 1, f"{name}: {len(legends)} legends, want one"
    assert _overlapping_texts(fig) == [], f"{name}: texts drawn on top of each other"
    assert _lines_through_texts(fig) == [], f"{name}: a label's line crosses another label"


def _synthetic_rows() -> list[dict]:
    """The committed CPU rows' measured s=256 group, two of its points made noisy; a GPU
    analysis group (llama3.2-1b on an A100 40GB: no-remat at 109 GiB does not fit) whose rows
    give no ``memory_bytes`` (the target's is used); and an option set on that target."""
    rows = [r for r in results.read_rows(ROWS) if r["status"] == "ok"]
    measured = [copy.deepcopy(r) for r in rows if r["target"] == "local" and r["seq_len"] == 256]
    for r in measured:
        r["step_times_s"] = [0.98 * r["step_time_s"], r["step_time_s"], 1.02 * r["step_time_s"]]
    for r in measured[3:5]:
        r["step_times_s"] = [0.7 * r["step_time_s"], r["step_time_s"], 1.3 * r["step_time_s"]]
    gpu = [copy.deepcopy(r) for r in rows if r["model"] == "llama3.2-1b"]
    for r in gpu:
        r.update(target="a100-40gb", memory_bytes=None)
    layers = copy.deepcopy(gpu[-1])
    layers["overrides"] = {**layers["overrides"], "remat_layers": 2}
    layers["peak_bytes"] = int(0.6 * layers["peak_bytes"])
    return measured + gpu + [layers]


def test_every_figure_reads_without_overlaps_on_the_committed_rows(tmp_path, monkeypatch):
    rows = results.read_rows(ROWS)
    figures = _captured(rows, tmp_path, monkeypatch)
    assert set(figures) == {
        "pareto.png", "pareto_analysis.png", "slowdown_vs_flops.png", "memory_breakdown.png",
    }  # fmt: skip
    for name, fig in figures.items():
        _read_as_a_newcomer(name, fig)
    # no-remat is the baseline of every sequence length: labelled once per panel
    slow = figures["slowdown_vs_flops.png"]
    for ax in slow.axes:
        names = [t.get_text() for t in ax.texts]
        assert names.count("no-remat (baseline)") == 1 and "no-remat" not in names
    # each footnote names the targets of its own rows only
    stamp = figures["pareto.png"].texts[-1].get_text()
    assert "target: local" in stamp and "h100-sxm" not in stamp, stamp
    stamp = figures["pareto_analysis.png"].texts[-1].get_text()
    assert "h100-sxm" in stamp and "local" not in stamp, stamp
    # the untagged residuals are named in the legend itself
    (legend,) = figures["memory_breakdown.png"].legends
    assert plots.UNTAGGED in [t.get_text() for t in legend.get_texts()]
    # H100 memory (79 GiB): a line where no-remat (109 and 243.5 GiB) does not fit
    lines = [ln for ax in figures["pareto_analysis.png"].axes for ln in ax.get_lines()
             if "h100-sxm device memory" in ln.get_label()]  # fmt: skip
    assert len(lines) == 2


def test_every_figure_reads_without_overlaps_on_gpu_and_noisy_rows(tmp_path, monkeypatch):
    rows = _synthetic_rows()
    figures = _captured(rows, tmp_path, monkeypatch)
    assert "options.png" in figures and "pareto_analysis.png" in figures
    for name, fig in figures.items():
        _read_as_a_newcomer(name, fig)
    (legend,) = figures["pareto_analysis.png"].legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert any(t.startswith("a100-40gb device memory") for t in texts), texts
    (legend,) = figures["pareto.png"].legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert "noisy timing (steps spread beyond ±10%): not on the frontier" in texts
    assert plots.STEP_RANGE in texts
    # the noisy points are hollow, and off the frontier
    (ax,) = figures["pareto.png"].axes
    points = [c for c in ax.collections if isinstance(c, PathCollection)]
    hollow = [c for c in points if not len(c.get_facecolors()) or c.get_facecolors()[0][3] == 0]
    assert len(hollow) == 2
    (frontier,) = [ln for ln in ax.get_lines() if ln.get_label() == "Pareto frontier"]
    noisy = {round(1e3 * r["step_time_s"], 6) for r in rows[3:5]}
    assert not noisy & {round(x, 6) for x in frontier.get_xdata()}


def test_long_per_tag_labels_fit_the_figure():
    """A user's program sweep names its per-tag specs ``custom: a=save, b=save, ...``: the legend
    and the bar labels use those names, broken into lines, and the legend stays inside the
    figure (a one-column legend wider than the figure cut its labels off both sides)."""
    rows = copy.deepcopy(_rows("save-nothing", 128))
    tags = ["attn_probs", "decoder_layer_input", "key_proj", "mlpwi", "out_proj", "query_proj"]
    rows[1]["policy"] = ",".join(f"{t}=save" for t in tags)
    rows[1]["policy_label"] = "custom: " + ", ".join(f"{t}=save" for t in tags)
    for draw in (plots.pareto, plots.memory_breakdown):
        fig = draw(rows, x="predicted_step_time_s") if draw is plots.pareto else draw(rows)
        renderer = FigureCanvasAgg(fig).get_renderer()
        texts = [t.get_text() for t in fig.findobj(Text)]
        assert "custom: attn_probs=save,\ndecoder_layer_input=save," in "\n".join(texts)
        for legend in fig.legends:
            box, frame = legend.get_window_extent(renderer), fig.bbox
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1, (draw.__name__, box, frame)
