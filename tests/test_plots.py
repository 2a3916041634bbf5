"""The sweep's figures tell the truth per target: host bytes are drawn only where the compiled
program put bytes in host memory (the committed CPU sweep's offload rows keep them on device)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

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
    others = ("params", "opt_state", "gradients / other", "untagged")
    tagged = sum(v[i] for k, v in bars.items() if k not in others)
    residuals = offload["report"]["residuals"]
    kept = sum(x["nbytes"] for x in residuals if x["memory"] in ("device", "host"))
    assert "mlpwi" in bars and bars["mlpwi"][i] > 0  # an offloaded tag, drawn on the device
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
    assert bars.get("mlpwi", [0] * len(rows))[i] == 0  # on the host, not on the device bar
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
