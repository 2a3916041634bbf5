"""A user's program swept on the local device: every policy acting on its ``checkpoint_name``
tags (by default the set ``analyze`` compiles) analysed, its step run on the program's own
arguments (abstract ones given values: :func:`~measured.steps.host_arguments`) and timed, one
row per policy appended to a JSONL file (:func:`run_program_sweep`).

Rows have the preset sweep's fields (:mod:`remat_kit.sweep.rows`); those that do not apply to a
program (``batch_size``, ``seq_len``, the model's fields, model FLOPs, ``tokens_per_s``,
``mfu``) are None. A row's key is the program's name and the policy's label (its registered
name, or ``tag=action,...`` for a per-tag spec), with the step counts; ``resume`` skips the
keys already in the file. A failure at one policy gives a row with status ``oom`` / ``error``
and the sweep goes on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit import trace
from remat_kit import validation as V
from remat_kit.loading import require_program
from remat_kit.memory.policy_set import policy_set, program_tags
from remat_kit.policies import PolicySpec, get_policy_spec, policy_arg
from remat_kit.program import Program
from remat_kit.sweep import results as R
from remat_kit.sweep.output import SweepRun, prepare_output, progress
from remat_kit.sweep.rows import make_row
from remat_kit.sweep.run import analyse_group, failed_before

from .steps import (
    HostArguments,
    ProgramRun,
    StepRun,
    argument_signature,
    host_arguments,
    run_and_time,
)

_progress_bar = progress  # run_program_sweep's argument of the same name hides the function


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
            advance(1, f"{program.name} {labels[label]}")
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
    timed): ``(reports, executables, measurements)`` by label
    (:func:`remat_kit.sweep.run.analyse_group`)."""
    if not todo:
        return {}, {}, {}
    failed = failed_before(list(todo), before_policy)

    def make_run(label: str, program: Program, compiled: Any) -> StepRun:
        pure = program.step(todo[label])
        return ProgramRun(program, pure, compiled, host, *steps)

    def measure(program: Program, reports: Mapping[str, Any], engine: Any) -> tuple[dict, dict]:
        ok = {k: s for k, s in todo.items() if not isinstance(reports[k], BaseException)}
        return run_and_time(program, ok, reports, engine, make_run, advance, program.name)

    return analyse_group(
        lambda: program, todo, T.LOCAL, advance, program.name, failed=failed, measure=measure
    )
