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
    assert offload["host_bytes"] == 0 and offload["offloaded_bytes"] > 0  # the CPU ignores it
    assert results.offload_stayed_on_device(offload)
    bars = _bars(plots.memory_breakdown(rows))
    assert "host (compiled)" not in bars
    # the offloaded tags are stacked on the device bar of offload-to-host, with the tags it keeps
    i = [r["policy"] for r in rows].index("offload-to-host")
    unit, _ = plots.units.table_unit([r["peak_bytes"] for r in rows])
    others = ("params", "opt_state", "gradients / other", "untagged")
    tagged = sum(v[i] for k, v in bars.items() if k not in others)
    kept = sum(x["nbytes"] for x in offload["report"]["residuals"] if x["memory"] == "device")
    assert abs(tagged - (offload["offloaded_bytes"] + kept) / unit) < 1e-6


def test_host_bytes_of_a_compiled_offload_are_a_host_bar():
    rows = copy.deepcopy(_rows("offload-to-host", 128))
    offload = next(r for r in rows if r["policy"] == "offload-to-host")
    offload["host_bytes"] = offload["offloaded_bytes"] // 2  # as a target that offloads gives
    assert not results.offload_stayed_on_device(offload)
    bars = _bars(plots.memory_breakdown(rows))
    unit, _ = plots.units.table_unit([r["peak_bytes"] for r in rows])
    i = [r["policy"] for r in rows].index("offload-to-host")
    assert abs(bars["host (compiled)"][i] - offload["host_bytes"] / unit) < 1e-6
