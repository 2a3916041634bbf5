"""Two policies of one step side by side: residuals by tag, peaks, FLOPs, what is live at each
peak, and what moved between device and host.

Example::

    a, b = remat_kit.analyze_policies(remat_kit.preset("llama3-8b", 1, 8192),
                                      ["save-nothing", "offload-layer-inputs"],
                                      target="h100-sxm")
    print(diff_reports(a, b).to_text())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from remat_kit.memory.report import MemoryReport
from remat_kit.terminal import group_notes
from remat_kit.units import format_bytes, format_flops


@dataclasses.dataclass(frozen=True)
class DiffRow:
    """One compared figure: its name, A's and B's values (None: unknown) and its unit
    (``bytes``, ``flops``, ``ratio`` or ``text``)."""

    name: str
    a: float | str | None
    b: float | str | None
    unit: str

    @property
    def change(self) -> float | None:
        """``b - a`` for numbers known on both sides."""
        if isinstance(self.a, (int, float)) and isinstance(self.b, (int, float)):
            return self.b - self.a
        return None


@dataclasses.dataclass(frozen=True)
class PolicyDiff:
    """The comparison of two reports of the same step (see :func:`diff_reports`).

    Attributes:
      a, b: the policies compared (``report.policy`` or ``report.name``).
      figures: peak, live peak, host bytes, FLOPs, recompute ratios (policy's own and as
        compiled), the policy-only peak where XLA's own remat fired.
      residuals: device and host residual bytes per checkpoint tag (all layers, from the jaxpr).
      at_peak: device bytes by timeline category at each report's live peak.
      moved: tags kept on device by one policy and offloaded to host by the other
        (``"decoder_layer_input: device -> host"``).
      peak_buffers: the largest buffers live at each peak: ``(A's, B's)`` lines.
    """

    a: str
    b: str
    figures: tuple[DiffRow, ...]
    residuals: tuple[DiffRow, ...]
    at_peak: tuple[DiffRow, ...]
    moved: tuple[str, ...]
    peak_buffers: tuple[tuple[str, ...], tuple[str, ...]]

    def to_text(self) -> str:
        """A plain-text table (GiB / MiB for bytes, GFLOP / TFLOP ... for FLOPs), then the
        buffers."""
        lines = [f"{'':34} {self.a:>20} {self.b:>20} {'change':>14}"]
        for title, rows in (
            ("", self.figures),
            ("residuals by tag", self.residuals),
            ("live at the peak, by category", self.at_peak),
        ):
            if title and rows:
                lines.append(f"-- {title}")
            lines += [_row_text(r) for r in rows]
        if self.moved:
            lines.append("-- moved between device and host: " + "; ".join(self.moved))
        for label, bufs in zip((self.a, self.b), self.peak_buffers, strict=True):
            lines.append(f"-- largest buffers at the peak of {label}")
            lines += [f"   {line}" for line in bufs]
        return "\n".join(lines)


def _fmt(value: float | str | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        return format_bytes(value)
    if unit == "flops":
        return format_flops(value)
    if unit == "ratio":
        return f"x{value:.3f}"
    return str(value)


def _row_text(row: DiffRow) -> str:
    change = row.change
    delta = ""
    if change is not None:
        delta = ("+" if change >= 0 else "-") + _fmt(abs(change), row.unit).lstrip("x")
    return f"{row.name:34} {_fmt(row.a, row.unit):>20} {_fmt(row.b, row.unit):>20} {delta:>14}"


def _residual_rows(a: MemoryReport, b: MemoryReport) -> tuple[list[DiffRow], list[str]]:
    def by_tag(r: MemoryReport) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for row in r.residuals:
            out[(row.tag, row.memory)] = out.get((row.tag, row.memory), 0) + row.nbytes
        return out

    ta, tb = by_tag(a), by_tag(b)
    rows = [
        DiffRow(f"{tag} ({memory})", ta.get((tag, memory), 0), tb.get((tag, memory), 0), "bytes")
        for tag, memory in sorted(set(ta) | set(tb))
    ]
    moved = []
    for tag in sorted({t for t, _ in ta} | {t for t, _ in tb}):
        where_a = {m for t, m in ta if t == tag}
        where_b = {m for t, m in tb if t == tag}
        if where_a and where_b and where_a != where_b:
            moved.append(f"{tag}: {'+'.join(sorted(where_a))} -> {'+'.join(sorted(where_b))}")
    return rows, moved


def _buffers(r: MemoryReport, top: int) -> tuple[str, ...]:
    if r.timeline is not None:
        return tuple(
            f"{format_bytes(x.nbytes):>12}  {x.category:28} {x.shape}  {x.value}"
            for x in r.timeline.peak_buffers[:top]
        )
    return tuple(
        f"{format_bytes(x.nbytes):>12}  {x.kind:28} {x.shape}  {x.value}"
        for x in r.peak_buffers[:top]
    )


def _at_peak_rows(a: MemoryReport, b: MemoryReport) -> list[DiffRow]:
    """Device bytes at each report's live peak, one row per timeline category (0 where a report
    has no timeline or not that category)."""
    peak_a = a.timeline.at_peak() if a.timeline else {}
    peak_b = b.timeline.at_peak() if b.timeline else {}
    order = list(peak_a) + [c for c in peak_b if c not in peak_a]
    return [DiffRow(c, peak_a.get(c, 0), peak_b.get(c, 0), "bytes") for c in order]


def diff_reports(a: MemoryReport, b: MemoryReport, top: int = 5) -> PolicyDiff:
    """Compare two reports of the same step (same model, shape and target; any policies).

    Args:
      a: a report from :func:`~remat_kit.memory.analyze_model` /
        :func:`~remat_kit.memory.analyze_policies`.
      b: another report of the same step.
      top: how many of the largest buffers at each peak to list.

    Raises:
      ValueError: the reports are of different steps or targets (``name`` or ``target``
        differ).
    """
    if (a.name, a.target) != (b.name, b.target):
        raise ValueError(
            f"cannot compare {a.name!r} on {a.target!r} with {b.name!r} on {b.target!r}: "
            "diff two policies of the same step and target"
        )
    pa, pb = a.policy_only, b.policy_only
    figures = [
        DiffRow("peak (as run)", a.peak_bytes, b.peak_bytes, "bytes"),
        DiffRow("live peak (as run)", a.live_peak_bytes, b.live_peak_bytes, "bytes"),
        DiffRow(
            "peak of the policy alone",
            pa.peak_bytes if pa else a.peak_bytes,
            pb.peak_bytes if pb else b.peak_bytes,
            "bytes",
        ),
        DiffRow("host bytes", a.host_bytes, b.host_bytes, "bytes"),
        DiffRow("matmul FLOPs (as run)", a.flops, b.flops, "flops"),
        DiffRow("recompute ratio (policy's own)", a.recompute_ratio, b.recompute_ratio, "ratio"),
        DiffRow(
            "recompute ratio (as compiled)",
            a.compiled_recompute_ratio,
            b.compiled_recompute_ratio,
            "ratio",
        ),
        DiffRow(
            "XLA remat instructions",
            pa.xla_remat_instructions if pa else 0,
            pb.xla_remat_instructions if pb else 0,
            "text",
        ),
    ]
    residuals, moved = _residual_rows(a, b)
    return PolicyDiff(
        a=a.policy or a.name,
        b=b.policy or b.name,
        figures=tuple(figures),
        residuals=tuple(residuals),
        at_peak=tuple(_at_peak_rows(a, b)),
        moved=tuple(moved),
        peak_buffers=(_buffers(a, top), _buffers(b, top)),
    )


def peak_inversions(
    reports: Sequence[MemoryReport], labels: Sequence[str], most: int = 3
) -> list[str]:
    """One line for each policy that keeps fewer residual bytes than another of the same step yet
    peaks higher (against the one it peaks most above), at most ``most``, largest gap first: a
    saved tensor can move the peak to another point of XLA's schedule. Each line says where each
    peak falls and how the bytes live there differ by category (from the timelines); policies of
    one program share one line (:func:`remat_kit.terminal.group_notes`). Reports without a
    timeline or residual figure are passed over.

    Raises:
      ValueError: ``reports`` and ``labels`` differ in length.
    """
    if len(reports) != len(labels):
        raise ValueError(f"{len(reports)} reports but {len(labels)} labels")
    known = [
        (label, r)
        for label, r in zip(labels, reports, strict=True)
        if r.timeline is not None and r.activation_bytes is not None and r.peak_bytes
    ]
    found = []
    for la, a in known:
        over = [
            (a.peak_bytes - b.peak_bytes, lb, b)
            for lb, b in known
            if b.activation_bytes > a.activation_bytes and b.peak_bytes < a.peak_bytes  # type: ignore[operator]
        ]
        if not over:
            continue
        gap, lb, b = max(over, key=lambda x: x[0])
        change: dict[str, int] = {}  # a's bytes less b's, the residual:* categories as one
        for row in _at_peak_rows(b, a):
            kind = "residuals" if row.name.startswith("residual:") else row.name
            change[kind] = change.get(kind, 0) + int(row.change or 0)
        moved = sorted(change.items(), key=lambda kv: -abs(kv[1]))
        parts = [
            f"{k} {'+' if d > 0 else '-'}{format_bytes(abs(d))}"
            for k, d in moved[:3]
            if abs(d) >= 0.01 * a.peak_bytes
        ]
        pa = a.timeline.phase_at(a.timeline.peak_position) or "unknown"  # type: ignore[union-attr]
        pb = b.timeline.phase_at(b.timeline.peak_position) or "unknown"  # type: ignore[union-attr]
        where = f"both in the {pa} pass" if pa == pb else f"its in the {pa}, {lb}'s in the {pb}"
        found.append((gap, la, (
            f"peaks {format_bytes(gap)} above {lb} though it keeps "
            f"{format_bytes(b.activation_bytes - a.activation_bytes)} fewer residuals "  # type: ignore[operator]
            f"({where}): at the two peaks it holds "
            + (", ".join(parts) or "about the same by category")
            + f" against {lb}; a peak is everything live at one point of XLA's schedule"
        )))  # fmt: skip
    ranked = sorted(found, key=lambda x: -x[0])
    lines = group_notes([(label, [text]) for _, label, text in ranked], everyone=None)
    return lines[:most]
