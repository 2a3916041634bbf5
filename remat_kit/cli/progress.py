"""A live status line on stderr for long analyses: policy k of n, and what is being done to it
(tracing, compiling, read from the compile cache). Shown only when stderr is a terminal, and
gone when the work ends (rich's transient progress), so logs and pipes get nothing."""

from __future__ import annotations

import re
import threading
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from remat_kit.cli.console import text

#: Stages after which an item needs nothing more from the engine.
_FINISHED = ("done", "cached", "same program")


def _short(what: str) -> str:
    """``"policy 'save-dots' on target 'h100-sxm'"`` -> ``"policy 'save-dots'"``."""
    return re.sub(r" (of '[^']*' )?on target '[^']*'", "", what)


class CompileProgress:
    """``progress(index, total, what, stage)`` for :class:`remat_kit.memory.runner.CompileEngine`
    as a one-line bar on stderr: items finished of all, and the stage of the items in flight
    (compiles run in worker threads while the next policy is traced). A no-op when stderr is
    not a terminal. Use as a context manager around the analysis."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal
        self._lock = threading.Lock()
        self._stages: dict[int, tuple[str, str]] = {}
        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console, transient=True,
        )  # fmt: skip
        self._task: Any = None

    def __enter__(self) -> CompileProgress:
        if self.enabled:
            self._bar.start()
            self._task = self._bar.add_task("preparing the policies", total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._bar.stop()

    def __call__(self, index: int, total: int, what: str, stage: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._stages[index] = (what, stage)
            finished = sum(s in _FINISHED for _, s in self._stages.values())
            active = [
                f"{s} {_short(w)}" for _, (w, s) in sorted(self._stages.items())
                if s not in _FINISHED
            ]  # fmt: skip
            line = "; ".join(active) if active else "reading XLA's dumps"
            self._bar.update(
                self._task, total=total, completed=finished,
                description=text(line),
            )  # fmt: skip
