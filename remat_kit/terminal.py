"""What remat-kit prints on a terminal, sized for it: tables fitted to its width
(:func:`fit_table`, :class:`FittedTable`), notes said once for every policy they concern
(:func:`group_notes`), and XLA's long messages in one line (:func:`short_xla`; the full text
stays in the JSON, the rows and the reports).

A leaf module: it imports rich, nothing of remat-kit's.

Example::

    >>> group_notes([("no-remat", []), ("save-nothing", ["A"]), ("save-dots", ["A", "B"])])
    ['save-nothing, save-dots: A', 'save-dots: B']
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from remat_kit.units import format_bytes

# -- Tables ------------------------------------------------------------------------------------


def _plain(cell: Any) -> str:
    """A cell's text as printed (a rich markup string's markup removed)."""
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)


def _longest_word(lines: Iterable[str]) -> int:
    return max((len(w) for line in lines for w in line.split()), default=0)


def _overhead(table: Table, columns: int) -> int:
    """Characters a row of ``table`` takes besides its cells (borders, padding), measured by
    rendering a one-row table of its style (rich computes them privately)."""
    probe = Table(
        box=table.box, show_edge=table.show_edge, pad_edge=table.pad_edge,
        padding=table.padding, collapse_padding=table.collapse_padding, show_header=False,
    )  # fmt: skip
    for _ in range(columns):
        probe.add_column(width=1)
    probe.add_row(*("x" * columns))
    out = Console(width=10_000, file=io.StringIO(), color_system=None)
    with out.capture() as capture:
        out.print(probe)
    return max(len(line) for line in capture.get().splitlines()) - columns


def _bounds(column: Any) -> tuple[int, int, int]:
    """(natural, soft, hard) widths of a column's cells: natural, every line whole; soft, its
    figures whole and its header wrapped at spaces (a left-justified text column wraps at
    spaces: soft is hard there); hard, every word whole."""
    header = _plain(column.header).splitlines()
    cells = [line for c in column.cells for line in _plain(c).splitlines()]
    longest = max((len(line) for line in cells), default=0)
    natural = max(longest, *(len(h) for h in header), 1)
    hard = max(_longest_word(cells), _longest_word(header), 1)
    soft = hard if column.justify == "left" else max(longest, _longest_word(header), 1)
    return natural, soft, hard


def _shrink(widths: list[int], floors: Sequence[int], excess: int) -> int:
    """Narrow the widest columns still above their floor, one character at a time, by up to
    ``excess`` in all; the excess left."""
    while excess > 0:
        above = [i for i, (w, f) in enumerate(zip(widths, floors, strict=True)) if w > f]
        if not above:
            break
        widest = max(above, key=lambda i: (widths[i], i))
        widths[widest] -= 1
        excess -= 1
    return excess


#: The narrowest a text column gets, its longest words folded, before a table is too wide.
FOLD_WIDTH = 12


def fit_table(table: Table, width: int, optional: Sequence[str] = (), why: str = "") -> int:
    """Set ``table``'s column widths so it fits ``width`` characters with every figure whole.

    In order, until it fits: headers wrap at their spaces (figures stay whole); the columns
    named in ``optional`` are left out, the first named first (the caption says which, and
    ``why`` where to see them); text and then figures wrap at spaces, the widest column first;
    text columns fold their longest words, down to :data:`FOLD_WIDTH`. A figure (a
    right-justified column's word) is never folded. A table that fits as it is keeps rich's
    own widths.

    Args:
      table: the table, with its rows (the columns' cells are read).
      width: the characters available.
      optional: headers of columns that may be left out to fit.
      why: where the columns left out are shown (``"--json has them"``).

    Returns:
      The width the table takes: more than ``width`` when even that does not fit (a caller may
      print it that wide, or let rich fold its words).
    """
    dropped = []
    while True:
        bounds = [_bounds(c) for c in table.columns]
        room = width - _overhead(table, len(table.columns))
        natural, soft, hard = (list(x) for x in zip(*bounds, strict=True))
        if sum(natural) <= room:
            break
        left = [c for c in table.columns if _plain(c.header) in optional]
        if sum(soft) <= room or not left:
            break
        drop = min(left, key=lambda c: list(optional).index(_plain(c.header)))
        table.columns.remove(drop)
        dropped.append(_plain(drop.header))
    if dropped:
        table.caption = f"columns left out for the width: {', '.join(dropped)}" + (
            f" ({why})" if why else ""
        )
        table.caption_justify = "left"
    if sum(natural) <= room:
        return sum(natural) + width - room
    widths = list(natural)
    excess = _shrink(widths, soft, sum(widths) - room)
    excess = _shrink(widths, hard, excess)
    # a word longer than the room (a long per-tag policy label) folds; a figure never does
    folds = [min(h, FOLD_WIDTH) if c.justify == "left" else h
             for c, h in zip(table.columns, hard, strict=True)]  # fmt: skip
    excess = _shrink(widths, folds, excess)
    for column, w in zip(table.columns, widths, strict=True):
        column.width = w
    return width + excess


class FittedTable(Table):
    """A rich table that fits itself to the width it is printed at (:func:`fit_table`); where
    even that does not fit, rich folds its words.

    Args:
      *args: as :class:`rich.table.Table`.
      optional: headers of the columns that may be left out to fit, the first first.
      why: where the columns left out are shown.
      **kwargs: as :class:`rich.table.Table`.
    """

    def __init__(self, *args: Any, optional: Sequence[str] = (), why: str = "", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.optional, self.why = tuple(optional), why

    def add_column(self, *args: Any, **kwargs: Any) -> None:
        """As :meth:`rich.table.Table.add_column`; a word too long for its column folds onto
        the next line (``overflow="fold"``) rather than being cut with an ellipsis."""
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        if fit_table(self, options.max_width, self.optional, self.why) > options.max_width:
            for column in self.columns:  # even whole words do not fit: rich folds them
                column.width = None
        yield from super().__rich_console__(console, options)


# -- Notes ---------------------------------------------------------------------------------------

#: How remat-kit's warnings give their cause (:mod:`remat_kit.memory.undone`).
CAUSE = " Cause: "


def group_notes(
    items: Iterable[tuple[str, Iterable[str]]],
    everyone: str | None = "all policies",
    lead: str = "",
) -> list[str]:
    """Notes said once: ``items`` are ``(label, notes)`` (a policy and its warnings); a note
    several labels share is one line naming them (``save-nothing, save-dots: ...``;
    ``everyone`` when every label has it, of two or more; None: the labels always), in the
    order first seen; a cause
    several notes end with (``... Cause: X``) is said once, after them (``[cause 1]``, then
    ``cause 1: X``); notes of one kind with each label's own figures (the same words up to
    ``": "``, :data:`SHARED_HEAD` characters or more, then figures that differ) are one line,
    the words once and each label's figures after them (``head: a 1 ms; b 2 ms``). ``lead``
    starts every line (which table the notes are of)."""
    items = [(label, list(dict.fromkeys(notes))) for label, notes in items]
    by_note: dict[str, list[str]] = {}
    for label, notes in items:
        for note in notes:
            by_note.setdefault(note, []).append(label)
    by_note = _merge_heads(by_note)
    ends = [n.split(CAUSE, 1)[1] for n in by_note if CAUSE in n]
    shared = [c for c in dict.fromkeys(ends) if ends.count(c) > 1]
    causes: dict[str, int] = {}
    out = []
    for note, labels in by_note.items():
        every = everyone is not None and len(labels) == len(items) > 1
        who = everyone if every else ", ".join(labels)
        head, _, cause = note.partition(CAUSE)
        if cause in shared:
            note = f"{head} [cause {causes.setdefault(cause, len(causes) + 1)}]"
        out.append(f"{lead}{who}: {note}" if labels else f"{lead}{note}")
    return out + [f"{lead}cause {n}: {cause}" for cause, n in causes.items()]


#: The least length of the words notes share before ``": "`` for :func:`group_notes` to say
#: them once with each label's own figures after them.
SHARED_HEAD = 24


def _merge_heads(by_note: dict[str, list[str]]) -> dict[str, list[str]]:
    """Notes (each with its labels) of one head (the text before the first ``": "``, at least
    :data:`SHARED_HEAD` long) and different tails: one note, ``head: label tail; label tail``
    (the labels then in the note; the returned note has no labels of its own: ``[]``)."""
    heads: dict[str, list[str]] = {}
    for note in by_note:
        head, sep, tail = note.partition(": ")
        if sep and len(head) >= SHARED_HEAD and tail:
            heads.setdefault(head, []).append(note)
    out: dict[str, list[str]] = {}
    for note, labels in by_note.items():
        head = note.partition(": ")[0]
        group = heads.get(head, [])
        if len(group) < 2:
            out[note] = labels
        elif note == group[0]:
            parts = [f"{', '.join(by_note[n])} {n.partition(': ')[2]}" for n in group]
            out[f"{head}: {'; '.join(parts)}"] = []
    return out


#: XLA's GPU scheduler (gpu_hlo_schedule.cc) on a step whose arguments and outputs alone
#: exceed the device memory it schedules for.
_SCHEDULER_LIMIT = re.compile(
    r"byte size of input/output arguments \((\d+)\) exceeds the base limit \((\d+)\)"
)
_REMAT_WARNING = re.compile(
    r"Can't reduce memory use below ([\d.]+\w+) .*only reduced to ([\d.]+\w+).*down from "
    r"([\d.]+\w+)"
)


def short_xla(text: str) -> str:
    """XLA's long messages in one line for a terminal (the JSON, rows and reports keep them
    whole): its rematerialisation pass giving up ("Can't reduce memory use below 60.47GiB
    (64927346170 bytes) by rematerialization; only reduced to ...") and remat-kit's note on
    what it recomputed; its GPU scheduler calling a step whose arguments and outputs exceed its
    planning limit "an error in the calculation"; any other text as it is. The words come
    before ``": "`` and the figures after, so that :func:`group_notes` says the words once
    for every policy with each one's figures.

    XLA:GPU's scheduler plans for 80% of the device's memory less the arguments and outputs,
    times ``--xla_gpu_memory_limit_slop_factor`` (95 by default) percent
    (``gpu_hlo_schedule.cc``); its remat pass aims at that figure, not at the device's memory.
    """
    m = _REMAT_WARNING.search(text)
    if m:
        limit, reached, before = m.groups()
        return (
            f"XLA's remat pass missed its own {limit} target (its scheduler's planning figure, "
            f"not the device's memory): {before} -> {reached}"
        )
    m = _SCHEDULER_LIMIT.search(text)
    if m:
        given, limit = (format_bytes(int(x)) for x in m.groups())
        return (
            f"the step's arguments and outputs exceed XLA's GPU scheduler limit ({limit}, 80% of "
            f"the device's memory), which XLA calls 'an error in the calculation': {given}"
        )
    m = re.search(r"recomputed (\d+) instruction", text)
    if m and "rematerialisation pass" in text:
        return f"XLA recomputed {m.group(1)} instructions itself (in the FLOPs)"
    return text


def short_warnings(warnings: Iterable[str]) -> list[str]:
    """One report's warnings for a terminal: :func:`short_xla` of each, XLA's scheduler
    warnings (one per computation it schedules) said once with the largest figure."""
    out: list[str] = []
    line_of: dict[str, int] = {}  # scheduler limit -> the index of its line in ``out``
    sizes: dict[str, int] = {}
    for text in warnings:
        m = _SCHEDULER_LIMIT.search(text)
        if m is None:
            out.append(short_xla(text))
            continue
        given, limit = int(m.group(1)), m.group(2)
        if limit not in line_of:
            line_of[limit], sizes[limit] = len(out), given
            out.append(short_xla(text))
        elif given > sizes[limit]:
            sizes[limit] = given
            out[line_of[limit]] = short_xla(text)
    return out
