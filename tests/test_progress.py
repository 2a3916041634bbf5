"""The live progress line of long analyses: on a terminal only, stages as the engine says."""

import io

from rich.console import Console

from remat_kit.cli.progress import CompileProgress

WHAT = "policy 'save-dots' on target 'h100-sxm'"


def _events(bar):
    bar(0, 2, WHAT, "tracing")
    bar(0, 2, WHAT, "compiling")
    bar(1, 2, "policy 'minimal' on target 'h100-sxm'", "cached")


def test_silent_when_not_a_terminal():
    out = io.StringIO()
    with CompileProgress(Console(file=out, force_terminal=False)) as bar:
        _events(bar)
    assert out.getvalue() == "" and not bar.enabled


def test_terminal_shows_stage_and_count():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with CompileProgress(console) as bar:
        _events(bar)
        bar._bar.refresh()
        shown = out.getvalue()
    assert "compiling policy 'save-dots'" in shown and "1/2" in shown
    assert "on target" not in shown  # shortened
