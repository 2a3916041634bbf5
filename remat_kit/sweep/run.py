"""The sweep loop: per group of points (one preset, shape and target; several policies), analyse
and append one row per point. Groups run as tasks (:mod:`remat_kit.sweep.tasks`) through an
engine (:mod:`remat_kit.sweep.engine`). Measured points are run by a caller's :class:`Measurer`
(``experiments/measured``). A failing point gets an ``oom`` / ``error`` row; the sweep goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax

from remat_kit import targets as T
from remat_kit.memory import analyze_policies, calibration
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import PolicySpec
from remat_kit.program import Program
from remat_kit.sweep import results as R
from remat_kit.sweep.config import Point, SweepConfig
from remat_kit.sweep.engine import SerialEngine
from remat_kit.sweep.output import (
    SweepRun,
    agreed_todo,
    calibration_path,
    prepare_output,
    progress,
)
from remat_kit.sweep.rows import make_row, model_fields
from remat_kit.sweep.shard import Shard, shard_points
from remat_kit.sweep.tasks import Tally, Task, TaskSetup, error_rows, make_tasks
from remat_kit.training.step import make_optimizer
from remat_kit.zoo import preset

#: A group's measured steps by key, run after its analysis on its engine (:func:`analyse_group`).
Measure = Callable[[Program, Mapping[str, Any], CompileEngine], tuple[dict, dict]]


class Measurer(Protocol):
    """Runs and times measured points (``experiments/measured``'s ``TextMeasurer``); picklable.

    Attributes:
      data: the text trained on, as rows record it (None: the default corpus).
    """

    data: str | None

    def fields(self) -> dict[str, Any]:
        """Fields every row of a measuring run shares.

        Raises:
          ValueError: the data cannot be read.
        """
        ...

    def measure(
        self,
        points: Sequence[Point],
        program: Program,
        reports: Mapping[str, Any],
        engine: CompileEngine,
        advance: Callable,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """By point key, the compiled step (or exception) and the measurement of ``points``
        whose ``reports`` succeeded (:func:`remat_kit.sweep.rows.make_row` reads both)."""
        ...


def analyse_group(
    make_program: Callable[[], Program],
    specs: Mapping[str, str | PolicySpec],
    target: str | T.Target,
    advance: Callable,
    what: str,
    *,
    failed: Mapping[str, BaseException] | None = None,
    measure: Measure | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One group's reports, compiled steps and measurements (or exceptions), by key.

    ``specs`` are analysed together by :func:`remat_kit.memory.analyze_policies`; with
    ``measure``, fully optimised in one engine that keeps the executables, which ``measure``
    then runs.
    """
    failed = dict(failed or {})
    live = {k: s for k, s in specs.items() if k not in failed}
    finished = [0]

    def compiled(index: int, total: int, item: str, stage: str) -> None:
        """A line per compile finished."""
        if stage in ("done", "cached", "same program"):
            finished[0] += 1
            how = "" if stage == "done" else f" ({stage})"
            advance(None, f"{what}: {finished[0]} of {total} compiles done{how}")

    with CompileEngine(progress=compiled) as engine:
        advance(None, f"analysing {what} ({len(live)} policies)")
        try:
            program = make_program()
            out = analyze_policies(
                program, list(live.values()), target, raise_errors=False,
                fast_compile=measure is None, engine=engine,
            )  # fmt: skip
        except Exception as err:  # the whole group failed: every point gets the error
            out = [err] * len(live)
        reports = {**failed, **dict(zip(live, out, strict=True))}
        if measure is None or all(isinstance(r, BaseException) for r in out):
            return reports, {}, {}
        finished[0] = 0
        executables, measurements = measure(program, reports, engine)
    return reports, executables, measurements


def failed_before(keys: Sequence[Any], hook: Callable | None) -> dict[str, BaseException]:
    """Run ``hook`` on each key (points or labels): those it raises on, with the exception."""
    failed: dict[str, BaseException] = {}
    for k in keys:
        try:
            if hook is not None:
                hook(k)
        except Exception as err:
            failed[getattr(k, "key", k)] = err
    return failed


def _preset_group(
    members: Sequence[Point], setup: TaskSetup, advance: Callable, facts: dict,
    common: Mapping[str, Any],
) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of one task: points of one group (differing only in the policy)."""
    p0 = members[0]

    def make_program() -> Program:
        optimizer = make_optimizer(p0.optimizer, learning_rate=p0.learning_rate)
        return preset(p0.model, p0.batch_size, p0.seq_len, optimizer, p0.mesh, **p0.changes)

    failed = failed_before(members, setup.before_point)
    measured = [p for p in members if p.measure and p.key not in failed]
    measure = None
    if measured:
        measure = functools.partial(_measure_points, setup.measurer, measured, advance=advance)
    reports, executables, measurements = analyse_group(
        make_program, {p.key: p.policy for p in members}, p0.target, advance,
        p0.label.rsplit(" ", 2)[0], failed=failed, measure=measure,
    )  # fmt: skip
    rows = []
    for p in members:
        rows.append(make_row(
            p.key, {**common, **p.to_dict()}, reports[p.key], executables.get(p.key),
            measurements.get(p.key), measure=p.measure,
            model=functools.partial(model_fields, p, facts),
        ))  # fmt: skip
    return rows


def _measure_points(
    measurer: Measurer, points: Sequence[Point], program: Program, reports: Mapping[str, Any],
    engine: CompileEngine, advance: Callable,
) -> tuple[dict, dict]:  # fmt: skip
    ok = [p for p in points if not isinstance(reports[p.key], BaseException)]
    return measurer.measure(ok, program, reports, engine, advance) if ok else ({}, {})


class TaskRunner:
    """Runs :class:`~remat_kit.sweep.tasks.Task` objects in one process, caching model facts
    and the :func:`~remat_kit.sweep.results.environment`."""

    def __init__(self, setup: TaskSetup):
        self.setup = setup
        self.facts: dict = {}  # model facts (parameters, model FLOPs) by model and shape
        self.common = {**setup.common, **R.environment()}

    def __call__(self, task: Task, advance: Callable | None = None) -> list[dict[str, Any]]:
        """The rows of ``task``'s points, in its order (a failure at a point is its row)."""
        return _preset_group(
            task.points, self.setup, advance or (lambda n, description: None), self.facts,
            self.common,
        )  # fmt: skip


def run_sweep(
    config: SweepConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    overwrite: bool = False,
    measurer: Measurer | None = None,
    progress: bool = True,
    console: Any = None,
    before_point: Callable[[Point], None] | None = None,
    engine: Any = None,
    shard: Shard | None = None,
) -> SweepRun:
    """Run every point of ``config`` not yet in ``out``; append one row per point.

    The config (:func:`validate`), ``out`` and the measurer's data are checked before anything
    compiles. Rows are appended as tasks finish (:func:`~remat_kit.sweep.tasks.make_tasks`);
    :class:`~remat_kit.sweep.output.SweepRun` ``rows`` are in point order.

    Args:
      out: the JSONL results file (created with its folders).
      resume: skip points whose key is already in ``out``.
      overwrite: empty ``out`` first.
      measurer: runs the measured points; required when a grid measures.
      progress: show a rich progress bar; console: its ``rich.console.Console`` (default stderr).
      before_point: called per point before analysis; what it raises becomes the point's
        ``error`` row (fault-handling tests).
      engine: runs the tasks (:mod:`remat_kit.sweep.engine`); None: serially here.
      shard: run only this part (:func:`~remat_kit.sweep.shard.shard_points`; ``out`` is the
        part's file, joined by :func:`~remat_kit.sweep.shard.merge_parts`).

    Returns:
      A :class:`SweepRun`.

    Raises:
      ValueError: an invalid config; ``out`` not writable, or holding rows without ``resume``
        or ``overwrite``, or rows of another config; a grid measuring without a ``measurer``;
        data the measurer cannot read.
    """
    start = time.perf_counter()
    engine = engine or SerialEngine()
    every = config.points(engine.local_devices)
    points = every if shard is None else shard_points(every, shard)
    path = Path(out)
    measuring = _measuring(every, measurer)
    identity = config.identity(measurer.data if measurer is not None else None)
    data_fields = measurer.fields() if measuring else {}
    primary = jax.process_index() == 0
    done, todo = _todo(points, path, identity, resume, overwrite, primary)
    pinned = _calibration(engine, todo, path)
    setup = TaskSetup(
        _common_fields(config, identity, data_fields), measurer if measuring else None,
        before_point,
    )  # fmt: skip
    tasks = make_tasks(todo, engine.analysis_slots, engine.device_slots, engine.backend)
    with pinned:
        written = run_tasks(
            engine, tasks, functools.partial(TaskRunner, setup),
            RowSink(path, setup.common, writes=primary), progress=progress and primary,
            console=console,
        )  # fmt: skip
    by_key = {**done, **{r["key"]: r for r in written}}
    rows = [by_key[p.key] for p in points if p.key in by_key]
    return SweepRun(path, rows, written, len(points) - len(todo), time.perf_counter() - start)


def _measuring(points: Sequence[Point], measurer: Measurer | None) -> bool:
    """Whether a point measures (refused without a measurer)."""
    grids = sorted({p.grid for p in points if p.measure})
    if grids and measurer is None:
        raise ValueError(
            f"grids {grids} measure steps on the local device: run them with experiments/"
            "sweep.py (a measurer), or set measure=False to analyse only"
        )
    return bool(grids)


def _calibration(
    engine: Any, todo: Sequence[Point], path: Path
) -> contextlib.AbstractContextManager:
    """The local device's calibration pinned for the sweep when a point runs on it here."""
    if engine.calibrate_here and any(not T.get_target(p.target).deviceless for p in todo):
        # time the local device first: calibrating beside compiles would time them (docs/sweep.md)
        return calibration.pinned_calibration(calibration_path(path))
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class RowSink:
    """Where :func:`run_tasks` puts each finished task's rows.

    Attributes:
      path: the JSONL results file (:func:`remat_kit.sweep.results.append_row`).
      common: the fields every row shares, for a lost task's error rows
        (:func:`~remat_kit.sweep.tasks.error_rows`).
      writes: whether this process appends (process 0 only under ``jax.distributed``).
    """

    path: Path
    common: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    writes: bool = True

    def take(
        self, task: Task, rows: list[dict[str, Any]] | None, error: BaseException | None
    ) -> list[dict[str, Any]]:
        """``task``'s rows (None: lost, error rows from ``error``), appended if :attr:`writes`."""
        if rows is None:
            rows = error_rows(task, self.common, error)  # type: ignore[arg-type]
        if self.writes:
            for row in rows:
                R.append_row(self.path, row)
        return rows


def run_tasks(
    engine: Any,
    tasks: Sequence[Task],
    make_runner: Callable,
    sink: RowSink,
    *,
    progress: bool = True,
    console: Any = None,
) -> list[dict[str, Any]]:
    """Run ``tasks`` through ``engine`` with ``make_runner`` per process; hand each task's rows
    to ``sink`` as it finishes. Progress: a bar or a line per point, and what runs every 10 s.

    Returns:
      The rows written, in the order written.
    """
    written: list[dict[str, Any]] = []
    total = sum(len(t.points) for t in tasks)
    with _progress_bar(progress, console, total) as advance, Tally(total, advance) as tally:
        for event in engine.run(tasks, make_runner, tally.advance):
            if event.kind == "start":
                tally.start(event.task)
                continue
            rows = sink.take(event.task, event.rows, event.error)
            written += rows
            tally.finish(event.task, rows)
    return written


def _todo(
    points: Sequence[Point],
    path: Path,
    identity: Mapping[str, Any],
    resume: bool,
    overwrite: bool,
    primary: bool,
) -> tuple[dict[str, dict], list[Point]]:
    """The rows already in ``path`` (by key) and the points still to run (process 0 decides)."""
    done: dict | ValueError = {}
    if primary:
        try:
            done = prepare_output(path, identity, resume, overwrite)
        except ValueError as err:
            done = err
    todo = agreed_todo(points, done)  # raises process 0's error in every process
    return done, todo  # type: ignore[return-value]


_progress_bar = progress  # run_sweep's argument of the same name hides the function


def _common_fields(
    config: SweepConfig, identity: Mapping[str, Any], data_fields: Mapping[str, Any]
) -> dict[str, Any]:
    """Fields every row of this call shares: the sweep, its identity, the data."""
    return {
        "sweep": config.name,
        "config_fingerprint": R.fingerprint(identity),
        "sweep_config": dict(identity),
        **data_fields,
    }
