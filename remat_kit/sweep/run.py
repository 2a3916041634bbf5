"""The sweep loop: analyse each group of points, compile and run the measured ones, append one
row per point as soon as it finishes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit.memory import analyze_policies, calibrate
from remat_kit.memory.runner import CompileEngine
from remat_kit.preset_program import preset
from remat_kit.sweep import results as R
from remat_kit.sweep.config import Point, SweepConfig
from remat_kit.sweep.measure import can_interleave, compile_steps, measure_points
from remat_kit.sweep.output import SweepRun, agreed_todo, prepare_output, progress
from remat_kit.sweep.rows import point_row
from remat_kit.training.data import Corpus, load_corpus
from remat_kit.training.step import make_optimizer


def analyze_group(points: Sequence[Point], engine: CompileEngine | None = None) -> dict[str, Any]:
    """Reports (or the exception) of every point of one group (points differing only in the
    policy), by point key. With ``engine`` the steps compile with full code-generation
    optimisation and stay in it, so the measured run reuses them."""
    p0 = points[0]
    try:
        optimizer = make_optimizer(p0.optimizer, learning_rate=p0.learning_rate)
        program = preset(p0.model_config(), p0.batch_size, p0.seq_len, optimizer, p0.mesh)
        out = analyze_policies(
            program,
            [p.policy for p in points],
            target=p0.target,
            raise_errors=False,
            fast_compile=engine is None,
            engine=engine,
        )
    except Exception as err:  # the whole group failed: every point gets the error
        out = [err] * len(points)
    return {p.key: r for p, r in zip(points, out, strict=True)}


class _Group:
    """Runs the groups of one sweep call and writes their rows (process 0 only)."""

    def __init__(self, path: Path, primary: bool, corpus: Corpus | None, common: dict):
        self.path, self.primary, self.corpus, self.common = path, primary, corpus, common
        self.counts: dict[tuple, tuple[int, int]] = {}
        self.state_cache: dict = {}
        self.rows: list[dict[str, Any]] = []

    def run(self, members: list[Point], before_point: Callable | None, advance: Callable) -> None:
        failed: dict[str, BaseException] = {}
        for p in members:
            try:
                if before_point is not None:
                    before_point(p)
            except Exception as err:
                failed[p.key] = err
        live = [p for p in members if p.key not in failed]
        what = members[0].label.rsplit(" ", 2)[0]
        measured = any(p.measure for p in live)
        with CompileEngine() as engine:  # one per group: its executables go with it
            advance(None, f"analysing {what} ({len(live)} policies)")
            group_engine = engine if measured else None
            reports = {**failed, **(analyze_group(live, group_engine) if live else {})}
            to_run = [p for p in live if p.measure and not isinstance(reports[p.key], Exception)]
            if to_run:
                advance(None, f"compiling {len(to_run)} steps of {what}")
            keys = {p.key: getattr(reports[p.key], "program_sha256", None) for p in to_run}
            executables = compile_steps(to_run, self.state_cache, engine, keys)
            measurements = self._measure(to_run, reports, executables, advance, what)
            for p in members:
                advance(None, p.label)
                row = point_row(
                    p, reports[p.key], self.common, self.counts, executables.get(p.key),
                    measurements.get(p.key),
                )  # fmt: skip
                if self.primary:
                    R.append_row(self.path, row)
                self.rows.append(row)
                advance(1, p.label)

    def _measure(self, points, reports, executables, advance, what) -> dict[str, Any]:
        """Run the compiled steps of ``points``, interleaved where
        :func:`~remat_kit.sweep.measure.can_interleave` allows; by point key."""
        ran = [p for p in points if isinstance(executables.get(p.key), tuple)]
        if not ran:
            return {}
        interleave = can_interleave(ran, [reports[p.key].argument_bytes for p in ran])
        advance(None, f"timing {len(ran)} steps of {what}" + (" interleaved" if interleave else ""))
        out = measure_points(
            ran, [executables[p.key][0] for p in ran], self.corpus, self.state_cache, interleave
        )
        return dict(zip((p.key for p in ran), out, strict=True))


def run_sweep(
    config: SweepConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    overwrite: bool = False,
    data: str | os.PathLike[str] | None = None,
    max_data_bytes: int | None = None,
    progress: bool = True,
    console: Any = None,
    before_point: Callable[[Point], None] | None = None,
) -> SweepRun:
    """Run every point of ``config`` not yet in ``out``; append one row per point.

    Everything that can be checked is checked before anything compiles: the config
    (:func:`validate`), the output file (writable; from the same config when resuming), the
    data (when a point is measured).

    Args:
      config: the sweep.
      out: the JSONL results file (created with its folders).
      resume: skip points whose key is already in ``out`` (a torn last line is dropped first).
      overwrite: empty ``out`` first.
      data: text file or folder for measured points; ``None``: the Python standard library's
        source (:func:`remat_kit.training.data.load_corpus`).
      max_data_bytes: cap on the corpus size in bytes (``None``: the loader's default).
      progress: show a rich progress bar (point being run, ETA).
      console: a ``rich.console.Console`` for the bar (default: a new one on stderr).
      before_point: called with each point before its group (the points differing only in the
        policy) is analysed; an exception it raises becomes that point's ``error`` row and the
        point is neither analysed nor run (used to test fault handling).

    Returns:
      A :class:`SweepRun`.

    Raises:
      ValueError: an invalid config; ``out`` not writable; ``out`` holding rows without
        ``resume`` or ``overwrite``, or rows of another config (naming what differs); a
        missing, empty or binary ``data`` path.
    """
    start = time.perf_counter()
    points = config.points()
    path = Path(out)
    identity = config.identity(data)
    corpus = None
    if any(p.measure for p in points):  # a bad data path fails before the output is touched
        corpus = load_corpus(data, max_bytes=max_data_bytes)
    primary = jax.process_index() == 0
    done, todo = _todo(points, path, identity, resume, overwrite, primary)
    if not any(p.measure for p in todo):
        corpus = None
    common = _common_fields(config, identity, corpus)
    if any(not T.get_target(p.target).deviceless for p in todo):
        # Time the local device for the step-time model before anything else runs (cached
        # per machine): a calibration beside compiles in flight would time them too.
        calibrate.device_figures(T.get_target(T.LOCAL))
    groups: dict[tuple, list[Point]] = {}
    for p in todo:
        groups.setdefault(p.group, []).append(p)
    runner = _Group(path, primary, corpus, common)
    with _progress_bar(progress and primary, console, len(todo)) as advance:
        for members in groups.values():
            runner.run(members, before_point, advance)
    by_key = {**done, **{r["key"]: r for r in runner.rows}}
    rows = [by_key[p.key] for p in points if p.key in by_key]
    return SweepRun(path, rows, runner.rows, len(points) - len(todo), time.perf_counter() - start)


def _todo(
    points: Sequence[Point],
    path: Path,
    identity: Mapping[str, Any],
    resume: bool,
    overwrite: bool,
    primary: bool,
) -> tuple[dict[str, dict], list[Point]]:
    """The rows already in ``path`` (by key) and the points still to run. Several processes
    (jax.distributed) run every point together; process 0 owns the file and says which."""
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
    config: SweepConfig, identity: Mapping[str, Any], corpus: Corpus | None
) -> dict[str, Any]:
    """Fields every row of this call shares: the sweep, its identity, where it ran, the data."""
    return {
        "sweep": config.name,
        "config_fingerprint": R.fingerprint(identity),
        "sweep_config": dict(identity),
        **R.environment(),
        **(corpus.info() if corpus is not None else {}),
    }
