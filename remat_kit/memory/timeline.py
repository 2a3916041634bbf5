"""Live device bytes over one compiled step: XLA's schedule, its live ranges, buffer assignment.

Live ranges (``*-live-range.txt``, loop bodies once) and allocations
(``*buffer-assignment.txt``) give one slot per set of aliasing values, at its largest value's
size; the slots' sum over the schedule peaks at the live peak (XLA's own "peak" moment does not
merge aliases). Categories: argument names (``params``, ``opt_state``, ``batch``),
``gradients``, ``residual:<tag>`` (forward values live when the backward starts;
``residual:untagged``, ``residual:other``), ``logits``, ``temporaries``; phases from ``op_name``
(``transpose(...)``: backward).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from remat_kit import names as N
from remat_kit.memory import hlo
from remat_kit.memory.hlo import LiveRanges

#: At most this many points are kept (the highest point of each bucket: the peak is kept).
DEFAULT_MAX_POINTS = 2000
#: Residual categories beyond this many (by bytes at the peak) are merged into ``residual:other``.
MAX_RESIDUAL_CATEGORIES = 8
#: ... and so are those never above this fraction of the peak.
SMALL_FRACTION = 0.002
TOP_BUFFERS = 10
#: Buffers kept with their live ranges (:attr:`Timeline.spans`): at most this many, largest
#: first, ...
MAX_SPANS = 300
#: ... and none below this fraction of the live peak.
SPAN_FRACTION = 0.002
#: The residual category of values under no checkpoint name (whatever operation made them).
UNTAGGED = "untagged"

_ARGUMENT_CATEGORIES = ("params", "opt_state")


class NamingHints(Protocol):
    """What a model job knows that names buffers (see ``remat_kit.memory.reading.Hints``)."""

    logits_elems: int | None
    stacked: Mapping[str, tuple[str, ...]]
    param_shapes: frozenset[str]


@dataclasses.dataclass(frozen=True)
class TimelineBuffer:
    """One buffer (a slot's run of aliasing values) live at the peak.

    Attributes:
      value: XLA's name of its most telling value (``"while.24{3}"``).
      category: as :class:`Timeline` categories.
      nbytes: bytes. shape: XLA's shape text (``"bf16[32,1,8192,4096]"``).
      op_name: the JAX ``op_name`` of the instruction that made it, "" if none.
    """

    value: str
    category: str
    nbytes: int
    shape: str
    op_name: str


@dataclasses.dataclass(frozen=True)
class LiveSpan:
    """One buffer (a slot's run of aliasing values) and the schedule positions it is live at.

    Attributes:
      value, category, nbytes, shape, op_name: as :class:`TimelineBuffer` (``nbytes``: the
        most bytes the slot holds while live).
      start, end: first and last schedule position it is live at (inclusive), in positions of
        ``Timeline.positions``' schedule.
    """

    value: str
    category: str
    nbytes: int
    shape: str
    op_name: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Live bytes at each point of XLA's schedule of one compiled step, by category.

    Attributes:
      length: instructions in XLA's flattened schedule (loop bodies once).
      positions: the schedule positions kept (at most ``max_points``; each kept point is the
        highest of its bucket, so the peak is always kept).
      categories: category names, in stacking order (see the module docstring).
      device_bytes: per category, the device bytes live at each kept position
        (``[categories][points]``).
      host_bytes: host-memory bytes live at each kept position (offloaded values), or None
        when nothing lives in host memory.
      phases: ``(name, start, end)`` schedule spans of ``forward``, ``backward`` and
        ``optimizer`` (end exclusive); empty when the program has no backward pass.
      peak_bytes: the most device bytes live at one position; peak_position: where.
      peak_instruction: the instruction at the peak and its ``op_name``.
      peak_buffers: the largest buffers live at the peak, largest first.
      spans: the largest device buffers of the whole step with their live ranges (at most
        ``MAX_SPANS``, none under ``SPAN_FRACTION`` of the peak), largest first: what is live at
        any point (the interactive report's hover); empty in reports written before it existed.
    """

    length: int
    positions: tuple[int, ...]
    categories: tuple[str, ...]
    device_bytes: tuple[tuple[int, ...], ...]
    host_bytes: tuple[int, ...] | None
    phases: tuple[tuple[str, int, int], ...]
    peak_bytes: int
    peak_position: int
    peak_instruction: str
    peak_buffers: tuple[TimelineBuffer, ...]
    spans: tuple[LiveSpan, ...] = ()

    def totals(self) -> list[int]:
        """Device bytes live at each kept position (all categories)."""
        return [sum(col) for col in zip(*self.device_bytes, strict=True)] if self.categories else []

    def at_peak(self) -> dict[str, int]:
        """Device bytes by category at the peak."""
        i = self.positions.index(self.peak_position)
        return {c: row[i] for c, row in zip(self.categories, self.device_bytes, strict=True)}

    def phase_at(self, position: int) -> str | None:
        """The phase a schedule position belongs to (None outside them)."""
        return next((p for p, a, b in self.phases if a <= position < b), None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        """Inverse of ``dataclasses.asdict`` (JSON lists back to tuples)."""
        host = data.get("host_bytes")
        return cls(
            length=data["length"],
            positions=tuple(data["positions"]),
            categories=tuple(data["categories"]),
            device_bytes=tuple(tuple(r) for r in data["device_bytes"]),
            host_bytes=None if host is None else tuple(host),
            phases=tuple((p, a, b) for p, a, b in data["phases"]),
            peak_bytes=data["peak_bytes"],
            peak_position=data["peak_position"],
            peak_instruction=data["peak_instruction"],
            peak_buffers=tuple(TimelineBuffer(**b) for b in data["peak_buffers"]),
            spans=tuple(LiveSpan(**b) for b in data.get("spans", ())),
        )

    def live_at(self, position: int) -> list[LiveSpan]:
        """The buffers of :attr:`spans` live at a schedule position, largest first."""
        return [s for s in self.spans if s.start <= position <= s.end]


# -- Reading the dumps ------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """Aliasing values of one slot whose live ranges touch: one buffer over time."""

    values: list[str]
    start: int
    end: int
    nbytes: int
    on_host: bool
    sizes: list[tuple[int, int, int]]  # (start, end, bytes) of each value


def _value_bytes(value: str, instrs: Mapping[str, tuple[hlo.Instruction, Any]]) -> int:
    found = instrs.get(value.split("{")[0])
    if found is None:
        return 0
    arrays = hlo.array_shapes(found[0].shape)
    m = re.search(r"\{(\d+)", value)
    index = int(m.group(1)) if m else 0
    if not arrays or index >= len(arrays):
        return 0
    dtype, dims = arrays[index if found[0].shape.startswith("(") else 0]
    return hlo.shape_bytes(dtype, dims)


def _runs(
    live: LiveRanges,
    slots: Mapping[str, hlo.BufferSlot],
    instrs: Mapping[str, tuple[hlo.Instruction, Any]],
) -> list[_Run]:
    by_slot: dict[object, list[tuple[int, int, str]]] = {}
    for value, (a, b) in live.ranges.items():
        slot = slots.get(value)
        key = (slot.allocation, slot.offset) if slot else value
        by_slot.setdefault(key, []).append((a, b, value))
    runs: list[_Run] = []
    for values in by_slot.values():
        values.sort()
        current: _Run | None = None
        for a, b, value in values:
            slot = slots.get(value)
            size = slot.nbytes if slot else _value_bytes(value, instrs)
            host = bool(slot and slot.on_host)
            if current is None or a > current.end:
                current = _Run([], a, b, 0, host, [])
                runs.append(current)
            current.values.append(value)
            current.end = max(current.end, b)
            current.nbytes = max(current.nbytes, size)
            current.sizes.append((a, b, size))
    return runs


def _bytes_over_time(run: _Run, length: int) -> tuple[int, np.ndarray]:
    """(start, bytes at each position of the run): the largest value live at each position."""
    out = np.zeros(run.end - run.start + 1, np.int64)
    for a, b, size in run.sizes:
        seg = out[a - run.start : b - run.start + 1]
        np.maximum(seg, size, out=seg)
    return run.start, out[: max(0, length - run.start)]


# -- Phases and categories --------------------------------------------------------------------


def _phases(labels: Sequence[str | None]) -> tuple[tuple[str, int, int], ...]:
    """Split the schedule into forward / backward / optimizer spans agreeing with the most
    instruction labels (a few out-of-place ones, e.g. gradient buffers zeroed early, are
    outvoted)."""
    n = len(labels)
    if not any(lab == "backward" for lab in labels):
        return ()
    fwd = np.cumsum([0] + [lab == "forward" for lab in labels])
    bwd = np.cumsum([0] + [lab == "backward" for lab in labels])
    opt = np.cumsum([0] + [lab == "optimizer" for lab in labels])
    lead_at = np.zeros(n + 1, np.int64)  # the best forward/backward split at or before each i
    best = 0
    for i in range(n + 1):
        if fwd[i] - bwd[i] >= fwd[best] - bwd[best]:
            best = i
        lead_at[i] = best
    lead = (fwd - bwd)[lead_at]
    score = lead + bwd - opt  # + opt[n], constant
    o = int(np.argmax(score))
    b = int(lead_at[o])
    return tuple(
        (p, s, e)
        for p, s, e in (("forward", 0, b), ("backward", b, o), ("optimizer", o, n))
        if e > s
    )


def _label(op: str, opcode: str) -> str | None:
    if not op or opcode == "parameter":
        return None
    if "transpose(" in op:
        return "backward"
    if "jvp(" in op:
        return "forward"
    return "optimizer"


def _dims(shape: str) -> tuple[int, ...] | None:
    arrays = hlo.array_shapes(shape)
    return arrays[0][1] if len(arrays) == 1 else None


def _residual_name(ops: Sequence[str], shapes: Sequence[str], hints: NamingHints | None) -> str:
    """A residual buffer's category after ``residual:``: the checkpoint names of the residuals
    of its shape (``hints.stacked``, from the jaxpr walker), else a tag in its JAX ``op_name``
    (a module named after its tag), else ``untagged``."""
    stacked = hints.stacked if hints is not None else {}
    for shape in shapes:
        if shape in stacked:
            names = dict.fromkeys(_tag_or_untagged(t) for t in stacked[shape])
            return "|".join(sorted(names, key=lambda t: t == UNTAGGED))  # tags first
    tags = set(N.CHECKPOINT_NAMES) | {"lm_head", "embed"} | _hinted_tags(hints)
    specific = sorted((o for o in ops if o), key=lambda o: -o.count("/"))
    for op in specific:
        parts = op.split("/")
        for part in reversed(parts[:-1]):
            if part in tags:
                return part
    return UNTAGGED


def _tag_or_untagged(tag: str) -> str:
    """A residual row's tag, or ``untagged`` for an untagged row (``"<mul>"``)."""
    return UNTAGGED if tag.startswith("<") else tag


def _hinted_tags(hints: NamingHints | None) -> set[str]:
    stacked = hints.stacked if hints is not None else {}
    return {t for tags in stacked.values() for t in tags if not t.startswith("<")}


@dataclasses.dataclass(frozen=True)
class _Context:
    comps: Mapping[str, hlo.Computation]
    instrs: Mapping[str, tuple[hlo.Instruction, hlo.Computation]]
    slots: Mapping[str, hlo.BufferSlot]
    backward_start: int | None
    param_dims: frozenset[tuple[int, ...]]
    hints: NamingHints | None


def _category(run: _Run, ctx: _Context) -> tuple[str, str, str, str]:
    """(category, most telling value, its shape, its op_name) of a run of aliasing values."""
    ops, shapes, best = [], [], None
    for value in run.values:
        found = ctx.instrs.get(value.split("{")[0])
        slot = ctx.slots.get(value)
        shape = re.sub(r"\{[0-9,]*(:S\(\d+\))?\}$", "", slot.shape) if slot else ""
        shapes.append(shape)
        if found is None:
            continue
        instr, comp = found
        op = hlo.op_name_of(instr, ctx.comps)
        ops.append(op)
        argument = hlo.entry_argument(instr, comp, ctx.instrs)  # or XLA's copy of one
        if argument is not None:
            op = hlo.op_name_of(argument, ctx.comps)
            return hlo.argument_category(op), value, shape, op
        if best is None or (op and not best[2]):
            best = (value, shape, op)
    value, shape, op = best or (run.values[0], shapes[0] if shapes else "", "")
    dims = [d for d in (_dims(s) for s in shapes) if d is not None]
    hints, back = ctx.hints, ctx.backward_start
    crosses = back is not None and run.start < back <= run.end  # made forward, used backward
    gradient = any("transpose(" in o for o in ops) and any(d in ctx.param_dims for d in dims)
    if crosses and not gradient and hints is not None and any(s in hints.stacked for s in shapes):
        return "residual:" + _residual_name(ops, shapes, hints), value, shape, op
    elems = hints.logits_elems if hints is not None else None
    if elems and any(math.prod(d) == elems for d in dims):
        return "logits", value, shape, op
    if back is not None and any(d in ctx.param_dims for d in dims):
        # A parameter's copy (made in the forward pass), or a gradient / update.
        made_backward = run.start >= back or any("transpose(" in o for o in ops)
        return ("gradients" if made_backward else "params"), value, shape, op
    if crosses:
        return "residual:" + _residual_name(ops, shapes, hints), value, shape, op
    return "temporaries", value, shape, op


# -- Building the timeline --------------------------------------------------------------------


def thin_positions(totals: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most ``max_points`` of ``totals``: the highest of each of equal buckets
    (so the maximum is always kept)."""
    if len(totals) <= max_points:
        return np.arange(len(totals))
    edges = np.linspace(0, len(totals), max_points + 1).astype(int)
    return np.array(
        [a + int(np.argmax(totals[a:b])) for a, b in zip(edges, edges[1:], strict=False) if b > a]
    )


def _merge_small_residuals(rows: dict[str, np.ndarray], peak_bytes: int) -> dict[str, np.ndarray]:
    most = {c: int(r.max()) for c, r in rows.items()}
    residuals = sorted((c for c in rows if c.startswith("residual:")), key=lambda c: -most[c])
    small = residuals[MAX_RESIDUAL_CATEGORIES:]
    small += [c for c in residuals if most[c] < SMALL_FRACTION * peak_bytes]
    out: dict[str, np.ndarray] = {}
    for c, r in rows.items():
        key = "residual:other" if c in small else c
        out[key] = out[key] + r if key in out else r
    first, last = ["params", "opt_state"], ["gradients", "logits", "temporaries"]
    mid = sorted(
        (c for c in out if c not in first + last),
        key=lambda c: (c.startswith("r"), -most.get(c, 0)),
    )
    return {c: out[c] for c in first + mid + last if c in out}


def _lay_out(
    live: LiveRanges, ctx: _Context, named: list[tuple[_Run, tuple[str, str, str, str]]]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    length = len(live.sequence)
    rows: dict[str, np.ndarray] = {}
    host = np.zeros(length, np.int64)
    for run, (category, *_) in named:
        start, over = _bytes_over_time(run, length)
        target = host if run.on_host else rows.setdefault(category, np.zeros(length, np.int64))
        target[start : start + len(over)] += over
    return rows, host


def build_timeline(
    dump: hlo.DumpFiles, hints: NamingHints | None = None, max_points: int = DEFAULT_MAX_POINTS
) -> Timeline | None:
    """The live-bytes timeline of one compile (None when XLA wrote no live-range dump).

    Args:
      dump: the compile's XLA dumps (:func:`remat_kit.memory.hlo.read_dump`).
      hints: names for stacked residual shapes and the logits' element count (model jobs).
      max_points: keep at most this many schedule positions (the highest of each bucket).
    """
    if not dump.live_range or not dump.hlo:
        return None
    live = dump.live_ranges
    comps = dump.module
    instrs = hlo.instructions_by_name(comps)
    labels = [
        _label(hlo.op_name_of(instrs[n][0], comps), instrs[n][0].opcode) if n in instrs else None
        for n in live.sequence
    ]
    phases = _phases(labels)
    param_dims = {
        _dims(i.shape)
        for i, c in instrs.values()
        if c.is_entry and i.opcode == "parameter" and i.op_name.startswith("state.params")
    }
    if hints is not None:  # a user's program names its parameters as its loss does
        param_dims |= {_dims(s) for s in hints.param_shapes}
    backward = next((a for p, a, _ in phases if p == "backward"), None)
    slots = dump.slots
    ctx = _Context(comps, instrs, slots, backward, frozenset(param_dims - {None}), hints)
    named = [(run, _category(run, ctx)) for run in _runs(live, slots, instrs)]
    rows, host = _lay_out(live, ctx, named)
    totals = sum(rows.values(), np.zeros(len(live.sequence), np.int64))
    if not totals.size:
        return None
    peak = int(np.argmax(totals))
    rows = _merge_small_residuals(rows, int(totals[peak]))
    merged = {c for c in rows}
    top = [
        TimelineBuffer(value, cat if cat in merged else "residual:other", size, shape, op)
        for run, (cat, value, shape, op) in named
        if not run.on_host and run.start <= peak <= run.end
        for size in [int(_bytes_over_time(run, len(totals))[1][peak - run.start])]
    ]
    top.sort(key=lambda b: -b.nbytes)
    spans = sorted(
        (
            LiveSpan(value, cat if cat in merged else "residual:other", run.nbytes, shape, op,
                     run.start, min(run.end, len(totals) - 1))
            for run, (cat, value, shape, op) in named
            if not run.on_host and run.nbytes >= SPAN_FRACTION * totals[peak]
        ),
        key=lambda b: -b.nbytes,
    )[:MAX_SPANS]  # fmt: skip
    keep = thin_positions(totals, max_points)
    name = live.sequence[peak]
    op = hlo.op_name_of(instrs[name][0], comps) if name in instrs else ""
    return Timeline(
        length=len(totals),
        positions=tuple(int(p) for p in keep),
        categories=tuple(rows),
        device_bytes=tuple(tuple(int(v) for v in r[keep]) for r in rows.values()),
        host_bytes=tuple(int(v) for v in host[keep]) if host.any() else None,
        phases=phases,
        peak_bytes=int(totals[peak]),
        peak_position=peak,
        peak_instruction=f"{name} ({op})" if op else name,
        peak_buffers=tuple(top[:TOP_BUFFERS]),
        spans=tuple(spans),
    )


def live_at_peak(dump: hlo.DumpFiles) -> list[hlo.LiveBuffer] | None:
    """The values live where the most device bytes are live (aliases counted once: see the
    module docstring), sized by buffer assignment; None without a live-range dump."""
    if not dump.live_range:
        return None
    live = dump.live_ranges
    slots = dump.slots
    instrs = hlo.instructions_by_name(dump.module)
    totals = np.zeros(len(live.sequence), np.int64)
    for run in _runs(live, slots, instrs):
        if not run.on_host:
            start, over = _bytes_over_time(run, len(totals))
            totals[start : start + len(over)] += over
    if not totals.size:
        return []
    t = int(np.argmax(totals))
    return [
        hlo.LiveBuffer(v, slots[v].nbytes if v in slots else _value_bytes(v, instrs))
        for v, (a, b) in live.ranges.items()
        if a <= t <= b
    ]
