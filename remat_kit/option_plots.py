"""The effect of each ModelConfig option against the plain step, from sweep rows.

An *option set* is the rows of one model, target, batch size, sequence length, group size and
mesh whose ``overrides`` differ (e.g. ``experiments/configs/options.py``: ``remat_layers``,
``nested_remat``, ``loss_chunk_size``, ``attention`` varied one at a time). Each row is a
*variant*, labelled by the overrides it does not share with every row of its set (``plain``
when it has none of its own) and its policy. :func:`option_records` gives the figures as data,
:func:`option_markdown` as tables; :func:`option_effects` draws them (re-exported by
:mod:`remat_kit.plots`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from remat_kit import results as R
from remat_kit import units

__all__ = [
    "option_effects", "option_markdown", "option_records", "option_sets", "own_overrides",
]  # fmt: skip

_SET_FIELDS = ("model", "target", "batch_size", "seq_len", "remat_group_size", "mesh")
_FAMILY_COLORS = {
    "plain": "tab:gray", "remat_layers": "tab:blue", "nested_remat": "tab:green",
    "loss_chunk_size": "tab:orange", "attention": "tab:purple",
}  # fmt: skip


def _overrides_text(overrides: Mapping[str, Any]) -> str:
    return json.dumps(dict(sorted(dict(overrides or {}).items())), sort_keys=True)


def option_sets(rows: Any) -> dict[tuple, list[dict[str, Any]]]:
    """Rows grouped by model, target, batch size, sequence length, ``remat_group_size`` and mesh,
    keeping only groups whose rows carry more than one distinct ``overrides``; in row order."""
    sets: dict[tuple, list[dict[str, Any]]] = {}
    for r in R.as_records(rows):
        sets.setdefault(tuple(r.get(f) for f in _SET_FIELDS), []).append(r)
    return {
        k: v for k, v in sets.items() if len({_overrides_text(r.get("overrides")) for r in v}) > 1
    }


def own_overrides(row: Mapping[str, Any], members: Sequence[Mapping[str, Any]]) -> dict:
    """The overrides of ``row`` that not every row of its set shares."""
    own = dict(row.get("overrides") or {})
    shared = [dict(m.get("overrides") or {}) for m in members]
    return {k: v for k, v in own.items() if not all(s.get(k) == v for s in shared)}


def _xla_baseline(members: Sequence[Mapping[str, Any]]) -> float | None:
    """Traced matmul FLOPs of the plain no-remat step with XLA attention (``flops_no_remat`` of
    any ok row of the set with ``attention="xla"``: the baseline resets every layer-structure
    and loss option)."""
    for r in members:
        attention = (r.get("model_config") or {}).get("attention")
        if r.get("status") == "ok" and attention == "xla" and r.get("flops_no_remat"):
            return r["flops_no_remat"]
    return None


def option_records(rows: Any) -> list[dict[str, Any]]:
    """One record per row of every option set (:func:`option_sets`).

    Fields: the set's ``model, target, batch_size, seq_len``; ``option`` (``"plain"`` or the
    row's own overrides, ``"remat_layers=3"``), ``family`` (the first own override's field
    with a color of its own, e.g. ``nested_remat`` beside ``nested_groups``, or ``"plain"``),
    ``policy``, ``status``; ``peak_bytes`` (the analyzer's predicted peak, bytes); ``fits``
    (within the target's memory; None where unknown);
    ``flops_ratio``: the policy's own matmul FLOPs (``recompute_ratio``, XLA's own
    rematerialisation told apart) over the plain no-remat step's with XLA attention, i.e.
    ``recompute_ratio * flops_no_remat / flops_no_remat(xla)`` (so cuDNN attention's own FLOPs,
    counted by its matmul work, show against the same baseline); ``step_time_s`` (median measured
    seconds) and ``step_cpu_s``. ``None`` wherever the row has no such figure (a failed row;
    an analysis-only row has no step time): never 0.
    """
    out = []
    for members in option_sets(rows).values():
        base = _xla_baseline(members)
        for r in members:
            own = own_overrides(r, members)
            ok = r.get("status") == "ok"
            ratio = r.get("recompute_ratio") if ok else None
            if ratio is not None and base and r.get("flops_no_remat"):
                ratio = ratio * r["flops_no_remat"] / base
            out.append(
                {
                    **{f: r.get(f) for f in ("model", "target", "batch_size", "seq_len")},
                    "option": ", ".join(f"{k}={v}" for k, v in own.items()) or "plain",
                    "family": next(
                        (k for k in own if k in _FAMILY_COLORS), next(iter(own), "plain")
                    ),
                    "policy": r.get("policy"),
                    "status": r.get("status"),
                    "peak_bytes": r.get("peak_bytes") if ok else None,
                    "fits": r.get("fits") if ok else None,
                    "flops_ratio": ratio,
                    "step_time_s": r.get("step_time_s") if ok else None,
                    "step_cpu_s": r.get("step_cpu_s") if ok else None,
                }
            )
    return out


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
                   label="process CPU time", zorder=3)  # fmt: skip
        ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
    plain = [
        v for r, v in zip(recs, values, strict=True)
        if r["option"] == "plain" and r["policy"] == "no-remat" and v is not None
    ]  # fmt: skip
    if plain:
        ax.axvline(plain[0], color="black", lw=0.8, ls="--", alpha=0.5)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylim(len(recs) - 0.5, -0.5)  # first variant on top, texts inside without bars
    if all(v is None for v in values):
        ax.set_xlim(0, 1)
        ax.set_xticks([])
    ax.margins(x=0.25)
    ax.grid(axis="x", alpha=0.3)


def option_effects(rows: Any, path: str | os.PathLike[str] | None = None) -> Figure:
    """Each option's effect, one row of three panels per option set: the predicted peak (bytes,
    in the set's unit), :func:`option_records`' ``flops_ratio`` and the median measured step
    time (ms, wall clock; a tick marks the process CPU time per step where the row has it;
    "n/a" where the row has no step time: an analysis-only target). Bars of ``no-remat`` rows
    are hatched; the dashed line marks the plain ``no-remat`` row's value.

    Returns:
      The ``Figure`` (saved as a PNG at ``path`` when given).

    Raises:
      ValueError: the rows hold no option set (no two rows of one model and shape differ in
        ``overrides``).
    """
    recs = option_records(rows)
    if not recs:
        raise ValueError(
            "no option set in these rows: no two rows of one shape differ in overrides"
        )
    sets: dict[tuple, list[dict[str, Any]]] = {}
    for r in recs:
        sets.setdefault((r["model"], r["target"], r["batch_size"], r["seq_len"]), []).append(r)
    heights = [0.32 * len(v) + 1.2 for v in sets.values()]
    fig = Figure(figsize=(15, sum(heights)), layout="constrained")
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
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.part")  # renamed: a kill never leaves it torn
        fig.savefig(part, dpi=120, format=path.suffix.lstrip(".") or None)
        os.replace(part, path)
    return fig


def _fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def option_markdown(rows: Any) -> str:
    """:func:`option_records` as one Markdown table per option set: predicted peak (in the
    set's unit) and its change against the plain ``no-remat`` row, ``fits``, ``flops_ratio``,
    median step time (wall and process CPU, ms); ``-`` where a row has no such figure. Empty
    string when the rows hold no option set."""
    sets: dict[tuple, list[dict[str, Any]]] = {}
    for r in option_records(rows):
        sets.setdefault((r["model"], r["target"], r["batch_size"], r["seq_len"]), []).append(r)
    parts = []
    for (model, target, b, s), recs in sets.items():
        unit, unit_name = units.table_unit([r["peak_bytes"] for r in recs])
        base = next(
            (r["peak_bytes"] for r in recs if r["option"] == "plain" and r["policy"] == "no-remat"),
            None,
        )
        parts += [
            f"**Options: {model} on {target}, b={b}, s={s}**\n",
            f"| option | policy | peak {unit_name} | peak Δ | fits | FLOPs x | step ms | CPU ms |",
            "|---|---|--:|--:|--:|--:|--:|--:|",
        ]
        for r in recs:
            peak = r["peak_bytes"]
            delta = None if peak is None or not base else 100 * (peak / base - 1)
            ms = [None if r[f] is None else 1e3 * r[f] for f in ("step_time_s", "step_cpu_s")]
            policy = r["policy"] if r["status"] == "ok" else f"{r['policy']} ({r['status']})"
            pct = "-" if delta is None else f"{delta:+.0f}%"
            cells = [
                r["option"], policy, units.in_unit(peak, unit, 2), pct,
                {True: "yes", False: "no"}.get(r["fits"], "-"),
                _fmt(r["flops_ratio"], ".3f"), _fmt(ms[0], ",.0f"), _fmt(ms[1], ",.0f"),
            ]  # fmt: skip
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)
