"""Figures from sweep result rows, shared by ``experiments/sweep.py`` and the notebook.

Every function takes rows as written by :func:`remat_kit.sweep.run_sweep` (a list of dicts, or a
pandas ``DataFrame`` of them) and only reads them: nothing is compiled, run or re-analysed
(:func:`timeline` takes ``MemoryReport`` objects). Each returns a plain matplotlib ``Figure``
(no pyplot state, rendered by Agg) and, given ``path``, saves it as a PNG. :func:`save_figures`
writes the sweep's set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text

from remat_kit import files, units
from remat_kit.memory.report import MemoryReport
from remat_kit.sweep import results as R

__all__ = [
    "layer_activations",
    "memory_breakdown",
    "option_effects",
    "pareto",
    "predicted_vs_measured",
    "save_figures",
    "slowdown_vs_flops",
    "timeline",
]

_PANEL_FIELDS = ("model", "target", "batch_size", "seq_len", "remat_group_size")


def _ok(rows: Any) -> list[dict[str, Any]]:
    return [r for r in R.as_records(rows) if r.get("status") == "ok"]


def _panels(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, list[Mapping[str, Any]]]:
    """Rows by model / target / shape and, where the rows differ in ``overrides``, by the
    overrides not every row shares (an option grid's variants get panels of their own)."""
    panels: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        own = ", ".join(f"{k}={v}" for k, v in R.own_overrides(r, rows).items())
        panels.setdefault((*(r.get(f) for f in _PANEL_FIELDS), own), []).append(r)
    return panels


def _title(key: tuple) -> str:
    model, target, b, s, k, own = key
    grp = f" k={k}" if k not in (None, 1) else ""
    # a user's program has no batch size or sequence length (its arguments carry the shapes)
    shape = " ".join(f"{n}={v}" for n, v in (("b", b), ("s", s)) if v is not None)
    line2 = f"{shape}{grp}".strip()
    return f"{model} @{target}" + (f"\n{line2}" if line2 else "") + (f"\n{own}" if own else "")


#: Pixels per inch of every figure, on screen and in the PNG (labels are placed in pixels).
DPI = 120


def _figure(figsize: tuple[float, float]) -> Figure:
    """A figure drawn by Agg at :data:`DPI`, so text can be measured before it is saved."""
    fig = Figure(figsize=figsize, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _grid(n: int, size: tuple[float, float] = (5.0, 4.0)):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig = _figure((size[0] * cols, size[1] * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _save(fig, path: str | os.PathLike[str] | None, layout: bool = True):
    if layout:
        fig.tight_layout()
    if path is not None:
        path = Path(path)
        with files.replacing(path) as part:  # a kill mid-write never leaves a torn figure
            fig.savefig(part, dpi=DPI, format=path.suffix.lstrip(".") or None)
    return fig


#: Characters per line of a policy's name in a legend or under a bar (:func:`policy_text`).
LABEL_WIDTH = 32


def policy_text(row: Mapping[str, Any]) -> str:
    """A row's policy as the tables name it (``policy_label``, e.g. ``custom: attn_in=save``;
    else ``policy``), broken after its commas into lines of at most :data:`LABEL_WIDTH`
    characters where it is longer."""
    text = str(row.get("policy_label") or row["policy"])
    parts = [part.strip() for part in text.split(",")]
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 2 + len(part) <= LABEL_WIDTH:
            lines[-1] += ", " + part
        else:
            lines[-1] += ","
            lines.append(part)
    return "\n".join(lines)


def _renderer(fig: Figure):
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    return fig.canvas.get_renderer()


def _finish(
    fig: Figure,
    title: str,
    handles: Sequence[Any] = (),
    note: str | None = None,
    max_cols: int = 5,
) -> None:
    """Lay a figure out once: ``title`` as its suptitle, one legend of ``handles`` centred below the
    panels (at most ``max_cols`` columns), ``note`` small and grey at the bottom left. The figure
    grows by their height, so the panels keep their size; labels placed afterwards
    (:func:`label_points`) stay where they are put."""
    renderer = _renderer(fig)
    width = fig.bbox.width
    heading = fig.suptitle(title, fontsize=13, va="top")
    grow = heading.get_window_extent(renderer).height + 8
    text = legend = None
    if note:
        text = fig.text(0.005, 0.005, note, fontsize=6.5, color="gray", ha="left", va="bottom")
        grow += text.get_window_extent(renderer).height + 4
    if handles:
        labels = [h.get_label() for h in handles]
        for ncol in range(min(max_cols, len(handles)), 0, -1):
            legend = fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8.5,
                                frameon=False)  # fmt: skip
            box = legend.get_window_extent(renderer)
            if box.width <= 0.98 * width or ncol == 1:
                break
            legend.remove()
        grow += box.height + 6
        width = max(width, box.width / 0.96)  # one column still wider: the figure widens
    w, h = fig.get_size_inches()
    fig.set_size_inches(width / fig.dpi if width > fig.bbox.width else w, h + grow / fig.dpi)
    height = fig.bbox.height
    heading.set_y(1 - 6 / height)
    bottom = 4.0
    if text is not None:
        bottom = 0.005 * height + text.get_window_extent(renderer).height + 4
    if legend is not None:
        legend.set_bbox_to_anchor((0.5, bottom / height), transform=fig.transFigure)
        bottom += legend.get_window_extent(renderer).height + 2
    fig.tight_layout(rect=(0, bottom / height, 1, 1))


def _text_boxes(ax, renderer) -> list:
    """Window boxes (pixels) of the texts already written in ``ax`` (a label's text, not its
    line)."""
    return [Text.get_window_extent(t, renderer) for t in ax.texts]


def pareto(
    rows: Any,
    x: str = "step_time_s",
    y: str = "peak_bytes",
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
    note: str | None = None,
) -> Figure:
    """Peak memory against step time, one point per policy, the Pareto frontier drawn.

    Per panel: a point per policy (one legend for all panels), the frontier
    (:func:`remat_kit.sweep.results.pareto_frontier`) as a red step line; for measured times, each
    point's own range of timed steps (ms) as an error bar and noisy points
    (:func:`remat_kit.sweep.results.is_noisy`) hollow and off the frontier; the target's device
    memory as a dashed line when within :data:`BUDGET_LINE_WITHIN` of the highest point (else in the
    title).

    Args:
      rows: result rows (list of dicts or ``DataFrame``); rows without ``x`` are left out.
      x: ``"step_time_s"`` (measured median), ``"predicted_step_time_s"`` (the roofline's
        estimate), both seconds drawn in ms, or ``"recompute_ratio"`` (compiled matmul FLOPs over
        the no-remat step's).
      y: ``"peak_bytes"`` (predicted) or ``"measured_peak_bytes"``; drawn in MiB or GiB per
        panel (:func:`remat_kit.units.table_unit`).
      path: save the figure there (PNG). title: default, what is drawn against what.
      note: a line of small grey text at the bottom (e.g. :func:`provenance`).

    Returns:
      The ``Figure``: one panel per model / target / batch size / sequence length.

    Raises:
      ValueError: no ``ok`` row has both ``x`` and ``y``.
    """
    usable = [r for r in _ok(rows) if r.get(x) is not None and r.get(y) is not None]
    if not usable:
        raise ValueError(f"no ok rows with both {x!r} and {y!r} to plot")
    panels = _panels(usable)
    fig, axes = _grid(len(panels), size=(5.2, 3.8))
    xscale, xlabel = _pareto_x_axis(x)
    styles = _policy_styles([r["policy"] for r in usable])
    extra: dict[str, Any] = {}  # legend entries beyond the policies, by label
    for ax, (key, members) in zip(axes, panels.items(), strict=True):
        unit, unit_name = units.table_unit([r[y] for r in members])
        _pareto_points(ax, members, (x, xscale), (y, unit), styles, extra)
        off = _budget_line(ax, members, y, unit, extra)
        ax.set_title(_title(key) + off, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{'predicted' if y == 'peak_bytes' else 'measured'} peak ({unit_name})")
        ax.grid(alpha=0.3)
    names = {r["policy"]: policy_text(r) for r in usable}
    handles = [
        Line2D([], [], color=c, marker=m, ls="", label=names[p]) for p, (c, m) in styles.items()
    ]
    if title is None:
        title = f"Predicted peak memory vs {xlabel.split(' (')[0]}"
    _finish(fig, title, handles + list(extra.values()), note)
    return _save(fig, path, layout=False)


def _pareto_x_axis(x: str) -> tuple[float, str]:
    """``(scale, label)`` of :func:`pareto`'s x axis: seconds drawn in ms (scale 1e3), a
    FLOPs ratio as is (scale 1)."""
    xscale, xlabel = (1e3, "median step time (ms)") if x == "step_time_s" else (1.0, x)
    if x == "predicted_step_time_s":
        xscale, xlabel = 1e3, "estimated step time (ms, roofline)"
    if x == "recompute_ratio":
        xlabel = "compiled matmul FLOPs / no-remat FLOPs"
    return xscale, xlabel


def _pareto_points(
    ax,
    members: Sequence[Mapping[str, Any]],
    x: tuple[str, float],
    y: tuple[str, int],
    styles: Mapping[str, tuple[Any, str]],
    extra: dict[str, Any],
) -> None:
    """Draw one panel's points and its Pareto frontier: ``x`` and ``y`` are ``(field, scale)``
    (x drawn as ``row[field] * scale``, ms or a ratio; y as ``row[field] / scale``, MiB or
    GiB); measured points get their steps' range (ms) and noisy ones are hollow. Legend
    entries beyond the policies are added to ``extra``, by label."""
    (xfield, xscale), (yfield, unit) = x, y
    measured = xfield == "step_time_s"
    xs = [r[xfield] * xscale for r in members]
    ys = [r[yfield] / unit for r in members]
    noisy = {i for i, r in enumerate(members) if measured and R.is_noisy(r)}
    front = R.pareto_frontier(xs, ys, left_out=noisy)
    if front:
        extra.setdefault("Pareto frontier", ax.step(
            [xs[i] for i in front], [ys[i] for i in front], where="post", color="tab:red",
            lw=1.2, alpha=0.6, zorder=1, label="Pareto frontier")[0])  # fmt: skip
    for i, (xi, yi, r) in enumerate(zip(xs, ys, members, strict=True)):
        color, marker = styles[r["policy"]]
        steps = r.get("step_times_s") if measured else None
        if steps:
            lo, hi = 1e3 * min(steps), 1e3 * max(steps)
            bars = ax.errorbar([xi], [yi], xerr=[[max(0.0, xi - lo)], [max(0.0, hi - xi)]],
                               fmt="none", ecolor=color, elinewidth=1, capsize=2.5,
                               alpha=0.8, zorder=2, label=STEP_RANGE)  # fmt: skip
            extra.setdefault(bars.get_label(), bars)
        ax.scatter(
            [xi],
            [yi],
            color="none" if i in noisy else color,
            marker=marker,
            s=60 if i in front else 30,
            edgecolors="tab:red" if i in front else (color if i in noisy else "none"),
            linewidths=1.5,
            zorder=3,
        )
    if noisy:
        text = (f"noisy timing (steps spread beyond ±{50 * R.NOISY_SPREAD:.0f}%): "
                "not on the frontier")  # fmt: skip
        extra.setdefault(text, Line2D([], [], color="gray", marker="o", ls="",
                                      markerfacecolor="none", label=text))  # fmt: skip


def _budget_line(
    ax, members: Sequence[Mapping[str, Any]], y: str, unit: int, extra: dict[str, Any]
) -> str:
    """Draw the panel target's device memory (bytes, drawn in ``unit``s) as a dashed line when
    within :data:`BUDGET_LINE_WITHIN` of the highest point (its legend entry added to
    ``extra``); return the title's extra line saying it is off scale otherwise, else ``""``."""
    memory = _device_memory(members)
    if memory is not None and memory[1] <= BUDGET_LINE_WITHIN * max(r[y] for r in members):
        name, nbytes = memory
        text = f"{name} device memory ({units.format_bytes(nbytes)})"
        line = ax.axhline(nbytes / unit, ls="--", color="black", lw=1, zorder=1, label=text)
        extra.setdefault(text, line)
    elif memory is not None:
        return f"\n{memory[0]} memory {units.format_bytes(memory[1])}: all fit (off scale)"
    return ""


def _device_memory(members: Sequence[Mapping[str, Any]]) -> tuple[str, int] | None:
    """``(target name, device memory in bytes)`` of a panel's target: the rows'
    ``memory_bytes``, else the named target's (:func:`remat_kit.targets.get_target`; never
    ``local``, which would start JAX); None where unknown (a CPU)."""
    from remat_kit import targets

    name = members[0].get("target")
    known = [r["memory_bytes"] for r in members if r.get("memory_bytes")]
    if known:
        return str(name), int(max(known))
    if not name or name == targets.LOCAL:
        return None
    try:
        nbytes = targets.get_target(str(name)).memory_bytes
    except ValueError:
        return None
    return None if nbytes is None else (str(name), nbytes)


def _policy_styles(policies: Sequence[str]) -> dict[str, tuple[Any, str]]:
    """A color and marker per policy, stable across figures (registry order)."""
    from remat_kit.policies import policy_names

    names = policy_names()
    order = sorted(set(policies), key=lambda p: names.index(p) if p in names else len(names))
    cmap = matplotlib.colormaps["tab20"]
    markers = "osD^v<>ph*"
    return {
        p: (cmap((names.index(p) if p in names else i) % 20), markers[i % len(markers)])
        for i, p in enumerate(order)
    }


def _residual_parts(row: Mapping[str, Any]) -> dict[str, int]:
    """Device residual bytes by checkpoint name; untagged residuals (``"<mul>"``) together.
    Residuals the policy offloads count here too where the compiled program kept them on the
    device (:func:`remat_kit.sweep.results.offload_stayed_on_device`: the CPU backend)."""
    on_device = {"device", "host"} if R.offload_stayed_on_device(row) else {"device"}
    parts: dict[str, int] = {}
    for res in (row.get("report") or {}).get("residuals", []):
        if res.get("memory") in on_device:
            tag = "untagged" if res["tag"].startswith("<") else res["tag"]
            parts[tag] = parts.get(tag, 0) + res["nbytes"]
    return parts


#: The legend's name of a measured point's error bar: its own timed steps' range.
STEP_RANGE = "range of the point's timed steps (min to max)"
#: The legend's name of the residuals no ``checkpoint_name`` tags (jaxpr residuals whose tag is
#: the primitive that made them, e.g. ``<mul>``): the activations a policy keeps without naming
#: them, such as attention scores and norm statistics under ``no-remat``.
UNTAGGED = "untagged residuals (no checkpoint_name)"


def memory_breakdown(
    rows: Any,
    path: str | os.PathLike[str] | None = None,
    title: str = "Predicted peak memory by part, per policy",
    note: str | None = None,
) -> Figure:
    """Stacked bars of each policy's predicted peak, one panel per model / target / shape, in
    MiB or GiB per panel (as the summary tables); one legend for all panels.

    Layers (bytes, from the row and its ``report``), bottom up: ``params``, ``opt_state``, the
    residuals kept on device by checkpoint name (jaxpr, all layers), the untagged residuals
    together (:data:`UNTAGGED`), then ``gradients / other``: the rest of the compiled peak (0 where
    the jaxpr residuals exceed it). Host bytes (``host_bytes``) are a hatched bar beside, not in the
    device peak; where the compiled program put nothing on host (XLA:CPU ignores offload) the
    offloaded residuals are drawn on the device. ``note`` is written small at the bottom.

    Raises:
      ValueError: no ``ok`` row with a report.
    """
    usable = [r for r in _ok(rows) if r.get("report")]
    if not usable:
        raise ValueError("no ok rows with a memory report to plot")
    panels = _panels(usable)
    bars = max(len(members) for members in panels.values())
    fig, axes = _grid(len(panels), size=(max(5.4, 1.5 + 0.42 * bars), 3.6))
    tags, colors, names = _residual_styles(usable)
    seen: dict[str, Any] = {}
    for ax, (key, members) in zip(axes, panels.items(), strict=True):
        _breakdown_panel(ax, members, tags, (colors, names), seen)
        ax.set_title(_title(key), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    order = ["params", "opt_state", *(names[t] for t in tags), "gradients / other",
             "host (compiled)"]  # fmt: skip
    _finish(fig, title, [seen[k] for k in order if k in seen], note, max_cols=4)
    return _save(fig, path, layout=False)


def _residual_styles(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """``(tags, colors, legend names)`` of the residual layers of :func:`memory_breakdown`:
    the rows' checkpoint names sorted, ``"untagged"`` last."""
    tags = sorted({t for r in rows for t in _residual_parts(r)} - {"untagged"})
    tags.append("untagged")
    cmap = matplotlib.colormaps["tab20"]
    colors = {t: cmap((i + 4) % 20) for i, t in enumerate(tags)}  # 0-3: params, opt_state
    colors["untagged"] = "dimgray"
    names = {t: f"residual {t}" for t in tags} | {"untagged": UNTAGGED}
    return tags, colors, names


def _breakdown_panel(
    ax,
    members: Sequence[Mapping[str, Any]],
    tags: Sequence[str],
    styles: tuple[Mapping[str, Any], Mapping[str, str]],
    seen: dict[str, Any],
) -> None:
    """Draw one panel's stacked bars (bytes, drawn in the panel's MiB or GiB), one per row,
    and its hatched host bars; ``styles`` is ``(colors, legend names)`` by residual tag, and
    each layer's bars are added to ``seen`` by label."""
    colors, names = styles
    unit, unit_name = units.table_unit([r["peak_bytes"] for r in members])
    bottoms = [0.0] * len(members)
    layers = [
        (field.removesuffix("_bytes"), color, [r.get(field) or 0 for r in members])
        for field, color in (("params_bytes", "tab:blue"), ("opt_state_bytes", "tab:orange"))
    ]
    for tag in tags:
        vals = [_residual_parts(r).get(tag, 0) for r in members]
        if any(vals):
            layers.append((names[tag], colors[tag], vals))
    for label, color, vals in layers:
        _stack_layer(ax, vals, (label, color), [b / unit for b in bottoms], unit, seen)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    rest = [max(0, r["peak_bytes"] - b) for r, b in zip(members, bottoms, strict=True)]
    _stack_layer(ax, rest, ("gradients / other", "lightgray"), [b / unit for b in bottoms],
                 unit, seen)  # fmt: skip
    host = [r.get("host_bytes") or 0 for r in members]  # compiled, not the jaxpr's marks
    if any(host):
        bars = ax.bar(
            [i + 0.38 for i in range(len(members))],
            [h / unit for h in host],
            width=0.2,
            color="none",
            edgecolor="tab:purple",
            hatch="///",
            label="host (compiled)",
        )
        seen.setdefault("host (compiled)", bars)
    ax.set_xticks(range(len(members)), [policy_text(r) for r in members], rotation=40,
                  ha="right", rotation_mode="anchor", fontsize=8)  # fmt: skip
    ax.set_ylabel(f"predicted peak ({unit_name})")


def _stack_layer(
    ax,
    values: Sequence[float],
    style: tuple[str, Any],
    bottom: Sequence[float],
    unit: int,
    seen: dict[str, Any],
) -> None:
    """Draw one layer of stacked bars: ``values`` in bytes drawn in ``unit``s on ``bottom``
    (already in ``unit``s); ``style`` is ``(label, color)``; the bars added to ``seen``."""
    label, color = style
    bars = ax.bar(
        range(len(values)),
        [v / unit for v in values],
        bottom=bottom,
        label=label,
        color=color,
        edgecolor="white",
        width=0.7,
    )
    seen.setdefault(label, bars)


def label_points(
    ax, points: Sequence[tuple[float, float, str]], fontsize: float = 7, **text
) -> None:
    """Write each ``(x, y, label)`` (data coordinates) beside its point, inside the axes, where its
    text overlaps no label, point or label line already there: right of the point, else left, else
    moved up or down by whole text lines with a thin line back to its point. Call it once the
    figure is laid out; ``text`` goes to ``Axes.annotate``."""
    ax.autoscale_view()
    renderer = _renderer(ax.figure)
    px = ax.figure.dpi / 72  # pixels per point
    step = 1.3 * fontsize  # one text line, in points
    frame = ax.get_window_extent(renderer)
    marks = [tuple(ax.transData.transform((x, y))) for x, y, _ in points]
    placed = [(b.x0, b.x1, b.y0, b.y1) for b in _text_boxes(ax, renderer)]
    lines: list[tuple[tuple[float, float], tuple[float, float]]] = []  # point -> label centre
    # (horizontal offset in points, text lines up or down)
    shifts = [(side * dx, k) for dx in (4, 16, 32) for side in (1, -1) for k in range(-10, 11)]

    def crowd(p):  # the points within 60 pixels: the most crowded choose first
        px0, py0 = ax.transData.transform(p[:2])
        return -sum(math.hypot(mx - px0, my - py0) < 60 for mx, my in marks), -p[1], p[0]

    for x, y, label in sorted(points, key=crowd):
        x0, y0 = ax.transData.transform((x, y))
        probe = ax.annotate(label, (x, y), fontsize=fontsize, **text)
        size = Text.get_window_extent(probe, renderer)
        probe.remove()

        def box(dx, k, x0=x0, y0=y0, w=size.width, h=size.height):
            left = x0 + dx * px - (w if dx < 0 else 0)
            mid = y0 + k * step * px
            return (left, left + w, mid - h / 2, mid + h / 2)

        def cost(dx, k, x=x0, y=y0) -> tuple[bool, bool, float]:
            """(unreadable: outside the axes or on a label; crossed: on a label's line or
            its own line through a label; distance, each other point covered counting 20
            points more), the lowest best."""
            b = box(dx, k)
            line = ((x, y), ((b[0] + b[1]) / 2, (b[2] + b[3]) / 2))
            unreadable = not (
                frame.x0 <= b[0] and b[1] <= frame.x1 and frame.y0 <= b[2] and b[3] <= frame.y1
            ) or any(_overlap(b, o) for o in placed)
            crossed = any(_crosses(s, b) for s in lines) or (
                (k or dx != 4) and any(_crosses(line, o) for o in placed)
            )
            covered = sum(_overlap(b, (mx - 3, mx + 3, my - 3, my + 3))
                          for mx, my in marks if (mx, my) != (x, y))  # fmt: skip
            return unreadable, crossed, math.hypot(dx, k * step) + (dx < 0) + 20 * covered

        dx, k = min(shifts, key=lambda c: cost(*c))
        b = box(dx, k)
        placed.append(b)
        moved = k or abs(dx) > 4
        if moved:
            lines.append(((x0, y0), ((b[0] + b[1]) / 2, (b[2] + b[3]) / 2)))
        ax.annotate(label, (x, y), xytext=(dx, k * step), textcoords="offset points",
                    fontsize=fontsize, va="center", ha="left" if dx > 0 else "right",
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "gray"} if moved else None,
                    **text)  # fmt: skip


def _overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether boxes ``(x0, x1, y0, y1)`` (pixels) overlap."""
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def _crosses(line, b: Sequence[float], n: int = 32) -> bool:
    """Whether the segment ``((x, y), (x, y))`` passes through box ``b`` (pixels)."""
    (xa, ya), (xb, yb) = line
    return any(
        b[0] < xa + (xb - xa) * i / n < b[1] and b[2] < ya + (yb - ya) * i / n < b[3]
        for i in range(n + 1)
    )


def predicted_vs_measured(rows: Any, path: str | os.PathLike[str] | None = None):
    """The analyzer's predicted peak against ``measured_peak_bytes``, with ``y = x``.

    Rows without a measurement (the CPU backend reports none) are listed in the panel instead.
    """
    ok = _ok(rows)
    both = [r for r in ok if r.get("measured_peak_bytes") and r.get("peak_bytes")]
    fig = Figure(figsize=(5, 4.5))
    ax = fig.subplots()
    if both:
        unit, unit_name = units.table_unit([r["peak_bytes"] for r in both])
        px = [r["peak_bytes"] / unit for r in both]
        my = [r["measured_peak_bytes"] / unit for r in both]
        ax.scatter(px, my, s=20)
        top = max(px + my) * 1.05
        ax.plot([0, top], [0, top], color="gray", lw=1, ls="--", label="y = x")
        seqs = ["" if r.get("seq_len") is None else f" s={r['seq_len']}" for r in both]
        label_points(ax, [(xi, yi, f"{r['policy']}{s}")
                          for xi, yi, r, s in zip(px, my, both, seqs, strict=True)])  # fmt: skip
        ax.set_xlabel(f"predicted peak ({unit_name})")
        ax.set_ylabel(f"measured peak ({unit_name})")
        ax.legend(fontsize=7)
    else:
        notes = sorted({str(r.get("measured_peak_note")) for r in ok if r.get("measure")})
        ax.text(
            0.5,
            0.5,
            "no measured peak in these rows\n" + "\n".join(notes),
            ha="center",
            va="center",
            fontsize=8,
            transform=ax.transAxes,
            wrap=True,
        )
        ax.set_axis_off()
    return _save(fig, path)


def slowdown_vs_flops(
    rows: Any, path: str | os.PathLike[str] | None = None, note: str | None = None
) -> Figure:
    """Measured slowdown vs ``no-remat`` (percent of its step time) against the compiled matmul
    FLOPs ratio, one point per measured policy and sequence length, labelled with the policy
    (``no-remat`` once: it is the baseline, at (1, 0%) for every length); the dashed line
    ``y = x - 1`` is a step whose time is all matmul FLOPs. A second panel shows process CPU
    time per step for rows measured on the CPU backend (wall time there is at the mercy of
    other processes). One legend (the sequence lengths, the line); ``note`` is written small
    at the bottom (e.g. :func:`provenance`).

    Raises:
      ValueError: no measured rows with a ``no-remat`` row beside them.
    """
    summary = R.summarize(rows)
    panels = [("slowdown", "wall time")]
    if any(r["backend"] == "cpu" and r["cpu_slowdown"] is not None for r in summary):
        panels.append(("cpu_slowdown", "process CPU time"))
    recs = [r for r in summary if r["slowdown"] is not None and r["flops_ratio"] is not None]
    if not recs:
        raise ValueError("no measured rows with a no-remat baseline to plot")
    fig = _figure((6.5 * len(panels), 5.0))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    lo = min(r["flops_ratio"] for r in recs)
    hi = max(r["flops_ratio"] for r in recs)
    labels: dict[Any, list[tuple[float, float, str]]] = {}
    for ax, (field, label) in zip(axes, panels, strict=True):
        labels[ax] = []
        for s in sorted({r["seq_len"] for r in recs}, key=lambda v: (v is not None, v or 0)):
            sub = [r for r in recs if r["seq_len"] == s and r[field] is not None]
            xs = [r["flops_ratio"] for r in sub]
            ys = [100 * r[field] for r in sub]
            # rows without a sequence length (a user's program): labelled with the program
            legend = f"s={s}" if s is not None else ", ".join(sorted({r["model"] for r in sub}))
            ax.scatter(xs, ys, label=legend, s=22, zorder=3)
            labels[ax] += [(x, y, r["policy"]) for x, y, r in zip(xs, ys, sub, strict=True)
                           if r["policy"] != "no-remat"]  # fmt: skip
        if any(r["policy"] == "no-remat" and r[field] is not None for r in recs):
            labels[ax].append((1.0, 0.0, "no-remat (baseline)"))
        ax.plot([lo, hi], [100 * (lo - 1), 100 * (hi - 1)], ls="--", color="gray",
                label="slowdown = FLOPs ratio - 1")  # fmt: skip
        ax.set_title(f"{label} per step", fontsize=10)
        ax.set_xlabel("compiled matmul FLOPs / no-remat FLOPs")
        ax.set_ylabel(f"step {label} vs no-remat (%)")
        ax.grid(alpha=0.3)
        span = hi - lo or 0.1
        ax.set_xlim(lo - 0.25 * span, hi + 0.3 * span)  # room for the labels inside the panel
        ax.margins(y=0.12)
    handles, _ = axes[0].get_legend_handles_labels()
    _finish(fig, "Measured slowdown vs compiled matmul FLOPs, against no-remat", handles, note)
    for ax, points in labels.items():
        label_points(ax, points)
    return _save(fig, path, layout=False)


def layer_activations(rows: Any, path: str | os.PathLike[str] | None = None):
    """Per-layer activation bytes per policy: Korthikanti et al. 2022 (arXiv:2205.05198)
    ``textbook_bytes`` beside ``jaxpr_bytes`` and ``compiled_bytes``.

    Takes records with those fields and ``policy`` (e.g. ``dataclasses.asdict`` of
    :class:`remat_kit.memory.LayerActivations`, or rows that carry them).

    Raises:
      ValueError: no record has ``compiled_bytes``.
    """
    recs = [r for r in R.as_records(rows) if r.get("compiled_bytes") is not None]
    if not recs:
        raise ValueError("no records with per-layer activation bytes (compiled_bytes) to plot")
    unit, unit_name = units.table_unit([r["compiled_bytes"] for r in recs])
    fig = Figure(figsize=(1.2 * len(recs) + 2, 4.5))
    ax = fig.subplots()
    width = 0.27
    for j, (field, label) in enumerate(
        (
            ("textbook_bytes", "Korthikanti et al."),
            ("jaxpr_bytes", "jaxpr residuals"),
            ("compiled_bytes", "compiled (XLA)"),
        )
    ):
        vals = [(r.get(field) or 0) / unit for r in recs]
        ax.bar([i + (j - 1) * width for i in range(len(recs))], vals, width=width, label=label)
    ax.set_xticks(range(len(recs)), [r["policy"] for r in recs], rotation=30, ha="right")
    ax.set_ylabel(f"activation bytes per layer ({unit_name})")
    ax.legend(fontsize=7)
    return _save(fig, path)


def save_figures(rows: Any, folder: str | os.PathLike[str]) -> list[Path]:
    """Write the sweep's figures into ``folder`` and return the paths written:

    * ``pareto.png``: measured rows, predicted peak against median step time;
    * ``pareto_analysis.png``: analysis-only rows, predicted peak against the estimated step
      time (the roofline; the compiled FLOPs ratio for rows without an estimate);
    * ``slowdown_vs_flops.png``: measured slowdown against compiled FLOPs ratio;
    * ``memory_breakdown.png``: every group's predicted peak by part;
    * ``options.png``: each option's effect (:func:`option_effects`), when rows of one shape
      differ in ``overrides``.

    Each has a title, one legend, and a footnote (:func:`provenance`) naming the targets of
    the rows it draws. A figure with no rows to show is skipped.
    """
    ok = _ok(rows)
    folder = Path(folder)
    written = []
    measured = [r for r in ok if r.get("step_time_s") is not None]
    analysis = [r for r in ok if r.get("step_time_s") is None and r.get("recompute_ratio")]
    timed = bool(analysis) and all(r.get("predicted_step_time_s") for r in analysis)
    options = [r for members in R.option_sets(rows).values() for r in members]
    jobs = [
        ("pareto.png", measured, lambda p, n: pareto(
            measured, path=p, note=n, title="Predicted peak memory vs measured step time")),
        ("pareto_analysis.png", analysis, lambda p, n: pareto(
            analysis, x="predicted_step_time_s" if timed else "recompute_ratio", path=p, note=n,
            title="Predicted peak memory vs estimated step time (analysis only)" if timed
            else "Predicted peak memory vs compiled FLOPs (analysis only)")),
        ("slowdown_vs_flops.png", measured, lambda p, n: slowdown_vs_flops(ok, path=p, note=n)),
        ("memory_breakdown.png", ok, lambda p, n: memory_breakdown(ok, path=p, note=n)),
        ("options.png", options, lambda p, n: option_effects(rows, path=p, note=n)),
    ]  # fmt: skip
    for name, drawn, draw in jobs:
        if not drawn:
            continue
        try:  # each figure's footnote names the targets of the rows it draws, no others
            draw(folder / name, provenance([r for r in drawn if r.get("status") == "ok"]))
        except ValueError:  # e.g. measured rows without a no-remat baseline
            continue
        written.append(folder / name)
    return written


def provenance(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the rows were measured, for a figure's footer: CPU, devices, backend, jax version
    (the first row's :func:`remat_kit.sweep.results.environment` fields) and the compile targets
    of these rows only: pass the rows the figure draws ("" without rows)."""
    if not rows:
        return ""
    r0 = rows[0]
    cpu = r0.get("cpu_model") or r0.get("processor") or "?"
    targets = sorted({str(r.get("target")) for r in rows if r.get("target")})
    named = [t if t in ("local", "cpu") else f"{t} (compiled deviceless)" for t in targets]
    return (
        f"{cpu} x{r0.get('cpu_count', '?')}, {r0.get('device_kind', '?')} "
        f"({r0.get('backend', '?')} backend), jax {r0.get('jax', '?')}; "
        f"target{'s' if len(targets) > 1 else ''}: {', '.join(named)}"
    )


_FIXED_COLORS = {
    "params": "tab:blue", "opt_state": "lightsteelblue", "gradients": "tab:green",
    "logits": "tab:purple", "temporaries": "lightgray", "residual:other": "dimgray",
    "residual:untagged": "gray",
}  # fmt: skip
_RESIDUAL_COLORS = ("tab:orange", "tab:red", "tab:brown", "gold", "tab:pink", "tab:cyan",
                    "tab:olive", "darkorange", "firebrick", "peru", "orchid", "teal")  # fmt: skip
#: The budget line is drawn when the budget is at most this many times a panel's highest point
#: (else the y-axis would flatten the data: the budget is stated in the panel's title instead).
BUDGET_LINE_WITHIN = 2.0
_PHASE_COLORS = {"forward": "#eef5ff", "backward": "#fff3e6", "optimizer": "#eefbea"}


def _category_colors(categories: Sequence[str]) -> dict[str, Any]:
    """One color per category, the same in every panel."""
    residuals = sorted({c for c in categories if c not in _FIXED_COLORS and c.startswith("resid")})
    colors = {c: _RESIDUAL_COLORS[i % len(_RESIDUAL_COLORS)] for i, c in enumerate(residuals)}
    others = {c: "silver" for c in categories if c not in _FIXED_COLORS and c not in colors}
    return {**others, **colors, **_FIXED_COLORS}


def timeline(
    reports: Sequence[MemoryReport | Mapping[str, Any]],
    path: str | os.PathLike[str] | None = None,
    columns: int = 2,
    share_y: bool = False,
    titles: Sequence[str] | None = None,
):
    """Live device bytes at each point of XLA's schedule, one panel per report (small
    multiples): stacked by category (parameters, optimizer state, residuals by checkpoint
    tag, gradients, logits, XLA temporaries), forward / backward / optimizer phases shaded, the
    peak marked with its phase, host bytes dashed. The y-axis is scaled to the data; the
    budget (the target's memory unless one was given) is a dotted line when it is within
    :data:`BUDGET_LINE_WITHIN` times the panel's highest point, else stated in the title.

    Args:
      reports: ``MemoryReport`` objects (or their ``to_dict()``) with a ``timeline``.
      path: save the figure there as a PNG. columns: panels per row.
      share_y: one y scale for all panels (off by default: a no-remat panel at 760 GiB
        flattens the others).
      titles: one panel title per report (e.g. the policy labels ``remat-kit analyze``
        prints); default: each report's policy name.

    Raises:
      ValueError: no report has a timeline; ``titles`` is not one per report.
    """
    reps = [r if isinstance(r, MemoryReport) else MemoryReport.from_dict(dict(r)) for r in reports]
    if titles is not None and len(titles) != len(reps):
        raise ValueError(f"titles: {len(titles)} given for {len(reps)} reports; give one each")
    named = [(r, t) for r, t in zip(reps, titles or [None] * len(reps), strict=True)]
    named = [(r, t or r.policy or r.name) for r, t in named if r.timeline is not None]
    reps = [r for r, _ in named]
    if not reps:
        raise ValueError("no report with a timeline to plot (the compile wrote no live ranges)")
    unit, unit_name = units.table_unit([r.timeline.peak_bytes for r in reps])
    colors = _category_colors([c for r in reps for c in r.timeline.categories])
    cols = min(columns, len(reps))
    rows = (len(reps) + cols - 1) // cols
    fig = Figure(figsize=(6.0 * cols, 3.8 * rows))
    axes = fig.subplots(rows, cols, squeeze=False, sharey=share_y)
    _ = [ax.set_visible(False) for ax in axes.flat[len(reps) :]]
    seen: dict[str, Any] = {}
    for ax, (r, title) in zip(axes.flat, named, strict=False):
        _timeline_panel(ax, r, title, unit, unit_name, colors, seen)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(6, len(seen)),
               fontsize=7, frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04 + 0.02 * (len(seen) // 6), 1, 1))
    return _save(fig, path, layout=False)


def _timeline_panel(ax, r: MemoryReport, title: str, unit, unit_name, colors, seen) -> None:
    tl = r.timeline
    for phase, a, b in tl.phases:
        ax.axvspan(a, b, color=_PHASE_COLORS.get(phase, "white"), zorder=0)
        ax.text((a + b) / 2, 0.98, phase, transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=7, color="gray")  # fmt: skip
    ys = [[v / unit for v in row] for row in tl.device_bytes]
    polys = ax.stackplot(tl.positions, ys, colors=[colors[c] for c in tl.categories], lw=0)
    for cat, poly in zip(tl.categories, polys, strict=True):
        seen.setdefault(cat, poly)
    if tl.host_bytes:
        (line,) = ax.plot(tl.positions, [h / unit for h in tl.host_bytes], "--", color="black")
        seen.setdefault("host (offloaded)", line)
    top = max(tl.peak_bytes, max(tl.host_bytes or [0]))
    budget = r.budget_bytes or r.memory_bytes
    on_scale = budget is not None and budget <= BUDGET_LINE_WITHIN * top
    if on_scale:
        seen.setdefault("budget", ax.axhline(budget / unit, ls=":", color="tab:red", lw=1))
    phase = tl.phase_at(tl.peak_position) or "step"
    ax.plot([tl.peak_position], [tl.peak_bytes / unit], "v", color="black", ms=5)
    left = tl.peak_position > tl.length / 2
    ax.annotate(f"peak {tl.peak_bytes / unit:.2f} {unit_name} ({phase}) ",
                (tl.peak_position, tl.peak_bytes / unit), xytext=(-8 if left else 8, -4),
                textcoords="offset points", ha="right" if left else "left", va="top",
                fontsize=7)  # fmt: skip
    ratio = f", FLOPs x{r.recompute_ratio:.2f}" if r.recompute_ratio else ""
    off = (
        "" if on_scale or budget is None else f"\n(budget {units.format_bytes(budget)}: off scale)"
    )
    impl = "jax_remat3" if r.remat_impl == "remat3" else "classic remat"
    runs = f"\n(runs as {r.runs_as} under {impl}: see its warning)" if r.runs_as else ""
    ax.set_title(f"{title}{ratio}{off}{runs}", fontsize=9)
    ax.set_xlabel("position in XLA's schedule (loop bodies once)", fontsize=7)
    ax.set_ylabel(f"live device bytes ({unit_name})", fontsize=8)
    ax.set_xlim(0, tl.length)
    ax.set_ylim(0, max(top, budget if on_scale else 0) / unit * 1.12)


# -- Option sets ---------------------------------------------------------------------------------

#: One color per option family (remat_kit.sweep.results.OPTION_FAMILIES, in order).
_FAMILY_COLORS = dict(
    zip(R.OPTION_FAMILIES, ("tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:purple"),
        strict=True)
)  # fmt: skip


def _panel(ax, recs: Sequence[Mapping[str, Any]], values: list, xlabel: str, fmt: str,
           marks: list | None = None) -> None:  # fmt: skip
    """Horizontal bars, one per variant; a variant without a value gets a text, no bar;
    ``marks`` (a second figure per variant, e.g. CPU time) drawn as ticks where not None."""
    ys = range(len(recs))
    for y, r, v in zip(ys, recs, values, strict=True):
        color = _FAMILY_COLORS.get(r["family"], "tab:cyan")
        if v is None:
            why = r["status"] if r["status"] != "ok" else "n/a"
            ax.text(0, y, f" {why}", va="center", fontsize=7, color="dimgray")
            continue
        hatch = "//" if r["policy"] == "no-remat" else None
        ax.barh(y, v, color=color, alpha=0.8, hatch=hatch, edgecolor="white")
        ax.text(v, y, " " + format(v, fmt), va="center", fontsize=6)
    if marks is not None and any(m is not None for m in marks):
        ys_m = [y for y, m in zip(ys, marks, strict=True) if m is not None]
        ax.scatter([m for m in marks if m is not None], ys_m, marker="|", s=120, color="black",
                   label="process CPU time per step", zorder=3)  # fmt: skip
    plain = [
        v for r, v in zip(recs, values, strict=True)
        if r["option"] == "plain" and r["policy"] == "no-remat" and v is not None
    ]  # fmt: skip
    if plain:
        ax.axvline(plain[0], color="black", lw=0.8, ls="--", alpha=0.5, label="plain no-remat")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylim(len(recs) - 0.5, -0.5)  # first variant on top, texts inside without bars
    if all(v is None for v in values):
        ax.set_xlim(0, 1)
        ax.set_xticks([])
    ax.margins(x=0.25)
    ax.grid(axis="x", alpha=0.3)


def option_effects(
    rows: Any, path: str | os.PathLike[str] | None = None, note: str | None = None
) -> Figure:
    """Each option's effect, one row of three panels per option set: the predicted peak (MiB or
    GiB, the set's unit as in the tables), :func:`remat_kit.sweep.results.option_records`'
    ``flops_ratio`` and the median measured step time (ms, wall clock; a tick marks the process
    CPU time per step where the row has it; "n/a" where the row has no step time: an
    analysis-only target). Bars are colored by option family; bars of ``no-remat`` rows are
    hatched; the dashed line marks the plain ``no-remat`` row's value. One legend for all
    panels; ``note`` is written small at the bottom (e.g. :func:`provenance`).

    Returns:
      The ``Figure`` (saved as a PNG at ``path`` when given).

    Raises:
      ValueError: the rows hold no option set (no two rows of one model and shape differ in
        ``overrides``).
    """
    recs = R.option_records(rows)
    if not recs:
        raise ValueError(
            "no option set in these rows: no two rows of one shape differ in overrides"
        )
    sets: dict[tuple, list[dict[str, Any]]] = {}
    for r in recs:
        sets.setdefault((r["model"], r["target"], r["batch_size"], r["seq_len"]), []).append(r)
    heights = [0.32 * len(v) + 1.2 for v in sets.values()]
    fig = _figure((15, sum(heights)))
    grid = fig.add_gridspec(len(sets), 3, height_ratios=heights)
    for i, ((model, target, b, s), members) in enumerate(sets.items()):
        unit, unit_name = units.table_unit([r["peak_bytes"] for r in members])
        peaks = [None if r["peak_bytes"] is None else r["peak_bytes"] / unit for r in members]
        times = [None if r["step_time_s"] is None else 1e3 * r["step_time_s"] for r in members]
        ratios = [r["flops_ratio"] for r in members]
        cpu = [None if r["step_cpu_s"] is None else 1e3 * r["step_cpu_s"] for r in members]
        panels = (
            (peaks, f"predicted peak ({unit_name})", ".2f", None),
            (ratios, "matmul FLOPs / plain no-remat (XLA attention)", ".3f", None),
            (times, "median step time (ms; bar: wall, tick: process CPU)", ".0f", cpu),
        )
        for j, (values, xlabel, fmt, marks) in enumerate(panels):
            ax = fig.add_subplot(grid[i, j])
            _panel(ax, members, values, xlabel, fmt, marks)
            if j == 0:
                ax.set_yticks(
                    range(len(members)), [f"{r['option']} · {r['policy']}" for r in members]
                )
                ax.tick_params(axis="y", labelsize=7)
                ax.set_title(f"{model} @{target}, b={b} s={s}", fontsize=9, loc="left")
            else:
                ax.set_yticks([])
    families = list(dict.fromkeys(r["family"] for r in recs))
    handles = [Patch(color=_FAMILY_COLORS.get(f, "tab:cyan"), alpha=0.8, label=f)
               for f in families]  # fmt: skip
    handles.append(Patch(facecolor="lightgray", hatch="//", edgecolor="white", label="no-remat"))
    for ax in fig.axes:
        for artist in (*ax.lines, *ax.collections):
            if artist.get_label() in ("plain no-remat", "process CPU time per step") and not any(
                h.get_label() == artist.get_label() for h in handles
            ):
                handles.append(artist)
    _finish(fig, "Each option's effect on predicted peak, matmul FLOPs and step time", handles,
            note)  # fmt: skip
    return _save(fig, path, layout=False)
