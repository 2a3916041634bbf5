"""The sweep loop, one for a preset grid and a user's program: each group of points (one
program, several policies) is analysed, its measured points' steps compiled (the analysis's own
executables) and timed, and one row per point appended as soon as the group finishes. A preset
grid's groups run as tasks (:mod:`remat_kit.sweep.tasks`) through an engine
(:mod:`remat_kit.sweep.engine`); :class:`TaskRunner` runs a task wherever the engine puts it.

:func:`run_sweep` runs a :class:`~remat_kit.sweep.config.SweepConfig` (presets, one group per
model, shape and target; measured points run on text). :func:`run_program_sweep` runs a user's
:class:`~remat_kit.program.Program` (one group: the policies acting on its ``checkpoint_name``
tags, by default the set ``analyze`` compiles; steps run on its own arguments, abstract ones
given values: :func:`~remat_kit.sweep.measure.host_arguments`). Both go through
:func:`analyse_and_run` and :func:`~remat_kit.sweep.rows.make_row`.

Rows have the preset sweep's fields; those that do not apply to a program (``batch_size``,
``seq_len``, ``model_config``, model FLOPs, ``tokens_per_s``, ``mfu``) are None. A row's key is
the program's name and the policy's label (its registered name, or ``tag=action,...`` for a
per-tag spec), with the step counts; ``resume`` skips the keys already in the file. A failure at
one policy gives a row with status ``oom`` / ``error`` and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit import trace
from remat_kit import validation as V
from remat_kit.loading import require_program
from remat_kit.memory import analyze_policies, calibration
from remat_kit.memory.policy_set import policy_set, program_tags
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import (
    PolicySpec,
    get_policy_spec,
    parse_policy_arg,
    policy_arg,
)
from remat_kit.program import Program
from remat_kit.sweep import results as R
from remat_kit.sweep.config import Point, SweepConfig
from remat_kit.sweep.engine import SerialEngine
from remat_kit.sweep.measure import (
    HostArguments,
    PresetRun,
    ProgramRun,
    StepRun,
    argument_signature,
    can_interleave,
    host_arguments,
    host_state,
    lower_mesh_step,
    run_executables,
    time_runs,
)
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
from remat_kit.training.data import Corpus, load_corpus
from remat_kit.training.step import make_optimizer
from remat_kit.zoo import preset


def analyse_and_run(
    make_program: Callable[[], Program],
    specs: Mapping[str, str | PolicySpec],
    target: str | T.Target,
    make_run: Callable[[str, Program, Any], StepRun],
    advance: Callable,
    what: str,
    *,
    measure: Collection[str] = (),
    failed: Mapping[str, BaseException] | None = None,
    lower: Callable[[str], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One group's reports, compiled steps and measurements (each the result or the exception),
    by key.

    The policies ``specs`` (by key; ``failed``: keys already failed, with why) are analysed
    together on ``make_program()`` (:func:`remat_kit.memory.analyze_policies`: the same figures
    as ``remat-kit analyze``). When some are measured (keys in ``measure``, on the local
    device) the analysis compiles with full code-generation optimisation in one engine that
    keeps the executables, the step that runs is the analysis's program
    (:func:`~remat_kit.sweep.measure.run_executables`; ``lower``: how to lower it otherwise),
    and the steps (``make_run(key, program, executable)``) are timed by
    :func:`~remat_kit.sweep.measure.time_runs`, interleaved where
    :func:`~remat_kit.sweep.measure.can_interleave` allows (the CPU).
    """
    failed = dict(failed or {})
    live = {k: s for k, s in specs.items() if k not in failed}
    executables: dict[str, Any] = {}
    measurements: dict[str, Any] = {}
    finished = [0]

    def compiled(index: int, total: int, item: str, stage: str) -> None:
        """A line per compile finished (or answered by the cache): never minutes of silence."""
        if stage in ("done", "cached", "same program"):
            finished[0] += 1
            how = "" if stage == "done" else f" ({stage})"
            advance(None, f"{what}: {finished[0]} of {total} compiles done{how}")

    # one engine per group: its executables go with it
    with CompileEngine(progress=compiled) as engine:
        advance(None, f"analysing {what} ({len(live)} policies)")
        timed = any(k in measure for k in live)
        try:
            program = make_program()
            out = analyze_policies(
                program, list(live.values()), target, raise_errors=False,
                fast_compile=not timed, engine=engine,
            )  # fmt: skip
        except Exception as err:  # the whole group failed: every point gets the error
            out = [err] * len(live)
        reports = {**failed, **dict(zip(live, out, strict=True))}
        to_run = {
            k: parse_policy_arg(s) if isinstance(s, str) else s
            for k, s in live.items()
            if k in measure and not isinstance(reports[k], BaseException)
        }
        if to_run:
            advance(None, f"compiling {len(to_run)} steps of {what}")
            finished[0] = 0
            executables = run_executables(program, to_run, reports, engine, lower)
        ran = [k for k in to_run if isinstance(executables[k], tuple)]
        if ran:
            interleave = can_interleave(ran, [reports[k].argument_bytes for k in ran])
            how = " interleaved" if interleave else ""
            advance(None, f"timing {len(ran)} steps of {what}{how}")
            makers = [functools.partial(make_run, k, program, executables[k][0]) for k in ran]
            rounds = functools.partial(_timed_round, advance, f"timing {what}{how}")
            measurements = dict(zip(ran, time_runs(makers, interleave, rounds), strict=True))
    return reports, executables, measurements


def _timed_round(advance: Callable, what: str, done: int, total: int) -> None:
    advance(None, f"{what}: round {done} of {total} done")


def _before(keys: Sequence[Any], hook: Callable | None) -> dict[str, BaseException]:
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
    members: Sequence[Point], before_point: Callable | None, advance: Callable,
    corpus: Corpus | None, state_cache: dict, facts: dict, common: Mapping[str, Any],
) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of one task: points of one group (differing only in the policy)."""
    p0 = members[0]
    by_key = {p.key: p for p in members}

    def make_program() -> Program:
        optimizer = make_optimizer(p0.optimizer, learning_rate=p0.learning_rate)
        return preset(p0.model, p0.batch_size, p0.seq_len, optimizer, p0.mesh, **p0.changes)

    def make_run(key: str, program: Program, compiled: Any) -> StepRun:
        return PresetRun(by_key[key], compiled, corpus, host_state(by_key[key], state_cache))

    lower = None
    if p0.mesh is not None:
        lower = lambda key: lower_mesh_step(by_key[key], state_cache)  # noqa: E731
    reports, executables, measurements = analyse_and_run(
        make_program, {p.key: p.policy for p in members}, p0.target, make_run, advance,
        p0.label.rsplit(" ", 2)[0], measure={p.key for p in members if p.measure},
        failed=_before(members, before_point), lower=lower,
    )  # fmt: skip
    rows = []
    for p in members:
        rows.append(make_row(
            p.key, {**common, **p.to_dict()}, reports[p.key], executables.get(p.key),
            measurements.get(p.key), measure=p.measure,
            model=functools.partial(model_fields, p, facts),
        ))  # fmt: skip
    return rows


class TaskRunner:
    """Runs tasks (:class:`~remat_kit.sweep.tasks.Task`) in one process, wherever that is (the
    driver, a worker process, a Ray task), keeping what its tasks share: the corpus (loaded at
    the first measured task), initial states on the host by model, model facts by model,
    and this process's :func:`~remat_kit.sweep.results.environment` (in every row)."""

    def __init__(self, setup: TaskSetup):
        self.setup = setup
        self.corpus: Corpus | None = None
        self.state_cache: dict = {}  # initial states on the host, by model, optimizer and seed
        self.facts: dict = {}  # model facts (parameters, model FLOPs) by model and shape
        self.common = {**setup.common, **R.environment()}

    def __call__(self, task: Task, advance: Callable | None = None) -> list[dict[str, Any]]:
        """The rows of ``task``'s points, in its order (a failure at a point is its row)."""
        if task.measure and self.corpus is None:
            self.corpus = load_corpus(self.setup.data, max_bytes=self.setup.max_data_bytes)
        return _preset_group(
            task.points, self.setup.before_point, advance or (lambda n, description: None),
            self.corpus, self.state_cache, self.facts, self.common,
        )  # fmt: skip


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
    engine: Any = None,
    shard: Shard | None = None,
) -> SweepRun:
    """Run every point of ``config`` not yet in ``out``; append one row per point.

    Everything that can be checked is checked before anything compiles: the config
    (:func:`validate`), the output file (writable; from the same config when resuming), the
    data (when a point is measured).

    The points run as tasks (:func:`~remat_kit.sweep.tasks.make_tasks`: a group's points, or
    shares of a group where processes run side by side), each task's rows appended as it
    finishes, in whatever order the engine finishes them; a row's figures do not depend on the
    order, and the ``rows`` of :class:`~remat_kit.sweep.output.SweepRun` are in point order.

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
      engine: what runs the tasks (:mod:`remat_kit.sweep.engine`): None, this process, one
        task after the other (:class:`~remat_kit.sweep.engine.SerialEngine`);
        :func:`~remat_kit.sweep.engine.local_engine` for worker processes and every GPU (a
        local point then runs on one GPU unless its grid has a mesh: its ``local_devices``).
      shard: run only this part of the points (:func:`~remat_kit.sweep.shard.shard_points`;
        ``out`` is then the part's file, :func:`~remat_kit.sweep.shard.part_path`, and
        :func:`~remat_kit.sweep.shard.merge_parts` joins the parts); its rows are those of
        the whole sweep (same identity and fingerprint).

    Returns:
      A :class:`SweepRun`.

    Raises:
      ValueError: an invalid config; ``out`` not writable; ``out`` holding rows without
        ``resume`` or ``overwrite``, or rows of another config (naming what differs); a
        missing, empty or binary ``data`` path.
    """
    start = time.perf_counter()
    engine = engine or SerialEngine()
    every = config.points(engine.local_devices)
    points = every if shard is None else shard_points(every, shard)
    path = Path(out)
    identity = config.identity(data)
    # a bad data path fails before the output is touched
    corpus = load_corpus(data, max_bytes=max_data_bytes) if any(p.measure for p in every) else None
    primary = jax.process_index() == 0
    done, todo = _todo(points, path, identity, resume, overwrite, primary)
    pinned = _calibration(engine, todo, path)
    setup = TaskSetup(
        _common_fields(config, identity, corpus), None if data is None else str(data),
        max_data_bytes, before_point,
    )  # fmt: skip
    tasks = make_tasks(todo, engine.analysis_slots, engine.device_slots, engine.backend)
    with pinned:
        written = run_tasks(
            engine, tasks, functools.partial(TaskRunner, setup), path, setup.common,
            progress=progress and primary, console=console, primary=primary,
        )  # fmt: skip
    by_key = {**done, **{r["key"]: r for r in written}}
    rows = [by_key[p.key] for p in points if p.key in by_key]
    return SweepRun(path, rows, written, len(points) - len(todo), time.perf_counter() - start)


def _calibration(
    engine: Any, todo: Sequence[Point], path: Path
) -> contextlib.AbstractContextManager:
    """The local device's calibration pinned for the sweep when a point runs on it here."""
    if engine.calibrate_here and any(not T.get_target(p.target).deviceless for p in todo):
        # Time the local device for the step-time model before anything else runs (cached
        # per machine): a calibration beside compiles in flight would time them too. Every row
        # of the sweep (a resumed one too) is priced with that one calibration, kept beside the
        # results. (GPUs handed to worker processes are timed there, each by its first point.)
        return calibration.pinned_calibration(calibration_path(path))
    return contextlib.nullcontext()


def run_tasks(
    engine: Any,
    tasks: Sequence[Task],
    make_runner: Callable,
    path: Path,
    common: Mapping[str, Any],
    *,
    progress: bool = True,
    console: Any = None,
    primary: bool = True,
) -> list[dict[str, Any]]:
    """Run ``tasks`` through ``engine`` (:mod:`remat_kit.sweep.engine`; ``make_runner``: the
    factory of task runners it calls in each process) and append each task's rows to ``path``
    as it finishes (``primary``: this process writes; under ``jax.distributed``, process 0),
    in whatever order; a task lost (its process gone, its runner raising) gets an error row
    per point (``common``: the fields those rows share). Progress: a bar or a line per point,
    and what is running every 10 s (:class:`~remat_kit.sweep.tasks.Tally`).

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
            rows = event.rows
            if rows is None:
                rows = error_rows(event.task, common, event.error)  # type: ignore[arg-type]
            for row in rows:
                if primary:
                    R.append_row(path, row)
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
    """Fields every row of this call shares wherever it runs: the sweep, its identity, the data
    (when the config measures; each process running tasks adds where it ran)."""
    return {
        "sweep": config.name,
        "config_fingerprint": R.fingerprint(identity),
        "sweep_config": dict(identity),
        **(corpus.info() if corpus is not None else {}),
    }


def _point(program: Program, label: str, warmup: int, timed: int) -> dict[str, Any]:
    return {
        "grid": None, "model": program.name, "policy": label, "batch_size": None,
        "seq_len": None, "remat_group_size": None, "target": "local", "overrides": None,
        "measure": True, "warmup_steps": warmup, "timed_steps": timed, "optimizer": None,
        "learning_rate": None, "seed": None,
    }  # fmt: skip


def _identity(program: Program, host: HostArguments, warmup: int, timed: int) -> dict[str, Any]:
    """What a resumed run must share with the file's rows (the policies may differ)."""
    leaves = argument_signature(host)
    return {
        "program": program.name,
        "arguments": R.fingerprint({"leaves": leaves, "source": host.source}),
        "warmup_steps": warmup,
        "timed_steps": timed,
    }


def _num_params(program: Program) -> int | None:
    """Elements of the differentiated loss arguments (None without a loss;
    :func:`~remat_kit.trace.param_leaves`)."""
    if program.make_loss is None:
        return None
    return sum(int(x.size) for x in trace.param_leaves(program))


def select_policies(
    program: Program, policies: Sequence[str | PolicySpec] | None, tags: frozenset[str]
) -> tuple[list[PolicySpec], list[str], dict[str, list[str]], dict[str, str]]:
    """The specs to sweep (:func:`remat_kit.memory.policy_set.policy_set` fitted to the
    program, on this machine), its notes, each cut-down spec's note by its row key
    (:func:`~remat_kit.policies.policy_arg`), and labels by row key as analyze, the doctor and
    recommend give them (:meth:`remat_kit.memory.policy_set.PolicySet.labels`: ``minimal
    (cut)``, ``custom: attn_in=save``).

    Raises:
      ValueError: an unknown policy; a per-tag spec naming a tag the program does not emit;
        no policy left.
    """
    chosen = policy_set(program, "local", policies, fit=True, tags=tags)
    per_label = {policy_arg(cut): notes for cut, notes in chosen.cut_notes().items()}
    labels = {policy_arg(s): label for s, label in zip(chosen.specs, chosen.labels(), strict=True)}
    return list(chosen.specs), list(chosen.notes), per_label, labels


def _check(program: Program, warmup_steps: int, timed_steps: int) -> None:
    require_program(program)
    V.positive_int("timed_steps", timed_steps)
    V.nonnegative_int("warmup_steps", warmup_steps)
    if jax.process_count() > 1:
        raise ValueError("a program sweep runs in one process (jax.distributed is initialised)")


def run_program_sweep(
    program: Program,
    out: str | os.PathLike[str],
    *,
    policies: Sequence[str | PolicySpec] | None = None,
    warmup_steps: int = 2,
    timed_steps: int = 5,
    resume: bool = False,
    overwrite: bool = False,
    ref: str | None = None,
    progress: bool = True,
    console: Any = None,
    before_policy: Callable[[str], None] | None = None,
) -> SweepRun:
    """Analyse and run ``program`` under each policy not yet in ``out``; one row per policy.

    Args:
      program: a :class:`~remat_kit.program.Program` (:func:`remat_kit.loading.load_program`
        reads one from ``MODULE:FACTORY`` / ``FILE.py:FACTORY``).
      out: the JSONL results file (created with its folders).
      policies: names, per-tag text or specs, narrowed to those acting on the program's tags
        (:func:`remat_kit.policies.policies_for_tags`); default: the set ``analyze`` compiles on
        the program (:func:`remat_kit.memory.policy_set.policy_set`).
      warmup_steps: untimed steps per policy (>= 0); timed_steps: timed steps (>= 1).
      resume: skip policies whose row is in ``out`` (rows of other policies are kept: a resumed
        run may add policies); overwrite: empty ``out`` first.
      ref: how the program was named (``FILE.py:FACTORY``), stored in each row's ``program``.
      progress: show a rich progress bar.
      console: where the progress bar goes (default stderr).
      before_policy: called with each policy's label before its analysis; an exception it
        raises becomes that policy's ``error`` row (used to test fault handling).

    Returns:
      A :class:`~remat_kit.sweep.SweepRun` (``rows``: every row of ``out``, this run's last).

    Raises:
      ValueError: not a Program; bad step counts; an unknown policy, a per-tag spec naming a
        tag the program does not emit, or no policy acting on its tags; a program whose
        factories do not pass the policy on (:func:`remat_kit.reach.policy_reach`); ``out``
        not writable,
        holding rows without ``resume`` / ``overwrite``, or rows of another program or step
        counts. Nothing is written then.
    """
    start = time.perf_counter()
    _check(program, warmup_steps, timed_steps)
    tags = program_tags(program)
    specs, notes, per_label, labels = select_policies(program, policies, tags)
    reach = program.reach()  # as analyze: a step ignoring the policy is refused, once
    if any(s.wrap for s in specs) and not reach.passes:
        raise ValueError(reach.error())
    host = host_arguments(program.step(get_policy_spec("no-remat")))
    identity = _identity(program, host, warmup_steps, timed_steps)
    path = Path(out)
    done = prepare_output(path, identity, resume, overwrite)
    by_label: dict[str, PolicySpec] = {}
    for s in specs:
        by_label.setdefault(policy_arg(s), s)
    points = {label: _point(program, label, warmup_steps, timed_steps) for label in by_label}
    todo = {label: s for label, s in by_label.items() if R.point_key(points[label]) not in done}
    common, fields = _program_fields(program, ref, tags, identity, host)
    written: list[dict[str, Any]] = []
    with _progress_bar(progress, console, len(todo)) as advance:
        reports, executables, measurements = _run_policies(
            program, todo, host, (warmup_steps, timed_steps), advance, before_policy
        )
        for label, spec in todo.items():
            row = make_row(
                R.point_key(points[label]),
                {**common, **points[label], **fields, "policy_spec": spec.description,
                 "policy_label": labels[label],
                 "policy_notes": per_label.get(label, [])},
                reports[label], executables.get(label), measurements.get(label),
            )  # fmt: skip
            R.append_row(path, row)
            written.append(row)
            advance(1, f"{program.name} {label}")
    rows = [*done.values(), *written]
    wall = time.perf_counter() - start
    return SweepRun(path, rows, written, len(by_label) - len(todo), wall, notes)


def _program_fields(
    program: Program, ref: str | None, tags: frozenset[str], identity: dict, host: HostArguments
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields every row of a program sweep shares: those before a point's, those after."""
    common = {"sweep": program.name, "config_fingerprint": R.fingerprint(identity),
              "sweep_config": identity, **R.environment(),
              "program": ref or program.name, "program_tags": sorted(tags)}  # fmt: skip
    fields = {
        "num_params": _num_params(program), "arguments": host.source,
        "arguments_note": host.note, "fed_back": None, "recopied": None,
    }  # fmt: skip
    return common, fields


def _run_policies(
    program: Program,
    todo: dict[str, PolicySpec],
    host: HostArguments,
    steps: tuple[int, int],
    advance: Callable,
    before_policy: Callable[[str], None] | None,
) -> tuple[dict, dict, dict]:
    """Analyse ``program`` under each policy of ``todo`` and time its step (``steps``: warmup,
    timed): ``(reports, executables, measurements)`` by label (:func:`analyse_and_run`)."""
    if not todo:
        return {}, {}, {}

    def make_run(label: str, program: Program, compiled: Any) -> StepRun:
        pure = program.step(todo[label])
        return ProgramRun(program, pure, compiled, host, *steps)

    return analyse_and_run(
        lambda: program, todo, T.LOCAL, make_run, advance, program.name, measure=todo,
        failed=_before(list(todo), before_policy),
    )  # fmt: skip
