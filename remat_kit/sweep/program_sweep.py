"""Sweep remat policies over a user's own :class:`~remat_kit.program.Program`.

For each policy given (cut down to the program's ``checkpoint_name`` tags,
:func:`remat_kit.policies.policies_for_tags`), by default the set ``analyze`` compiles on a
program (:func:`remat_kit.memory.api.program_policies`: the policies that act on its tags
and specs in its own tag names),
:func:`run_program_sweep`

1. analyses the step with :func:`remat_kit.memory.analyze_policies`, every policy
   compiled together as ``remat-kit analyze --model`` compiles them (the same figures): compiled
   peak, residuals by the program's tags (from its loss), recompute ratio against the same step
   without remat; compiled once, with full optimisation, for the local device: the executable
   that runs is the analyzer's (``compile_reused``);
2. runs each policy's step on the program's arguments (its own arrays, or values materialised
   from its ``ShapeDtypeStruct`` s: :func:`host_arguments`), donated state fed back:
   ``warmup_steps`` untimed then ``timed_steps`` timed steps, each ended by
   ``jax.block_until_ready``, the policies' steps interleaved where the backend reports no
   per-program peak (the CPU; :func:`remat_kit.sweep.measure.time_runs`); median step time,
   process CPU time, the loss of every step (when the step returns one), the measured peak
   where the backend gives it (None on the CPU);
3. appends one row per policy to the JSONL results file (:mod:`remat_kit.sweep.results`, one
   fsync-ed write each).

Rows have the preset sweep's fields; those that do not apply to a program (``batch_size``,
``seq_len``, ``model_config``, model FLOPs, ``tokens_per_s``, ``mfu``) are None. A row's key is
the program's name and the policy's label (its registered name, or ``tag=action,...`` for a
per-tag spec), with the step counts; ``resume`` skips the keys already in the file. A failure at
one policy gives a row with status ``oom`` / ``error`` and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit import targets as T
from remat_kit import validation as V
from remat_kit.memory.api import analyze_policies, program_policies, program_tags, traced_step
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import (
    PolicySpec,
    check_tags,
    cut_label,
    get_policy_spec,
    parse_policy_arg,
    policies_for_tags,
    policy_arg,
    policy_specs,
)
from remat_kit.program import Program, Pure, require_program
from remat_kit.sweep import results as R
from remat_kit.sweep.checks import classify, error_message
from remat_kit.sweep.measure import (
    RunStep,
    StepRun,
    can_interleave,
    compile_run_steps,
    time_runs,
)
from remat_kit.sweep.output import SweepRun, prepare_output
from remat_kit.sweep.output import progress as progress_bar
from remat_kit.sweep.rows import ANALYSIS_KEYS, MEASURED_KEYS, analysis_fields

#: Seed of the values given to abstract float arguments (the same for every policy and run).
ARGUMENT_SEED = 0
#: Scale of those values: ``|N(0, 1)| * ARGUMENT_SCALE``.
ARGUMENT_SCALE = 0.02
#: How abstract arguments are given values (stored in each row's ``arguments_note``).
MATERIALISED_NOTE = (
    f"abstract (ShapeDtypeStruct) leaves materialised: float ones {ARGUMENT_SCALE} x |N(0, 1)| "
    f"from jax.random.key({ARGUMENT_SEED}) (non-negative, so an optimizer's second moments stay "
    f"valid), integer and boolean ones zeros, PRNG keys split from key({ARGUMENT_SEED})"
)


@dataclasses.dataclass(frozen=True)
class HostArguments:
    """The step's arguments as host (numpy) arrays, the same for every policy.

    Attributes:
      values: the pure step's arguments (``args`` of :class:`remat_kit.program.Pure`): numpy leaves,
        :class:`HostKey` for typed PRNG keys (:func:`device_arguments` places them).
      source: ``"concrete"`` (the program's own arrays), ``"materialised"`` (every array leaf
        was a ``ShapeDtypeStruct``) or ``"partly materialised"``.
      note: how abstract leaves got their values (None when there were none).
    """

    values: tuple[Any, ...]
    source: str
    note: str | None


@dataclasses.dataclass(frozen=True)
class HostKey:
    """A typed PRNG key array kept on the host: its raw data and its implementation."""

    data: np.ndarray
    impl: Any


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(x: Any) -> Any:
    if _is_key(x):
        return HostKey(np.asarray(jax.random.key_data(x)), jax.random.key_impl(x))
    return np.asarray(jax.device_get(x))


def device_arguments(values: Any) -> Any:
    """Fresh device copies of host arguments (numpy leaves and :class:`HostKey` s), which a
    step may donate without touching ``values``."""

    def place(x: Any) -> Any:
        if isinstance(x, HostKey):
            return jax.random.wrap_key_data(jnp.asarray(x.data), impl=x.impl)
        return jax.device_put(x) if isinstance(x, np.ndarray) else x

    return jax.block_until_ready(
        jax.tree.map(place, values, is_leaf=lambda x: isinstance(x, HostKey))
    )


def argument_signature(host: HostArguments) -> list[list[Any]]:
    """``[shape, dtype]`` of every leaf of ``host`` (a key: its raw data's, dtype ``key<impl>``;
    a non-array leaf: its type), for telling whether two runs had the same arguments."""

    def one(x: Any) -> list[Any]:
        if isinstance(x, HostKey):
            return [list(x.data.shape), f"key<{x.impl}>"]
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return [list(x.shape), str(x.dtype)]
        return [None, type(x).__name__]

    return [one(x) for x in jax.tree.leaves(host.values, is_leaf=lambda x: isinstance(x, HostKey))]


def _materialise(leaf: jax.ShapeDtypeStruct, key: jax.Array) -> Any:
    """Values for an abstract leaf (see :data:`MATERIALISED_NOTE`); keys from the fixed seed."""
    dtype = leaf.dtype
    if _is_key(leaf):  # keys of the argument's own implementation, split from the fixed seed
        n = math.prod(leaf.shape)
        impl = str(dtype).removeprefix("key<").removesuffix(">")  # key<rbg>; key<fry>: default
        try:
            base = jax.random.key(ARGUMENT_SEED, impl=impl)
        except ValueError:  # a short name jax.random.key does not take (fry: threefry2x32)
            base = key
        return _to_host(jax.random.split(base, max(1, n))[:n].reshape(leaf.shape))
    if jnp.issubdtype(dtype, jnp.inexact):
        values = jnp.abs(jax.random.normal(key, leaf.shape, jnp.float32)) * ARGUMENT_SCALE
        return np.asarray(values.astype(dtype))
    return np.zeros(leaf.shape, dtype)


def host_arguments(pure: Pure) -> HostArguments:
    """The arguments of ``pure`` (a program's step under any policy: the arguments do not depend
    on it) on the host, abstract leaves materialised (see :data:`MATERIALISED_NOTE`); the note
    names the arguments that had them (``opt_state filled in: ...``)."""
    seed_keys = iter(jax.random.split(jax.random.key(ARGUMENT_SEED), max(1, _count(pure.args))))
    values, filled, arrays, abstract = [], [], 0, 0
    for i, arg in enumerate(pure.args):
        leaves, treedef = jax.tree.flatten(arg)
        out, n = [], 0
        for leaf in leaves:
            key = next(seed_keys)
            if isinstance(leaf, jax.ShapeDtypeStruct):
                out.append(_materialise(leaf, key))
                n += 1
            elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                out.append(_to_host(leaf))
            else:
                out.append(leaf)
        arrays += sum(hasattr(x, "shape") for x in leaves)
        abstract += n
        if n:
            filled.append(pure.names[i] if i < len(pure.names) else f"argument {i}")
        values.append(jax.tree.unflatten(treedef, out))
    source = "concrete" if not abstract else "materialised" if abstract == arrays else (
        "partly materialised")  # fmt: skip
    note = f"{', '.join(filled)} filled in: {MATERIALISED_NOTE}" if abstract else None
    return HostArguments(tuple(values), source, note)


def _count(args: Any) -> int:
    return len(jax.tree.leaves(args))


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves if hasattr(x, "shape"))


def _candidates(tree: Any, path: tuple = (), depth: int = 3):
    """``(path, subtree)`` of ``tree`` and of its tuple / list / dict members, pre-order."""
    yield path, tree
    if depth == 0 or not isinstance(tree, (tuple, list, dict)):
        return
    for k, sub in tree.items() if isinstance(tree, dict) else enumerate(tree):
        yield from _candidates(sub, (*path, k), depth - 1)


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def feedback_paths(args: Sequence[Any], out: Any, donated: Sequence[int]) -> dict[int, tuple]:
    """Where, in the step's output ``out``, the updated value of each donated argument is: the
    first unclaimed subtree (pre-order, through tuples, lists and dicts) with the argument's
    tree structure, shapes and dtypes. Donated arguments with no such subtree are left out.

    Args:
      args: the step's arguments (arrays or ``ShapeDtypeStruct`` s).
      out: its output (arrays or ``ShapeDtypeStruct`` s, e.g. from ``jax.eval_shape``).
      donated: the donated argument positions.
    """
    found: dict[int, tuple] = {}
    claimed: list[tuple] = []
    for i in donated:
        want = _signature(args[i])
        for path, sub in _candidates(out):
            overlaps = any(path[: len(c)] == c or c[: len(path)] == path for c in claimed)
            if not overlaps and _signature(sub) == want:
                found[i] = path
                claimed.append(path)
                break
    return found


def loss_path(out: Any, claimed: Sequence[tuple]) -> tuple | None:
    """The path of the step's loss in ``out``: its only float scalar outside the updated state
    (``claimed``), or a ``"loss"`` entry of a dict; None when there is none or several."""
    scalars = []
    for path, sub in _candidates(out):
        if any(path[: len(c)] == c for c in claimed):
            continue
        if path and path[-1] == "loss" and hasattr(sub, "shape") and sub.shape == ():
            return path
        if hasattr(sub, "dtype") and sub.shape == () and jnp.issubdtype(sub.dtype, jnp.inexact):
            scalars.append(path)
    return scalars[0] if len(scalars) == 1 else None


class ProgramRun(StepRun):
    """The steps of a program's compiled step under one policy (:func:`time_runs` times them).

    The arguments start from ``host`` (copied to the device for this policy). A donated
    argument is fed the step's updated value of it (:func:`feedback_paths`); one whose update
    the output does not hold is copied from the host again before each step, outside the timer.
    The loss is the output's :func:`loss_path` (None when it has no single float scalar).
    :meth:`result` adds ``fed_back`` (names of the donated arguments fed the step's output) and
    ``recopied`` (those copied again).
    """

    def __init__(self, program: Program, pure: Pure, compiled: Any, host: HostArguments,
                 warmup: int, timed: int):  # fmt: skip
        super().__init__(warmup, timed)
        self.compiled, self.host = compiled, host
        donated = program.donated(pure)
        self.args: list[Any] | None = list(device_arguments(host.values))
        shapes = jax.eval_shape(pure.fn, *self.args)
        self.paths = feedback_paths(self.args, shapes, donated)
        self.loss_at = loss_path(shapes, list(self.paths.values()))
        self.recopy = [i for i in donated if i not in self.paths]
        self.names = pure.names

    def prepare(self, i: int) -> None:
        for j in self.recopy if i else ():
            self.args[j] = device_arguments(self.host.values[j])  # type: ignore[index]

    def call(self) -> Any:
        return jax.block_until_ready(self.compiled(*self.args))  # type: ignore[misc]

    def finish(self, out: Any) -> float | None:
        for j, path in self.paths.items():
            self.args[j] = _get(out, path)  # type: ignore[index]
        return None if self.loss_at is None else float(_get(out, self.loss_at))

    def release(self) -> None:
        self.args = None

    def result(self) -> dict[str, Any]:
        out = super().result()
        return {
            **out,
            "losses": out["losses"] if self.loss_at is not None else None,
            "fed_back": [self.names[j] for j in sorted(self.paths)],
            "recopied": [self.names[j] for j in self.recopy],
        }


#: Row fields of a program sweep beyond the preset sweep's.
PROGRAM_KEYS = (
    "program", "program_tags", "policy_spec", "policy_label", "policy_notes",
    "residual_bytes_by_tag",
    "arguments", "arguments_note", "fed_back", "recopied",
)  # fmt: skip


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
    """Elements of the differentiated loss arguments (None without a loss)."""
    if program.make_loss is None:
        return None
    leaves = jax.tree.leaves([program.loss_args[i] for i in program.argnums])
    return sum(int(x.size) for x in leaves if hasattr(x, "size"))


def _by_tag(report: Any) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in report.residuals:
        per = out.setdefault(r.tag, {})
        per[r.memory] = per.get(r.memory, 0) + r.nbytes
    return out


def select_policies(
    program: Program, policies: Sequence[str | PolicySpec] | None, tags: frozenset[str]
) -> tuple[list[PolicySpec], list[str], dict[str, list[str]], dict[str, str]]:
    """The specs to sweep, the notes on the policies cut down to the program's tags or skipped
    (:meth:`remat_kit.policies.TagFit.notes`), each cut-down spec's note by its row key
    (:func:`~remat_kit.policies.policy_arg`), and labels by row key as analyze, the doctor and
    recommend give them (:meth:`remat_kit.memory.api.ProgramPolicies.labels`: ``minimal
    (cut)``, ``custom: attn_in=save``; given policies: the cut-down ones').

    Raises:
      ValueError: an unknown policy; a per-tag spec naming a tag the program does not emit;
        no policy left.
    """
    if policies is None:  # the default set, as analyze and the doctor have it
        chosen = program_policies(program, "local", tags=tags)
        if not chosen.specs:
            raise ValueError(f"no policy acts on program {program.name!r}")
        per_label: dict[str, list[str]] = {}
        for (_, cut), note in zip(chosen.restricted, chosen.notes, strict=False):
            per_label.setdefault(policy_arg(cut), []).append(note)
        named = zip(chosen.specs, chosen.labels(), strict=True)
        labels = {policy_arg(s): label for s, label in named}
        return list(chosen.specs), list(chosen.notes), per_label, labels
    given = list(policies)
    fit = policies_for_tags([parse_policy_arg(p) if isinstance(p, str) else p for p in given], tags)
    registered = policy_specs()
    cuts = [cut for _, cut in fit.restricted]
    for spec in fit.specs:
        if registered.get(spec.name) != spec and spec not in cuts:
            check_tags(spec, tags, f"program {program.name!r}")
    if not fit.specs:
        emits = ", ".join(sorted(tags)) or "no checkpoint_name tags"
        raise ValueError(f"no policy given acts on program {program.name!r} (emits: {emits})")
    notes = fit.notes(f"program {program.name!r}")
    per_label: dict[str, list[str]] = {}
    for cut, note in zip(cuts, notes, strict=False):  # one note per restricted spec, in order
        per_label.setdefault(policy_arg(cut), []).append(note)
    return list(fit.specs), notes, per_label, _cut_labels(fit.restricted)


def _cut_labels(restricted: Sequence[tuple[PolicySpec, PolicySpec]]) -> dict[str, str]:
    """{row key of a cut-down spec: its label}, from (registered policy, cut spec) pairs."""
    names: dict[str, list[str]] = {}
    for named, cut in restricted:
        names.setdefault(policy_arg(cut), []).append(named.name)
    return {key: cut_label(n) for key, n in names.items()}


def _row(common: dict, point: dict, report: Any, extra: dict, executable: Any,
         measurement: Any) -> dict[str, Any]:  # fmt: skip
    """The row of one policy: the analysis ``report``, its compiled step and run (each the
    result or the exception), as the preset sweep's rows."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"format": R.ROW_FORMAT, "key": R.point_key(point), **common}
    row.update(point, status="ok", error=None)
    row.update(dict.fromkeys(ANALYSIS_KEYS))
    row.update({k: common.get(k) for k in PROGRAM_KEYS}, **extra)
    measured: dict[str, Any] = dict.fromkeys(MEASURED_KEYS)
    try:
        for got in (report, executable, measurement):
            if isinstance(got, BaseException):
                raise got
        row.update(analysis_fields(report), residual_bytes_by_tag=_by_tag(report))
        _, compile_s, reused = executable
        measured.update(compile_s=round(compile_s, 3), compile_reused=reused)
        result = dict(measurement)
        row.update(fed_back=result.pop("fed_back"), recopied=result.pop("recopied"))
        measured.update(result)
        if measured["measured_peak_bytes"]:
            measured["peak_error"] = row["peak_bytes"] / measured["measured_peak_bytes"] - 1
    except Exception as err:
        row["status"], row["error"] = classify(err), error_message(err)
    row.update(measured)
    row.update(point_s=round(time.perf_counter() - t0, 3), time=R.now_utc())
    return row


def _analyse_and_run(
    program: Program, specs: dict[str, PolicySpec], failed: dict, host: HostArguments,
    steps: tuple[int, int], advance: Callable,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Reports, compiled steps and measurements (each the result or the exception) by label.

    The policies are analysed as ``remat-kit analyze --model`` analyses them (the same
    figures) with full code-generation optimisation, in one engine that keeps the
    executables; each step to run is the analyzer's program (:func:`traced_step`), so it is
    not compiled again. The steps are timed interleaved where
    :func:`~remat_kit.sweep.measure.can_interleave` allows (the CPU), else one after the other.
    ``failed``: labels already failed, with why.
    """
    live = {label: s for label, s in specs.items() if label not in failed}
    local = T.get_target(T.LOCAL)
    with CompileEngine() as engine:
        advance(None, f"analysing {program.name} ({len(live)} policies)")
        try:
            reports = analyze_policies(
                program, list(live.values()), local, raise_errors=False, fast_compile=False,
                engine=engine,
            )  # fmt: skip
        except Exception as err:  # the whole analysis failed: every policy gets the error
            reports = [err] * len(live)
        reports = {**failed, **dict(zip(live, reports, strict=True))}
        ok = [label for label in live if not isinstance(reports[label], BaseException)]
        to_compile: dict[str, RunStep | BaseException] = {}
        for label in ok:
            try:
                _, stage = traced_step(program, live[label], program.place(local))
                to_compile[label] = RunStep(f"the step of {label}", local, stage.lower)
            except Exception as err:
                to_compile[label] = err
        advance(None, f"compiling {len(ok)} steps of {program.name}")
        executables = compile_run_steps(to_compile, engine)
        ran = [k for k in ok if isinstance(executables[k], tuple)]
        interleave = can_interleave(ran, [reports[k].argument_bytes for k in ran])
        how = " interleaved" if interleave else ""
        advance(None, f"timing {len(ran)} steps of {program.name}{how}")
        makers = [
            functools.partial(
                ProgramRun, program, program.step(live[k]), executables[k][0], host, *steps
            )
            for k in ran
        ]
        measurements = dict(zip(ran, time_runs(makers, interleave), strict=True))
    return reports, executables, measurements


def _check(program: Program, warmup_steps: int, timed_steps: int) -> None:
    require_program(program)
    V.positive_int("timed_steps", timed_steps)
    if warmup_steps != 0:
        V.positive_int("warmup_steps (or 0)", warmup_steps)
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
      program: a :class:`~remat_kit.program.Program` (:func:`remat_kit.program.load_program`
        reads one from ``MODULE:FACTORY`` / ``FILE.py:FACTORY``).
      out: the JSONL results file (created with its folders).
      policies: names, per-tag text or specs, narrowed to those acting on the program's tags
        (:func:`remat_kit.policies.policies_for_tags`); default: the set ``analyze`` compiles on
        the program (:func:`remat_kit.memory.api.program_policies`).
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
        tag the program does not emit, or no policy acting on its tags; ``out`` not writable,
        holding rows without ``resume`` / ``overwrite``, or rows of another program or step
        counts. Nothing is written then.
    """
    start = time.perf_counter()
    _check(program, warmup_steps, timed_steps)
    tags = program_tags(program)
    specs, notes, per_label, cut_labels = select_policies(program, policies, tags)
    host = host_arguments(program.step(get_policy_spec("no-remat")))
    identity = _identity(program, host, warmup_steps, timed_steps)
    path = Path(out)
    done = prepare_output(path, identity, resume, overwrite)
    by_label: dict[str, PolicySpec] = {}
    for s in specs:
        by_label.setdefault(policy_arg(s), s)
    points = {label: _point(program, label, warmup_steps, timed_steps) for label in by_label}
    todo = {label: s for label, s in by_label.items() if R.point_key(points[label]) not in done}
    common = {"sweep": program.name, "config_fingerprint": R.fingerprint(identity),
              "sweep_config": identity, **R.environment(),
              "program": ref or program.name, "program_tags": sorted(tags)}  # fmt: skip
    failed: dict[str, BaseException] = {}
    for label in todo:
        try:
            if before_policy is not None:
                before_policy(label)
        except Exception as err:
            failed[label] = err
    written: list[dict[str, Any]] = []
    with progress_bar(progress, console, len(todo)) as advance:
        reports, executables, measurements = (
            _analyse_and_run(program, todo, failed, host, (warmup_steps, timed_steps), advance)
            if todo else ({}, {}, {})
        )  # fmt: skip
        for label, spec in todo.items():
            extra = {
                "policy_spec": spec.description, "policy_label": cut_labels.get(label, label),
                "policy_notes": per_label.get(label, []), "arguments": host.source,
                "arguments_note": host.note, "num_params": _num_params(program),
            }  # fmt: skip
            row = _row(
                common, points[label], reports[label], extra, executables.get(label),
                measurements.get(label),
            )  # fmt: skip
            R.append_row(path, row)
            written.append(row)
            advance(1, f"{program.name} {label}")
    rows = [*done.values(), *written]
    wall = time.perf_counter() - start
    return SweepRun(path, rows, written, len(by_label) - len(todo), wall, notes)
