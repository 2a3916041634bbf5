"""Write the report: one HTML file, plotly.js inlined once, the data as JSON, a small script.

The figures are plotly figures built here with ``plotly.graph_objects`` (the trade-off scatter,
one per x axis; the live-bytes timeline of each policy, stacked by category); ``page.js`` only
swaps them and fills the tables when a policy is selected, and lists the buffers live where the
pointer is on a timeline (from :attr:`~remat_kit.memory.Timeline.spans`).
"""

from __future__ import annotations

import html
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from remat_kit import files
from remat_kit.memory.diff import diff_reports
from remat_kit.memory.report import MemoryReport
from remat_kit.memory.timeline import thin_positions
from remat_kit.report_html.entries import Entry, Group
from remat_kit.sweep.results import pareto_frontier
from remat_kit.units import GIB, KIB, MIB, format_bytes, format_flops

#: A timeline drawn in the page keeps at most this many schedule points (the highest of each
#: bucket, so the peak stays): 13 policies stay near 1 MB of data.
HTML_POINTS = 600
#: Pairs of policies compared side by side are precomputed for groups up to this size; larger
#: groups compare every policy with the first.
ALL_PAIRS_UP_TO = 16
#: The trade-off plot writes each point's label up to this many points (then: on hover).
LABELLED_UP_TO = 6
#: The buffers listed per hovered point.
LIVE_LISTED = 12
_HERE = Path(__file__).resolve().parent
_PALETTE = (
    "#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
    "#9d755d", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf",
)  # fmt: skip
_FIXED = {"params": "#9ecae9", "opt_state": "#c6dbef", "gradients": "#a1d99b",
          "logits": "#fdae6b", "temporaries": "#d9d9d9", "batch": "#bcbddc"}  # fmt: skip


def _unit(values: Sequence[int | None]) -> tuple[int, str]:
    top = max((v for v in values if v is not None), default=0)
    if top >= GIB:
        return GIB, "GiB"
    return (MIB, "MiB") if top >= MIB else (KIB, "KiB")


def _ms(s: float | None) -> str:
    """Seconds as milliseconds, the page's one unit of time (the sweep's tables use it too):
    three significant digits, whole and thousands separated from 100 ms (``"1,234 ms"``,
    ``"12.3 ms"``, ``"0.0412 ms"``)."""
    if s is None:
        return "—"
    ms = 1e3 * s
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:#.3g} ms"


def _cell(value: float | None, text: str) -> list:
    """A table cell: ``[sort value or None, text]``; unknown shows as an em dash, never 0."""
    return [value, "—" if value is None else text]


def _row(e: Entry, unit: int, uname: str) -> dict[str, Any]:
    fits = None if e.fits is None else int(e.fits)
    return {
        "label": e.label,
        "error": e.error,
        "has_report": e.report is not None,
        "cells": [
            _cell(e.peak_bytes, f"{(e.peak_bytes or 0) / unit:,.2f}"),
            _cell(e.host_bytes, f"{(e.host_bytes or 0) / unit:,.2f}"),
            _cell(e.step_time_s, _ms(e.step_time_s)),
            _cell(e.measured_step_time_s, _ms(e.measured_step_time_s)),
            _cell(e.recompute_ratio, f"x{e.recompute_ratio or 0:.3f}"),
            [fits, "—" if fits is None else ("yes" if fits else "no")],
        ],
    }


COLUMNS = (
    "policy", "peak {u}", "host {u}", "est. step (ms)", "measured step (ms)", "FLOPs ratio", "fits",
)  # fmt: skip
#: Every plot's title sits this many pixels below the top of its plot, under plotly's toolbar
#: (the mode bar, about 25 pixels high at the top right), which then covers no title.
TITLE_BELOW_TOOLBAR = 34


def _title(text: str, lines: int = 1) -> tuple[dict[str, Any], int]:
    """A plot's title placed under the toolbar, and the top margin that holds it (pixels)."""
    title = {"text": text, "font": {"size": 13}, "x": 0.0, "xanchor": "left", "xref": "paper",
             "y": 1.0, "yref": "container", "yanchor": "top",
             "pad": {"t": TITLE_BELOW_TOOLBAR}}  # fmt: skip
    return title, TITLE_BELOW_TOOLBAR + 18 * lines + 12


def _x_options(entries: Sequence[Entry]) -> list[tuple[str, str]]:
    """The x axes the trade-off plot offers: only those some entry has a figure for."""
    options = [
        ("step_time_s", "estimated step time (ms)"),
        ("measured_step_time_s", "measured step time (ms)"),
        ("recompute_ratio", "matmul FLOPs / no-remat FLOPs"),
    ]
    return [(k, name) for k, name in options if any(getattr(e, k) is not None for e in entries)]


#: The trade-off plot's point colors, one legend entry each: whether the peak fits the budget.
_FITS = ((True, "#2ca02c", "fits the budget"), (False, "#d62728", "does not fit"),
         (None, "#888", "fit unknown (no budget)"))  # fmt: skip


def _scatter(entries: Sequence[Entry], key: str, xname: str, unit: int, uname: str) -> dict:
    """The memory-vs-time plot against ``key`` (step times drawn in ms): one trace of points
    per fit status (green fits, red does not, grey unknown), the Pareto frontier, the budget."""
    import plotly.graph_objects as go

    idx = [
        i for i, e in enumerate(entries) if getattr(e, key) is not None and e.peak_bytes is not None
    ]
    scale = 1e3 if key.endswith("_s") else 1.0
    xs = [getattr(entries[i], key) * scale for i in idx]
    ys = [entries[i].peak_bytes / unit for i in idx]
    fig = go.Figure()
    front = pareto_frontier(xs, ys)
    if len(front) > 1:
        fig.add_trace(
            go.Scatter(
                x=[xs[j] for j in front], y=[ys[j] for j in front], mode="lines",
                line={"color": "#bbb", "dash": "dot"}, hoverinfo="skip", name="Pareto frontier",
            )
        )  # fmt: skip
    for fits, color, name in _FITS:
        own = [k for k, i in enumerate(idx) if entries[i].fits is fits]
        if not own:
            continue
        fig.add_trace(
            go.Scatter(
                x=[xs[k] for k in own], y=[ys[k] for k in own],
                mode="markers+text" if len(idx) <= LABELLED_UP_TO else "markers",
                text=[html.escape(entries[idx[k]].label) for k in own],
                textposition="top center", textfont={"size": 10},
                customdata=[idx[k] for k in own],
                marker={"size": 11, "color": color,
                        "line": {"width": [0] * len(own), "color": "#000"}},
                hovertemplate="<b>%{text}</b><br>" + xname + ": %{x:.4g}<br>peak: %{y:.2f} "
                + uname + "<extra></extra>",
                name=name,
            )
        )  # fmt: skip
    budgets = {entries[i].report.budget_bytes for i in idx if entries[i].report is not None}
    if len(budgets) == 1 and None not in budgets:
        budget = budgets.pop() / unit  # a trace, not a shape: shapes on a log axis take log10
        fig.add_trace(
            go.Scatter(
                x=[min(xs), max(xs)], y=[budget, budget], mode="lines+text", name="budget",
                line={"color": "#d62728", "width": 1, "dash": "dash"},
                text=[f"budget {budget:,.2f} {uname}", ""], textposition="top right",
                textfont={"size": 10, "color": "#d62728"}, hoverinfo="skip",
            )
        )  # fmt: skip
    if ys and min(ys) > 0 and max(ys) / min(ys) > 4:  # a no-remat far above the rest
        fig.update_yaxes(type="log", tickvals=_log_ticks(min(ys), max(ys)))
    title, top = _title("memory vs time (click a point to select)")
    fig.update_layout(
        xaxis_title=xname, yaxis_title=f"peak ({uname} per device)", showlegend=True,
        legend={"orientation": "h", "yanchor": "top", "y": -0.2, "font": {"size": 10}},
        margin={"l": 60, "r": 20, "t": top, "b": 110}, height=500, template="plotly_white",
        clickmode="event", title=title,
    )  # fmt: skip
    return fig.to_plotly_json()


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks covering ``[lo, hi]`` (plotly's own log ticks label only the decades)."""
    import math

    out = []
    for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        out += [m * 10.0**k for m in (1, 2, 5)]
    inside = [t for t in out if lo / 1.5 <= t <= hi * 1.5]
    return inside or out


def _color_map(groups_categories: Sequence[str]) -> dict[str, str]:
    out, k = {}, 0
    for c in groups_categories:
        if c in _FIXED:
            out[c] = _FIXED[c]
        elif c not in out:
            out[c] = _PALETTE[k % len(_PALETTE)]
            k += 1
    return out


def _timeline(r: MemoryReport, label: str, colors: dict[str, str], unit: int, uname: str):
    """The stacked live-bytes figure of one report (None without a timeline)."""
    import plotly.graph_objects as go

    tl = r.timeline
    if tl is None or not tl.categories:
        return None
    rows = np.array(tl.device_bytes, dtype=np.float64)
    keep = thin_positions(rows.sum(axis=0), HTML_POINTS)
    x = [tl.positions[i] for i in keep]
    fig = go.Figure()
    for c, row in zip(tl.categories, rows, strict=True):
        fig.add_trace(
            go.Scatter(
                y=np.round(row[keep] / unit, 4), name=html.escape(c), stackgroup="device",
                mode="lines", line={"width": 0.5, "color": colors[c]}, fillcolor=colors[c],
                hovertemplate="%{y:.3f} " + uname,
            )
        )  # fmt: skip
    if tl.host_bytes is not None:
        host = np.array(tl.host_bytes, dtype=np.float64)[keep] / unit
        fig.add_trace(
            go.Scatter(y=np.round(host, 4), name="host memory", mode="lines",
                       line={"color": "#000", "dash": "dash", "width": 1.5},
                       hovertemplate="%{y:.3f} " + uname)
        )  # fmt: skip
    for name, a, b in tl.phases:
        fig.add_vrect(x0=a, x1=b, fillcolor="#000", opacity=0.03 if name == "backward" else 0,
                      line_width=0, annotation_text=name, annotation_position="top left",
                      annotation_font_size=10)  # fmt: skip
    fig.add_vline(x=tl.peak_position, line={"color": "#d62728", "width": 1, "dash": "dot"})
    title, top = _title(
        f"live device bytes over XLA's schedule: {html.escape(label)}<br>(peak "
        f"{format_bytes(tl.peak_bytes)} at {tl.peak_position} of {tl.length})",
        lines=2,
    )
    fig.update_layout(
        title=title, xaxis_title="position in XLA's schedule (loop bodies once)",
        yaxis_title=f"{uname} per device", yaxis_rangemode="tozero",
        hovermode="x unified", template="plotly_white", height=470, showlegend=True,
        margin={"l": 60, "r": 20, "t": top, "b": 50}, legend={"font": {"size": 10}},
    )  # fmt: skip
    out = fig.to_plotly_json()
    out["x"] = x  # every trace's x, written once: page.js gives it to each trace
    return out


def _split_shape(shape: str) -> tuple[str, str]:
    """``"bf16[32,1,8192]"`` -> ``("bf16", "[32,1,8192]")``."""
    dtype, sep, rest = shape.partition("[")
    return (dtype, sep + rest) if sep else (shape, "")


def _tag(category: str) -> str:
    return category.partition(":")[2] if category.startswith("residual:") else ""


def _details(e: Entry, unit: int, colors, uname: str) -> dict[str, Any]:
    r = e.report
    out: dict[str, Any] = {
        "findings": None
        if e.findings is None
        else [[f.severity, f.code, f.what, f.cause, f.fix] for f in e.findings],
        "notes": list(e.notes),
        "error": e.error,
    }
    if r is None:
        return out
    tl = r.timeline
    out["timeline"] = _timeline(r, e.label, colors, unit, uname)
    out["peak_position"] = tl.peak_position if tl is not None else None
    out["spans"] = [
        [s.start, s.end, s.nbytes, s.value, s.category, _tag(s.category), *_split_shape(s.shape),
         s.op_name]
        for s in (tl.spans if tl is not None else ())
    ]  # fmt: skip
    if tl is not None:
        peak = [(b.value, b.category, b.nbytes, b.shape, b.op_name) for b in tl.peak_buffers]
    else:
        peak = [(b.value, b.kind, b.nbytes, b.shape, b.op_name) for b in r.peak_buffers]
    out["peak_buffers"] = [
        [v, _tag(c) or c, format_bytes(n), *_split_shape(s), op] for v, c, n, s, op in peak
    ]
    out["residuals"] = [
        [t.tag, t.count, "[" + ",".join(map(str, t.shape)) + "]", t.dtype, t.memory,
         format_bytes(t.nbytes)]
        for t in sorted(r.residuals, key=lambda t: -t.nbytes)
    ]  # fmt: skip
    out["facts"] = [
        ["peak (argument + output + temp - alias)", format_bytes(r.peak_bytes)],
        ["live peak (schedule)", format_bytes(r.live_peak_bytes)],
        ["arguments", ", ".join(f"{k} {format_bytes(v)}" for k, v in r.arguments.items())],
        ["residuals kept (device / host)",
         f"{format_bytes(r.activation_bytes)} / {format_bytes(r.offloaded_bytes)}"],
        ["matmul FLOPs", _flops(r.flops)],
        ["recompute ratio (policy's own / as compiled)",
         " / ".join("—" if v is None else f"x{v:.3f}"
                    for v in (r.recompute_ratio, r.compiled_recompute_ratio))],
        ["estimated step time (roofline)", _step_time(r)],
        ["budget", format_bytes(r.budget_bytes)],
        ["compile", f"{r.compile_s:.1f} s"],
    ]  # fmt: skip
    return out


def _step_time(r: MemoryReport) -> str:
    """The estimate and its breakdown (:class:`~remat_kit.memory.roofline.StepTime`), where
    the report has them."""
    t = getattr(r, "step_time", None)
    if t is None:
        return _ms(getattr(r, "step_time_s", None))
    parts = [
        (name, getattr(t, f"{name}_s", None))
        for name in ("compute", "memory", "elementwise", "launch", "transfer", "collective",
                     "allocation")
    ]  # fmt: skip
    shown = ", ".join(f"{n} {_ms(v)}" for n, v in parts if v)
    recompute = f"; recompute {_ms(t.recompute_s)}" if getattr(t, "recompute_s", 0) else ""
    return f"{_ms(t.step_time_s)} ({shown}{recompute}; {t.figures})"


def _flops(n: float | None) -> str:
    return "—" if n is None else format_flops(n, 3)


def _diffs(entries: Sequence[Entry]) -> dict[str, Any]:
    """``"i,j"`` -> the diff of entries i and j (:func:`remat_kit.memory.diff.diff_reports`)."""
    have = [i for i, e in enumerate(entries) if e.report is not None]
    if len(have) <= ALL_PAIRS_UP_TO:
        pairs = [(i, j) for i in have for j in have if i < j]
    else:
        pairs = [(have[0], j) for j in have[1:]]
    out = {}
    for i, j in pairs:
        a, b = entries[i].report, entries[j].report
        if (a.name, a.target) != (b.name, b.target):
            continue
        d = diff_reports(a, b, top=5)
        rows = []
        for section, items in (("", d.figures), ("residuals by tag", d.residuals),
                               ("live at the peak, by category", d.at_peak)):  # fmt: skip
            rows += [[section, x.name, _fmt(x.a, x.unit), _fmt(x.b, x.unit), _change(x)]
                     for x in items]  # fmt: skip
        out[f"{i},{j}"] = {"rows": rows, "moved": list(d.moved)}
    return out


def _fmt(v: float | str | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "bytes":
        return format_bytes(v)
    if unit == "flops":
        return _flops(v)
    if unit == "ratio":
        return f"x{v:.3f}"
    return str(v)


def _change(row) -> str:
    c = row.change
    if c is None or c == 0:
        return "" if c is None else "0"
    sign = "+" if c > 0 else "−"
    return sign + _fmt(abs(c), row.unit).lstrip("x")


def _group_data(g: Group) -> dict[str, Any]:
    entries = g.entries
    unit, uname = _unit([e.peak_bytes for e in entries])
    cats = [
        c for e in entries if e.report and e.report.timeline for c in e.report.timeline.categories
    ]
    colors = _color_map(list(dict.fromkeys(cats)))
    xopts = _x_options(entries)
    return {
        "title": g.title,
        "notes": list(g.notes),
        "unit": uname,
        "columns": [c.format(u=uname) for c in COLUMNS],
        "rows": [_row(e, unit, uname) for e in entries],
        "xoptions": [[k, name] for k, name in xopts],
        "scatter": {k: _scatter(entries, k, name, unit, uname) for k, name in xopts},
        "details": [_details(e, unit, colors, uname) for e in entries],
        "diffs": _diffs(entries),
        "listed": LIVE_LISTED,
    }


def machine() -> str:
    """The machine this runs on, in words (CPU model and count, OS), for the report's header."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       None)  # fmt: skip
    except OSError:
        pass
    return f"{cpu or platform.processor() or platform.machine()} x{os.cpu_count()}, " + (
        f"{platform.system()} {platform.release()}"
    )


def _targets(groups: Sequence[Group]) -> list[str]:
    """The targets the groups were compiled for, in order, each with its description (``local``
    is where the rows ran: its description would be this machine's, so it has none)."""
    from remat_kit import targets

    names = [g.target for g in groups if g.target]
    names += [e.report.target for g in groups for e in g.entries if e.report and not g.target]
    out = []
    for name in dict.fromkeys(names):
        try:
            t = None if name == targets.LOCAL else targets.get_target(name)
        except ValueError:
            t = None
        out.append(f"{name}: {t.description}" if t is not None else str(name))
    return out


def _header(groups: Sequence[Group], command: str, title: str, hardware: str | None) -> str:
    import jax
    import plotly

    first = next((e.report for g in groups for e in g.entries if e.report is not None), None)
    backend = first.backend if first is not None else jax.default_backend()
    names = _targets(groups)
    items = [
        ("command", f"<code>{html.escape(command)}</code>"),
        ("target" if len(names) == 1 else "targets", html.escape("; ".join(names) or "—")),
        *([("run on", html.escape(hardware))] if hardware else []),
        ("compiled on", html.escape(machine())),
        ("backend", html.escape(backend)),
        ("jax", html.escape(jax.__version__)),
        ("page", f"remat-kit report, plotly {html.escape(plotly.__version__)} inlined (offline)"),
    ]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)
    return f"<header><h1>{html.escape(title)}</h1><dl>{dl}</dl></header>"


def render(
    groups: Sequence[Group],
    *,
    command: str | None = None,
    title: str | None = None,
    hardware: str | None = None,
) -> str:
    """The report page as one HTML string (see :func:`write_report`)."""
    from plotly.offline import get_plotlyjs

    if not groups or not any(g.entries for g in groups):
        raise ValueError("nothing to report: no group has an entry")
    command = command if command is not None else " ".join(["remat-kit", *sys.argv[1:]])
    title = title or groups[0].title
    groups_data = [_group_data(g) for g in groups]
    template = _share_template(groups_data)
    data = json.dumps({"groups": groups_data, "template": template}, default=_json_default)
    data = data.replace("</", "<\\/")  # never ends the script element early
    css = (_HERE / "page.css").read_text()
    js = (_HERE / "page.js").read_text()
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{css}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        + _header(groups, command, title, hardware)
        + "<main id='app'></main>"
        f"<script id='report-data' type='application/json'>{data}</script>"
        f"<script>{js}</script></body></html>"
    )


def _share_template(groups_data: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Take the plotly template (~7 KB) out of every figure that has the first one's, and
    return it: the page writes it once and page.js gives it back to each figure."""
    figures = [f for g in groups_data for f in g["scatter"].values()]
    figures += [d["timeline"] for g in groups_data for d in g["details"] if d.get("timeline")]
    shared = next((f["layout"]["template"] for f in figures if "template" in f["layout"]), None)
    for f in figures:
        if shared is not None and f["layout"].get("template") == shared:
            del f["layout"]["template"]
    return shared


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON: {type(x).__name__}")


def write_report(
    path: str | os.PathLike[str],
    groups: Sequence[Group],
    *,
    command: str | None = None,
    title: str | None = None,
    hardware: str | None = None,
) -> int:
    """Write the interactive report to ``path`` (one self-contained HTML file, works offline).

    Args:
      path: the ``.html`` file (its folder is created).
      groups: what to show (:func:`~remat_kit.report_html.group_of_reports`,
        :func:`~remat_kit.report_html.groups_of_rows`,
        :func:`~remat_kit.report_html.group_of_recommendation`).
      command: the command that made it, shown at the top (default: ``remat-kit`` and this
        process's arguments).
      title: the page title (default: the first group's).
      hardware: the device the entries were run (timed) on, in words, shown as "run on"
        beside the targets the groups were compiled for (which the header always names).

    Returns:
      The file's size in bytes.

    Raises:
      ValueError: no entry to show.
    """
    text = render(groups, command=command, title=title, hardware=hardware)
    p = Path(path)
    files.write_text(p, text)
    return p.stat().st_size
