"""What the interactive report shows: one :class:`Entry` per policy (or candidate), gathered in
:class:`Group` s of entries that are compared with one another (one model, shape and target).

Built from :class:`~remat_kit.memory.MemoryReport` s (``analyze``), sweep rows (each carries its
report's ``to_dict()`` and, when run, the measured step time) or a recommendation's candidates
(figures only, no timeline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from remat_kit.doctor.findings import Finding
from remat_kit.memory.report import MemoryReport
from remat_kit.sweep import results as R


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the policy table and one point of the trade-off plot.

    Attributes:
      label: the policy (or candidate) as the table names it.
      peak_bytes: compiled device peak, bytes per device (None: unknown or failed).
      host_bytes: bytes in host memory (offloaded).
      step_time_s: the time model's estimated step time, seconds (None where not estimated).
      measured_step_time_s: the median measured step time, seconds (None where not run).
      recompute_ratio: matmul FLOPs over the no-remat step's (the policy's own).
      fits: peak within the budget (None: unknown, e.g. no budget on a CPU).
      report: the full report (timeline, buffers, residuals), when there is one.
      findings: the doctor's findings for this policy; None when the doctor did not run
        (``()``: it ran and found nothing).
      notes: lines worth reading (warnings of the compile, how it was chosen).
      error: why there is no analysis (a failed compile, an OOM row), else None.
    """

    label: str
    peak_bytes: int | None
    host_bytes: int | None
    step_time_s: float | None
    measured_step_time_s: float | None
    recompute_ratio: float | None
    fits: bool | None
    report: MemoryReport | None = None
    findings: tuple[Finding, ...] | None = None
    notes: tuple[str, ...] = ()
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Group:
    """Entries compared with one another (same step and target): a title (what the page's
    group menu shows), shared notes, and the target they were compiled for (a
    :mod:`remat_kit.targets` name; None where unknown), which the page's header names."""

    title: str
    entries: tuple[Entry, ...]
    notes: tuple[str, ...] = ()
    target: str | None = None


def entry_of_report(
    report: MemoryReport,
    label: str | None = None,
    *,
    findings: Sequence[Finding] | None = None,
    notes: Sequence[str] = (),
    measured_step_time_s: float | None = None,
) -> Entry:
    """The entry of one report. The estimated step time is ``report.step_time_s`` where the
    report has that field (the roofline time model), else None."""
    return Entry(
        label=label or report.policy or report.name,
        peak_bytes=report.peak_bytes,
        host_bytes=report.host_bytes,
        step_time_s=getattr(report, "step_time_s", None),
        measured_step_time_s=measured_step_time_s,
        recompute_ratio=report.recompute_ratio,
        fits=report.fits,
        report=report,
        findings=None if findings is None else tuple(findings),
        notes=tuple(notes) + tuple(report.warnings),
    )


def group_of_reports(
    reports: Sequence[MemoryReport | BaseException],
    labels: Sequence[str] | None = None,
    *,
    findings: Sequence[Sequence[Finding]] | None = None,
    notes: Sequence[str] = (),
    title: str | None = None,
) -> Group:
    """A group from :func:`~remat_kit.memory.analyze_policies`' results (a failed compile, an
    exception, becomes an entry with its ``error``).

    Raises:
      ValueError: ``labels`` or ``findings`` not one per report; no report at all.
    """
    labels = list(labels) if labels is not None else [None] * len(reports)
    per = list(findings) if findings is not None else [None] * len(reports)
    if len(labels) != len(reports) or len(per) != len(reports):
        raise ValueError(
            f"got {len(reports)} reports, {len(labels)} labels and {len(per)} finding lists: "
            "give one label and one finding list per report"
        )
    ok = [r for r in reports if isinstance(r, MemoryReport)]
    if not ok:
        raise ValueError("no report to show: every compile failed")
    entries = []
    for r, label, f in zip(reports, labels, per, strict=True):
        if isinstance(r, MemoryReport):
            entries.append(entry_of_report(r, label, findings=f))
        else:
            name = label or getattr(r, "what", type(r).__name__)
            entries.append(_failed(name, str(r)))
    return Group(title or _title_of(ok[0]), tuple(entries), tuple(notes), target=ok[0].target)


def _failed(label: str, error: str) -> Entry:
    return Entry(label, None, None, None, None, None, None, error=error)


def _title_of(r: MemoryReport) -> str:
    return group_title(r.model or r.name, r.batch_size, r.seq_len, None, r.target)


def group_title(
    what: str,
    batch_size: int | None,
    seq_len: int | None,
    overrides: Mapping[str, Any] | None,
    target: str | None,
    mesh: Any = None,
) -> str:
    """A group's name as a reader reads it: ``"gpt-10m b=4 s=128 scan_layers=True @ local"``
    (the shape where known, the overrides as ``key=value``, the target after ``@``)."""
    parts = [what]
    parts += [f"{k}={v}" for k, v in (("b", batch_size), ("s", seq_len)) if v is not None]
    parts += [f"{k}={v}" for k, v in (overrides or {}).items()]
    where = f" @ {target}" if target else ""
    return " ".join(parts) + where + (f" mesh {mesh}" if mesh else "")


def groups_of_rows(rows: Sequence[Mapping[str, Any]]) -> list[Group]:
    """Sweep rows (:mod:`remat_kit.sweep.results`) as groups: one per model, shape, target and mesh
    (:func:`remat_kit.sweep.results.group_key`), in file order. A row's ``step_time_s`` is the
    measured one; the estimate is its report's, where it has one."""
    groups: dict[tuple, list[tuple[Mapping[str, Any], str | None]]] = {}
    for row, same in zip(rows, R.same_program_as(rows), strict=True):
        groups.setdefault(R.group_key(row), []).append((row, same))
    out = []
    for pairs in groups.values():
        entries = []
        members = [row for row, _ in pairs]
        for row, same in pairs:
            label = R.row_label(row) + (f" (same program as {same})" if same else "")
            if row.get("status") != "ok" or not row.get("report"):
                entries.append(_failed(label, row.get("error") or row.get("status") or "no report"))
                continue
            report = MemoryReport.from_dict(_known_fields(row["report"]))
            entries.append(
                dataclasses.replace(
                    entry_of_report(report, label, measured_step_time_s=row.get("step_time_s")),
                    step_time_s=row["report"].get("step_time_s"),
                )
            )
        first = members[0]
        title = group_title(
            first.get("model") or first.get("program") or "?",
            first.get("batch_size") if first.get("seq_len") is not None else None,
            first.get("seq_len"),
            first.get("overrides"),
            first.get("target"),
            first.get("mesh"),
        )
        out.append(Group(title, tuple(entries), target=first.get("target")))
    return out


def _known_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """A report dict without fields this version's :class:`MemoryReport` does not have (a row
    written by a newer remat-kit)."""
    names = {f.name for f in dataclasses.fields(MemoryReport)}
    return {k: v for k, v in data.items() if k in names}


def group_of_recommendation(rec: Any) -> Group:
    """A :class:`~remat_kit.recommend.Recommendation` as a group: its candidates (figures only:
    a recommendation keeps no timelines), the pick marked, its notes."""
    entries = []
    for c in rec.candidates:
        mark = "* " if c is rec.pick else ""
        ratio = c.flops / c.flops_no_remat if c.flops and c.flops_no_remat else None
        opts = f" [{c.options_label}]" if getattr(c, "options", None) else ""
        shape = f" group {c.remat_group_size} batch {c.batch_size}" if c.batch_size else ""
        entries.append(
            Entry(
                label=f"{mark}{c.label}{opts}{shape}",
                peak_bytes=c.peak_bytes,
                host_bytes=c.host_bytes,
                step_time_s=c.step_time_s,
                measured_step_time_s=None,
                recompute_ratio=ratio,
                fits=c.fits,
                notes=(f"found by {c.found_by}", *c.warnings),
            )
        )
    seq = f" s={rec.seq_len}" if rec.seq_len is not None else ""
    notes = [f"budget {rec.budget_bytes} bytes per device ({rec.budget_note})", *rec.notes]
    if rec.pick is not None:
        notes.append(f"pick: {rec.line()}")
    else:
        notes += [f"nothing fits; what would: {a}" for a in rec.advice]
    return Group(
        f"recommend: {rec.model}{seq} @ {rec.target}", tuple(entries), tuple(notes), rec.target
    )
