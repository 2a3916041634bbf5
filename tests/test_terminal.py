"""Terminal output sized for a terminal (:mod:`remat_kit.terminal`): tables fitted to the width
with figures and names whole, notes said once, XLA's long messages in one line."""

from __future__ import annotations

import io

from rich.console import Console

from remat_kit.terminal import FittedTable, fit_table, group_notes, short_warnings, short_xla


def _table(optional=()):
    t = FittedTable(title="t", optional=optional, why="--json has them")
    t.add_column("policy")
    for h in ("peak MiB", "est. step", "bound by", "compile s"):
        t.add_column(h, justify="right")
    for name in ("save-dots-except-mlp", "offload-layer-inputs (same program as save-nothing)"):
        t.add_row(name, "1,234.56", "3.34 ms", "memory 63%", "cached")
    return t


def _render(table, width: int) -> list[str]:
    out = Console(width=width, file=io.StringIO(), color_system=None)
    with out.capture() as capture:
        out.print(table)
    return capture.get().splitlines()


def test_a_table_fits_with_its_figures_and_names_whole():
    """Headers wrap first, then text at spaces; a figure or a policy name is never folded
    (rich alone cut "save-dots-except-mlp" to "save-dots-exce" / "pt-mlp")."""
    lines = _render(_table(), 70)
    assert max(map(len, lines)) <= 70
    text = "\n".join(lines)
    for whole in ("save-dots-except-mlp", "1,234.56", "3.34 ms", "memory 63%", "cached"):
        assert whole in text, whole
    assert "│ offload-layer-inputs" in text  # the label wraps at its spaces


def test_optional_columns_go_first_and_the_caption_says_so():
    lines = _render(_table(optional=("compile s",)), 60)
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 60 and "compile" not in text.split("\n")[2]
    assert "columns left out for the width: compile s (--json has them)" in text
    assert "memory 63%" in text and "save-dots-except-mlp" in text
    wide = _render(_table(optional=("compile s",)), 120)
    assert "left out" not in "\n".join(wide)  # kept where it fits


def test_a_long_word_folds_and_a_table_too_wide_even_so_says_the_width_it_needs():
    """A label longer than the room folds (down to FOLD_WIDTH); figures never do: a table
    whose figures alone exceed the width says the width it needs."""
    lines = _render(_table(), 55)
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 55 and "…" not in text
    assert "│ save-dots-exce" in text and "1,234.56" in text and "│ memory │" in text
    t = _table()
    needed = fit_table(t, 20)
    assert needed > 20
    lines = _render(t, needed)
    assert max(map(len, lines)) == needed and "1,234.56" in "\n".join(lines)


def test_notes_are_said_once_with_the_policies_they_concern():
    cause = "XLA:CPU honours remat only inside lax.scan"
    items = [
        ("no-remat", ["shared"]),
        ("save-nothing", ["shared", "offload ignored", f"undid save-nothing. Cause: {cause}"]),
        ("offload", ["shared", "offload ignored", f"undid offload. Cause: {cause}"]),
    ]
    assert group_notes(items) == [
        "all policies: shared",
        "save-nothing, offload: offload ignored",
        "save-nothing: undid save-nothing. [cause 1]",
        "offload: undid offload. [cause 1]",
        f"cause 1: {cause}",
    ]
    assert (
        group_notes(items[:2], everyone=None, lead="t: ")[0] == "t: no-remat, save-nothing: shared"
    )


def test_notes_of_one_kind_with_each_policys_figures_are_one_line():
    """Four policies' "time model and XLA's own cost model disagree: X against Y" took four
    lines on a TPU target: the words once, each policy's figures after them."""
    head = "time model and XLA's own cost model disagree"
    items = [
        ("no-remat", [f"{head}: 234 µs against 83.8 µs (2.79x)", "short: a"]),
        ("save-nothing", [f"{head}: 197 µs against 83.2 µs (2.36x)", "short: b"]),
        ("minimal", [f"{head}: 197 µs against 83.2 µs (2.36x)"]),
    ]
    assert group_notes(items) == [
        f"{head}: no-remat 234 µs against 83.8 µs (2.79x); save-nothing, minimal 197 µs "
        "against 83.2 µs (2.36x)",
        "no-remat: short: a",  # heads under SHARED_HEAD characters stay apart
        "save-nothing: short: b",
    ]


def test_xlas_long_messages_shortened_to_one_line():
    text = (
        "hlo_rematerialization.cc: Can't reduce memory use below 60.47GiB (64927346170 bytes) "
        "by rematerialization; only reduced to 109.21GiB (117262955178 bytes), down from "
        "109.21GiB (117262955178 bytes) originally [remat-kit: that limit is XLA's own ...]"
    )
    assert short_xla(text) == (
        "XLA's remat pass missed its own 60.47GiB target (its scheduler's planning figure, not "
        "the device's memory): 109.21GiB -> 109.21GiB"
    )
    assert short_xla("something else") == "something else"
    scheduler = (
        "gpu_hlo_schedule.cc: The byte size of input/output arguments (137438953472) exceeds the "
        "base limit (67954383257). This indicates an error in the calculation!"
    )
    assert short_xla(scheduler) == (
        "the step's arguments and outputs exceed XLA's GPU scheduler limit (63.29 GiB, 80% of "
        "the device's memory), which XLA calls 'an error in the calculation': 128.00 GiB"
    )
    # one report's scheduler warnings (one per computation scheduled): the largest, once;
    # the same words for several policies: one line, each policy's figures after them
    bigger = scheduler.replace("(137438953472)", "(274877906944)")
    one = short_warnings([scheduler, text, bigger, scheduler])
    assert one == [short_xla(bigger), short_xla(text)]
    lines = group_notes([("no-remat", one), ("save-dots", short_warnings([scheduler]))])
    assert lines[0].endswith(
        "'an error in the calculation': no-remat 256.00 GiB; save-dots 128.00 GiB"
    )
    assert len(lines) == 2 and lines[1].startswith("no-remat: XLA's remat pass missed")
