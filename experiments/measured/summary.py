"""What a person reads after a measured sweep: the summary tables of the rows (per model, shape
and target: peak, activations, FLOPs, measured and estimated step time, the changes against
no-remat), the columns' legend and the notes on how far the estimates and timings go (the
calibration's load, measured peaks, small steps). Figures come from
:func:`remat_kit.sweep.results.summarize`; nothing is recomputed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from remat_kit import units
from remat_kit.memory import roofline
from remat_kit.memory.calibration import RETIME_AFTER_S, cache_dir
from remat_kit.policies import policy_names
from remat_kit.sweep.results import (
    NOISY_SPREAD,
    as_records,
    canonical_json,
    group_key,
    ratio,
    row_label,
    summarize,
)


def _fmt_spread(x: float | None) -> str:
    """``"±6%"``: half the range of a point's timed steps over their median ("" unknown); a
    noisy point's (:data:`NOISY_SPREAD`) ends in ``*``."""
    if x is None:
        return ""
    return f"±{50 * x:.0f}%" + ("*" if x > NOISY_SPREAD else "")


def _fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant digits, or whole above 100 (``"1,234"``, ``"12.3"``,
    ``"3.30"``, ``"0.0412"``)."""
    ms = 1e3 * seconds
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:#.3g}"


def _fmt_pct(x: float | None) -> str:
    if x is None:
        return "-"
    return "0%" if round(100 * x) == 0 else f"{100 * x:+.0f}%"


def summary_lines(rows: Sequence[Mapping[str, Any]] | Any) -> list[tuple[str, list[str], list]]:
    """The end-of-sweep tables as data: one ``(title, header, body)`` per model/target/batch.

    Each body row is one policy at one sequence length: predicted peak, peak saved vs
    ``no-remat``, activation (residual) bytes saved, compiled-FLOPs ratio, and for measured rows
    the estimated step time (analysis-only tables) and its change vs ``no-remat`` (the
    roofline), the median measured
    step time, slowdown vs ``no-remat`` (wall time; on the CPU backend also CPU time)
    and tokens per second (where known); failures show their status. Rows without a shape (a
    user's program: ``batch_size`` / ``seq_len`` None) leave it out of the title and the
    columns. Figures come from :func:`summarize` (nothing is recomputed).
    """
    records = summarize(rows)
    order = {name: i for i, name in enumerate(policy_names())}
    tables: dict[tuple, list[dict[str, Any]]] = {}
    varied = len({canonical_json(r["overrides"]) for r in records}) > 1  # an option grid
    for r in records:
        key = (r["model"], r["target"], r["batch_size"], r["remat_group_size"], r["mesh"])
        tables.setdefault((*key, canonical_json(r["overrides"]) if varied else ""), []).append(r)
    out = []
    for (model, target, b, k, mesh, overrides), recs in tables.items():
        recs = sorted(recs, key=lambda r: (r["seq_len"] or 0, order.get(r["policy"], len(order))))
        unit, unit_name = units.table_unit([r["peak_bytes"] for r in recs])
        # a second decimal where every peak is under 10 units (a small model's 4.38 vs 4.50 MiB)
        digits = 2 if max((r["peak_bytes"] or 0 for r in recs), default=0) < 10 * unit else 1
        measured = any(r["step_time_s"] is not None for r in recs)
        # a program's rows have no sequence length (its arguments carry the shapes)
        seq = [] if all(r["seq_len"] is None for r in recs) else ["s"]
        header = ["policy", *seq, f"peak {unit_name}", "peak Δ", "act. Δ", "FLOPs x"]
        cpu = measured and any(
            r["backend"] == "cpu" and r["cpu_slowdown"] is not None for r in recs
        )
        fits = any(r["fits"] is not None for r in recs)
        if fits:
            header.append("fits")
        tokens = measured and any(r["tokens_per_s"] is not None for r in recs)  # not a program's
        predicted = any(r["predicted_step_time_s"] is not None for r in recs)
        if measured:  # each estimate beside the measurement it predicts, with its error
            header += ["step ms", *(["est. ms", "est. err"] if predicted else []), "step Δ"]
            header += (["est. Δ"] if predicted else []) + (["CPU Δ"] if cpu else [])
            header += ["tok/s"] if tokens else []
        elif predicted:
            header += ["est. ms", "est. Δ"]
        body = []
        for r in recs:
            if r["status"] != "ok":
                lead = [r["label"], *([str(r["seq_len"])] if seq else []), r["status"]]
                body.append(lead + [""] * (len(header) - len(lead)))
                continue
            same = r["same_program_as"]
            line = [
                r["label"] + (f" (same program as {same})" if same else ""),
                *([str(r["seq_len"])] if seq else []),
                units.in_unit(r["peak_bytes"], unit, digits),
                _fmt_pct(None if r["peak_saved"] is None else -r["peak_saved"]),
                _fmt_pct(None if r["activation_saved"] is None else -r["activation_saved"]),
                "-" if r["flops_ratio"] is None else f"{r['flops_ratio']:.2f}",
            ]
            if fits:
                line.append({True: "yes", False: "no"}.get(r["fits"], "-"))
            est = r["predicted_step_time_s"]
            est_ms = "-" if est is None else _fmt_ms(est)
            if measured:
                step = r["step_time_s"]
                line.append("-" if step is None else _fmt_ms(step) + _fmt_spread(r["step_spread"]))
                line += [est_ms, _fmt_pct(r["estimate_error"])] if predicted else []
                line.append(_fmt_pct(r["slowdown"]))
                line += [_fmt_pct(r["predicted_slowdown"])] if predicted else []
                line += [_fmt_pct(r["cpu_slowdown"])] if cpu else []
                if tokens:
                    line.append("-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}")
            elif predicted:
                line += [est_ms, _fmt_pct(r["predicted_slowdown"])]
            body.append(line)
        grp = f", remat_group_size={k}" if k not in (None, 1) else ""
        where = f"{target}, mesh {mesh} (figures per device)" if mesh else target
        opts = f", overrides {overrides}" if overrides else ""
        batch = f", batch {b}" if b is not None else ""
        out.append((f"{model} on {where}{batch}{grp}{opts}", header, body))
    return out


#: Columns of the summary tables left out first on a narrow terminal (summary.md keeps them).
OPTIONAL_COLUMNS = ("CPU Δ", "tok/s", "est. Δ")


def print_summary(rows: Sequence[Mapping[str, Any]] | Any, console: Any = None) -> None:
    """Print :func:`summary_lines` as rich tables fitted to the console's width
    (:func:`remat_kit.terminal.fit_table`): headers wrap at spaces, then the columns of
    :data:`OPTIONAL_COLUMNS` go (the caption says which), then labels wrap at spaces. Figures
    and policy names are never cut: a console too narrow even then gets the table at the width
    it needs, every column in it."""
    import copy

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from remat_kit.terminal import fit_table

    console = console or Console()
    for title, header, body in summary_lines(rows):
        # no edges, two spaces between columns
        table = Table(
            title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
            pad_edge=False, collapse_padding=True,
        )  # fmt: skip
        table.add_column(header[0], overflow="fold")
        for h in header[1:]:
            table.add_column(h, justify="right", overflow="fold")
        for line in body:
            table.add_row(*line)
        whole = copy.deepcopy(table)
        needed = fit_table(table, console.width, OPTIONAL_COLUMNS, "summary.md has them")
        if needed > console.width:  # print it as narrow as it goes (the terminal wraps)
            table = whole
            needed = fit_table(table, 0)
        width = console.width
        console.width = max(width, needed)  # print(width=) cannot exceed the console's width
        try:
            console.print(table)
        finally:
            console.width = width


#: What each column of :func:`summary_lines` means, in table order ("peak" stands for the
#: ``peak GiB`` / ``peak MiB`` column): :func:`summary_legend` lists those a file's tables have.
COLUMN_LEGEND = {
    "peak": "peak: the analyzer's predicted peak",
    "peak Δ": "peak Δ / act. Δ: change vs no-remat (act.: residual bytes kept for the backward "
    "pass)",
    "FLOPs x": "FLOPs x: compiled matmul FLOPs over the no-remat step's",
    "fits": "fits: predicted peak within the target's memory",
    "step ms": "step ms / step Δ: median measured step (wall), ± half the range of the "
    "point's own timed steps over their median (a step Δ within two points' ± is noise; * "
    f"noisy: beyond ±{50 * NOISY_SPREAD:.0f}%, never on a Pareto frontier), and its change vs "
    "no-remat",
    "est. ms": "est. ms: the estimated step time (roofline over the compiled kernels, "
    "docs/time-model.md)",
    "est. err": "est. err: the estimate against the measured step (est. / step - 1)",
    "est. Δ": "est. Δ: the estimated step time's change vs no-remat's estimate",
    "CPU Δ": "CPU Δ: the change in process CPU time",
    "tok/s": "tok/s: tokens per second measured",
}


def summary_legend(rows: Sequence[Mapping[str, Any]] | Any) -> str:
    """The meaning of every column the tables of :func:`summary_lines` have for ``rows``, in
    :data:`COLUMN_LEGEND`'s order, joined by "; " ("" without a table)."""
    present = {
        "peak" if column.startswith("peak ") and column != "peak Δ" else column
        for _, header, _ in summary_lines(rows)
        for column in header
    }
    return "; ".join(text for column, text in COLUMN_LEGEND.items() if column in present)


def local_estimate_source(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """Where the local rows' estimated step times come from: the device figures' source of the
    first row on the local device with an estimate (on a CPU, the calibration cached for this
    machine: when it was timed, at what load, its figures), else None. An estimate is only as
    good as that calibration: one timed on a busy machine prices memory traffic too high."""
    for r in as_records(rows):
        step = (r.get("report") or {}).get("step_time") or {}
        if r.get("target") == "local" and step.get("figures"):
            return str(step["figures"])
    return None


#: A timed load average this much above the calibration's is said beside the estimates.
_LOAD_GAP = 1.0


def _own_cores(row: Mapping[str, Any]) -> float:
    """The cores a row's own timed steps kept busy: median process CPU time over median wall
    time (0 where either is unknown)."""
    cpu, wall = row.get("step_cpu_s"), row.get("step_time_s")
    return cpu / wall if cpu and wall else 0.0


def local_calibration(rows: Iterable[Mapping[str, Any]] | Any) -> dict[str, Any] | None:
    """The machine's state while the local device was calibrated, as the first local row with
    an estimate records it (:class:`remat_kit.memory.calibration.Calibration`: ``others_share``,
    ``load_average``, ``contended``); None without one. Rows written before the estimate
    carried it are read from its figures' source line."""
    for r in as_records(rows):
        step = (r.get("report") or {}).get("step_time") or {}
        if r.get("target") != "local" or not step.get("figures"):
            continue
        if step.get("calibration") is not None:
            return dict(step["calibration"])
        return _calibration_of_source(str(step["figures"]))
    return None


def _calibration_of_source(source: str) -> dict[str, Any] | None:
    """:func:`local_calibration` of a row written before the estimate carried the fields."""
    share = re.search(r"other processes (\d+)% of the cores", source)
    load = re.search(r"load average ([0-9.]+)", source)
    if not (share or load):
        return None
    return {
        "others_share": int(share.group(1)) / 100 if share else None,
        "load_average": float(load.group(1)) if load else None,
        "contended": "; contended" in source,
    }


def load_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """A note when the measured rows and the local device's calibration
    (:func:`local_calibration`: the share of the cores other processes used while it was timed
    and the load average) saw the machine in different states: a calibration timed beside
    other work prices the machine too slow (estimates above the measured steps); steps timed
    on a busier machine than the calibration run slower than estimated. None when neither
    holds or nothing is known."""
    rows = as_records(rows)
    calibration = local_calibration(rows) or {}
    notes = []
    share = calibration.get("others_share")
    if calibration.get("contended"):
        used = (
            f"while other processes used {share:.0%} of the cores"
            if share is not None
            else "beside other work"
        )
        notes.append(
            f"the local device was calibrated {used}: its rates are below an idle machine's, "
            f"so the estimates run higher than idle cores would give them (est. err reads "
            f"higher; steps timed on a machine busier still can read below); it is timed again "
            f"when asked "
            f"{RETIME_AFTER_S / 60:.0f} min after, the quieter kept (or delete "
            f"{cache_dir() / 'calibration'} and run again on idle cores)"
        )
    calibrated = calibration.get("load_average")
    timed = [r for r in rows if r.get("load_average")]
    loads = [r["load_average"][0] for r in timed]
    # the sweep's own threads load the machine too: their cores (process CPU time over wall
    # time of its steps) are not other work
    others = [max(0.0, r["load_average"][0] - _own_cores(r)) for r in timed]
    if calibration and calibrated is None and others and max(others) >= _LOAD_GAP:
        notes.append(  # a calibration file from before its load was a field
            f"the steps were timed at load average {units.format_span(loads)} (other work "
            f"about {units.format_span(others)} of it beside the sweep's own steps) and the "
            "local device's calibration does not record its load: if it was timed on a quieter "
            "machine, measured steps run slower than estimated (est. err); delete "
            f"{cache_dir() / 'calibration'} to time it again"
        )
    if calibrated is not None and others and max(others) - float(calibrated) >= _LOAD_GAP:
        notes.append(
            f"the steps were timed at load average {units.format_span(loads)} (other work "
            f"about {units.format_span(others)} of it beside the sweep's own steps), the "
            f"local device calibrated at {float(calibrated):.2f}: the estimates price the "
            "machine as calibrated, so on the busier machine measured steps run slower than "
            "estimated (est. err) and their spread widens; time on idle cores to compare the two"
        )
    return "; ".join(notes) or None


def measured_peak_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """A line when no timed row has a measured peak: the peak columns are then the analyzer's
    alone, and the rows record null and why (``measured_peak_note``: on the CPU, the backend
    reports no ``peak_bytes_in_use``); None when some row has one or none was timed."""
    timed = [r for r in as_records(rows) if r.get("step_time_s") is not None]
    if not timed or any(r.get("measured_peak_bytes") is not None for r in timed):
        return None
    why = timed[0].get("measured_peak_note") or "not reported"
    return f"measured peak: null on every timed row ({why}); the peaks shown are the analyzer's"


def cpu_faster_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """One line where a policy measured faster than its group's no-remat on the CPU backend
    (a negative step Δ, though it does as much arithmetic or more): XLA:CPU allocates each
    step's temp buffer afresh and faults in its pages every step, and no-remat's is the
    largest (the ratio of the rows' ``temp_bytes``; docs/time-model.md, "What it counts").
    None where no such row was timed."""
    records = as_records(rows)
    base = {group_key(r): r for r in records if r.get("policy") == "no-remat"
            and r.get("status") == "ok"}  # fmt: skip
    ratios = []
    for r in records:
        b = base.get(group_key(r))
        if (
            b is None or r is b or r.get("status") != "ok" or r.get("backend") != "cpu"
            or not r.get("step_time_s") or not b.get("step_time_s")
            or r["step_time_s"] >= b["step_time_s"]
        ):  # fmt: skip
            continue
        ratios.append(ratio(b.get("temp_bytes"), r.get("temp_bytes")))
    if not ratios:
        return None
    known = [x for x in ratios if x]
    size = f"{units.format_span(known, 1)}x theirs" if known else "the largest"
    return (
        f"remat ran faster than no-remat on the CPU in {len(ratios)} row(s): XLA:CPU faults in "
        f"each step's fresh temp buffer page by page, and no-remat's is {size} "
        "(docs/time-model.md)"
    )


def no_remat_slower_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """One line naming the analysed groups (model, shape, target) whose no-remat step is
    estimated slower than a recomputing policy's on datasheet figures, with the cause analyze
    gives under its table (:data:`remat_kit.memory.roofline.NO_REMAT_SLOWER`); None where
    none is, or a group's steps were timed."""
    groups: dict[tuple, dict[str, float]] = {}
    names: dict[tuple, str] = {}
    timed: set[tuple] = set()
    for r in as_records(rows):
        step = (r.get("report") or {}).get("step_time") or {}
        if r.get("status") != "ok" or step.get("measured_figures"):
            continue
        key = group_key(r)
        if r.get("step_time_s") is not None:
            timed.add(key)
        if r.get("predicted_step_time_s") is not None:
            groups.setdefault(key, {})[row_label(r)] = r["predicted_step_time_s"]
            shape = f"b={r.get('batch_size')} s={r.get('seq_len')}"
            names[key] = f"{r.get('model')} {shape} on {r.get('target')}"
    parts = []
    for key, times in groups.items():
        slower = None if key in timed else roofline.no_remat_slower_by(times)
        if slower is not None:
            parts.append(f"{names[key]}: {slower[1]:.0%} slower than {slower[0]}")
    if not parts:
        return None
    return f"no-remat is estimated slower than recomputing ({'; '.join(parts)}): " + (
        roofline.NO_REMAT_SLOWER
    )


def small_step_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """:func:`remat_kit.memory.roofline.small_step_note` for the rows' estimates on the
    calibrated local device (as analyze and recommend say it under their tables), or None."""
    local = [
        r for r in as_records(rows)
        if r.get("target") == "local"
        and ((r.get("report") or {}).get("step_time") or {}).get("measured_figures")
    ]  # fmt: skip
    timed = any(r.get("step_time_s") is not None for r in local)
    return roofline.small_step_note(
        (r.get("predicted_step_time_s") for r in local), bool(local), timed=timed
    )


def summary_markdown(rows: Sequence[Mapping[str, Any]] | Any) -> str:
    """:func:`summary_lines` as Markdown tables (for a summary file or a README)."""
    parts = []
    for title, header, body in summary_lines(rows):
        parts.append(f"**{title}**\n")
        parts.append("| " + " | ".join(header) + " |")
        parts.append("|" + "|".join(["---"] + ["--:"] * (len(header) - 1)) + "|")
        parts += ["| " + " | ".join(line) + " |" for line in body]
        parts.append("")
    return "\n".join(parts)
