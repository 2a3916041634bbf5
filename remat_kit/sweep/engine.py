"""Engines: what runs a sweep's tasks (:class:`~remat_kit.sweep.tasks.Task`) and reports them
back to the driver, which appends each task's rows as it finishes, in whatever order.

An engine's :meth:`run` takes the tasks and a factory of task runners (picklable: called once
in each process that runs tasks, e.g. ``functools.partial(TaskRunner, setup)``; the runner,
called with a task and an ``advance`` for stage lines, returns its rows) and yields
:class:`Event` s: a task started, a task done (its rows, or the exception that lost them).

:class:`SerialEngine` runs every task in the driver's own process, one after the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from remat_kit.sweep.tasks import Task

#: A factory of task runners: ``make_runner()(task, advance) -> rows``.
RunnerFactory = Callable[[], Callable[[Task, Callable], list[dict[str, Any]]]]


@dataclasses.dataclass(frozen=True)
class Event:
    """What an engine reports: ``start`` (``task`` began) or ``done`` (its ``rows``, or the
    ``error`` that lost them: the driver writes an error row per point then)."""

    kind: Literal["start", "done"]
    task: Task
    rows: list[dict[str, Any]] | None = None
    error: BaseException | None = None


class SerialEngine:
    """Every task in this process, in the order given (stage lines through ``advance``)."""

    #: Processes running analysis-only and measured tasks side by side (:func:`make_tasks`).
    analysis_slots = 1
    device_slots = 1

    def run(
        self, tasks: Sequence[Task], make_runner: RunnerFactory, advance: Callable
    ) -> Iterator[Event]:
        runner = make_runner() if tasks else None
        for task in tasks:
            yield Event("start", task)
            try:
                rows = runner(task, advance)  # type: ignore[misc]
            except Exception as err:  # a failure outside the points' own handling
                yield Event("done", task, error=err)
                continue
            yield Event("done", task, rows=rows)
