"""Run a step on the local device: the executable (the analyzer's, or compiled through its
engine), its arguments placed (a preset's initial state and text batches; a program's own
arrays, abstract ones given values), its steps timed, interleaved across policies where the
backend allows (:func:`run_and_time`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from trainer.data import Corpus

from remat_kit import targets as T
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import PolicySpec, policy_label
from remat_kit.program import Program
from remat_kit.pure import Pure
from remat_kit.sweep.config import Point
from remat_kit.trace import trace_step
from remat_kit.training.step import TrainState, abstract_batch, make_optimizer
from remat_kit.zoo.facts import initial_state, mesh_train_step


def peak_bytes_in_use() -> int | None:
    """The largest ``peak_bytes_in_use`` over this process's devices (None: not reported)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and stats.get("peak_bytes_in_use") is not None:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def _device_batch(batcher: Any, step: int, sharding: Any) -> dict[str, jax.Array]:
    """Batch ``step`` (int32 [b, s] inputs and targets) placed as the compiled step takes it
    (``sharding``: its input shardings of the batch; on a mesh, split over (dp, fsdp), each
    process placing its own rows)."""
    inputs, targets = batcher.batch_at(step)
    batch = T.put_global({"inputs": inputs, "targets": targets}, sharding)
    return jax.block_until_ready(batch)


def host_state(point: Point, cache: dict | None) -> TrainState:
    """The point's initial train state as host (numpy) arrays
    (:func:`remat_kit.zoo.facts.initial_state`): the same values for every policy, so made
    once per model, optimizer and seed (in ``cache``) and copied to the device by each point
    (its step donates, i.e. consumes, the copy)."""
    key = (point.model, point.overrides, point.remat_group_size, point.optimizer,
           point.learning_rate, point.seed)  # fmt: skip
    host = None if cache is None else cache.get(key)
    if host is None:
        optimizer = make_optimizer(point.optimizer, learning_rate=point.learning_rate)
        host = initial_state(point.model, optimizer, point.seed, **point.changes)
        if cache is not None:
            cache[key] = host
    return host


@dataclasses.dataclass
class RunStep:
    """A step to compile for a run, for :meth:`CompileEngine.compile_all`: ``lower`` returns it
    lowered for the local device(s); ``what`` names it in errors."""

    what: str
    target: T.Target
    lower: Any
    program_key: str | None = None


def lower_mesh_step(point: Point, state_cache: dict | None) -> Any:
    """A preset point's training step on a mesh, lowered for the local devices with its input
    and output shardings fixed (the state is fed back each step; the analyzer's program on the
    target's devices leaves the output shardings to XLA). State [the model's parameters and
    optimizer state], batch int32 [batch, seq] inputs and targets.

    Raises:
      ValueError: a mesh the local devices cannot form (:func:`remat_kit.targets.local_mesh`).
    """
    host = host_state(point, state_cache)
    optimizer = make_optimizer(point.optimizer, learning_rate=point.learning_rate)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
    mesh = T.local_mesh(point.mesh)
    step = mesh_train_step(
        point.model, optimizer, mesh, remat_policy=point.remat_policy, **point.changes
    )
    return step.lower(state, abstract_batch(point.batch_size, point.seq_len))


def compile_run_steps(
    steps: dict[str, RunStep | BaseException],
    engine: CompileEngine | None = None,
    lower_s: dict[str, float] | None = None,
) -> dict[str, tuple[Any, float, bool] | BaseException]:
    """Compile the steps to run through ``engine`` (a pool, identical programs once, full
    code-generation optimisation; a new engine when None): a program the engine already holds
    (the analyzer's compile of the same step) is not compiled again.

    Args:
      steps: by key, the step, or the exception making it raised.
      lower_s: seconds spent lowering, by key, added to the compile's.

    Returns:
      By key: ``(compiled executable, seconds lowering it plus compiling it, whether the
      executable was the engine's already)``, or the exception lowering or compiling raised.
    """
    out: dict[str, Any] = {k: s for k, s in steps.items() if isinstance(s, BaseException)}
    todo = [(k, s) for k, s in steps.items() if not isinstance(s, BaseException)]
    with contextlib.nullcontext(engine) if engine else CompileEngine() as eng:
        held = set(eng.held())
        results = eng.compile_all([s for _, s in todo], fast=False, executable=True)
        for (key, _), (program, result) in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                out[key] = result
            else:
                seconds = (lower_s or {}).get(key, 0.0) + result.compile_s
                out[key] = (result.compiled, seconds, program in held)
    return {k: out[k] for k in steps}


def run_executables(
    program: Program,
    specs: Mapping[str, PolicySpec],
    reports: Mapping[str, Any],
    engine: CompileEngine,
    lower: Callable[[str], Any] | None = None,
) -> dict[str, tuple[Any, float, bool] | BaseException]:
    """The executables to run, by key: the analysis's own where ``engine`` holds it (its report's
    ``program_sha256``: the step that runs is the program the analyzer compiled, state donated,
    same shardings, so it is neither traced nor compiled again); else the step lowered for the
    local device (``lower(key)``, by default :func:`remat_kit.trace.trace_step` of the
    program under the key's spec) and compiled by :func:`compile_run_steps`. ``lower`` given
    (a preset on a mesh: :func:`lower_mesh_step`) always lowers.

    Returns:
      By key, as :func:`compile_run_steps` (seconds: the analysis compile's for a held one).
    """
    local = T.get_target(T.LOCAL)
    held: dict[str, tuple[Any, float, bool]] = {}
    steps: dict[str, RunStep | BaseException] = {}
    lower_s: dict[str, float] = {}
    for key, spec in specs.items():
        found = None if lower else engine.executable(getattr(reports[key], "program_sha256", None))
        if found is not None:
            held[key] = (found.compiled, found.compile_s, True)
            continue
        t0 = time.perf_counter()
        try:
            if lower is None:
                low = trace_step(program, spec, program.place(local))[1].lower()
            else:
                low = lower(key)
        except Exception as err:
            steps[key] = err
            continue
        lower_s[key] = time.perf_counter() - t0
        what = f"the step of {program.name!r} under {policy_label(spec)!r}"
        steps[key] = RunStep(what, local, lambda low=low: low)
    out = {**held, **compile_run_steps(steps, engine, lower_s)}
    return {k: out[k] for k in specs}


def run_and_time(
    program: Program,
    specs: Mapping[str, PolicySpec],
    reports: Mapping[str, Any],
    engine: CompileEngine,
    make_run: Callable[[str, Program, Any], StepRun],
    advance: Callable,
    what: str,
    lower: Callable[[str], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Compile the steps of ``specs`` (by key; :func:`run_executables`, ``lower`` as there)
    and time them (``make_run(key, program, executable)``, :func:`time_runs`, interleaved
    where :func:`can_interleave` allows: the CPU); progress lines through ``advance``.

    Returns:
      ``(executables, measurements)`` by key, each the result or the exception.
    """
    advance(None, f"compiling {len(specs)} steps of {what}")
    executables = run_executables(program, specs, reports, engine, lower)
    ran = [k for k in specs if isinstance(executables[k], tuple)]
    if not ran:
        return executables, {}
    interleave = can_interleave(ran, [reports[k].argument_bytes for k in ran])
    how = " interleaved" if interleave else ""
    advance(None, f"timing {len(ran)} steps of {what}{how}")
    makers = [functools.partial(make_run, k, program, executables[k][0]) for k in ran]
    rounds = functools.partial(_timed_round, advance, f"timing {what}{how}")
    return executables, dict(zip(ran, time_runs(makers, interleave, rounds), strict=True))


def _timed_round(advance: Callable, what: str, done: int, total: int) -> None:
    advance(None, f"{what}: round {done} of {total} done")


class StepRun:
    """One program's steps, taken one at a time (:func:`time_runs`): ``warmup`` untimed then
    ``timed`` timed steps, each ended by ``jax.block_until_ready``. A failure (a non-finite
    loss, what JAX raises) ends the run and is kept. Subclasses give :meth:`prepare` (before
    step ``i``'s timer starts), :meth:`call` (the timed step) and :meth:`finish` (after the
    timer: the step's loss or None)."""

    def __init__(self, warmup: int, timed: int):
        self.warmup, self.steps = warmup, warmup + timed
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.error: BaseException | None = None

    def prepare(self, i: int) -> None:
        """Untimed work before step ``i`` (placing its batch)."""

    def call(self) -> Any:
        """Run one step to completion (``jax.block_until_ready``); its output."""
        raise NotImplementedError

    def finish(self, out: Any) -> float | None:
        """Keep what step's output ``out`` feeds the next step; its loss (None: no loss)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop the run's device state (after its last step or a failure)."""

    def step(self, i: int) -> None:
        """Run step ``i`` (a no-op past the last step or after a failure)."""
        if i >= self.steps or self.error is not None:
            return
        try:
            self.prepare(i)
            start, cpu_start = time.perf_counter(), time.process_time()
            out = self.call()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            loss = self.finish(out)
            if loss is not None:
                self.losses.append(loss)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss at step {i} is {loss}")
        except Exception as err:
            self.error = err
            self.release()
            return
        if i >= self.warmup:
            self.times.append(elapsed)
            self.cpu_times.append(cpu)
        if i == self.steps - 1:
            self.release()  # its device memory goes now, not after the other runs

    def result(self) -> dict[str, Any]:
        """``step_times_s`` (wall seconds of the timed steps), ``step_time_s`` (their median),
        ``step_cpu_times_s`` / ``step_cpu_s`` (process CPU seconds, all threads), ``losses``.

        Raises:
          The exception that ended the run.
        """
        if self.error is not None:
            raise self.error
        return {
            "step_times_s": [round(t, 6) for t in self.times],
            "step_time_s": statistics.median(self.times),
            "step_cpu_times_s": [round(t, 6) for t in self.cpu_times],
            "step_cpu_s": statistics.median(self.cpu_times),
            "losses": self.losses,
        }


class PresetRun(StepRun):
    """A preset point's training steps: its initial state (:func:`host_state`) on the device,
    its batches from the corpus (batch ``i``: ``corpus.batcher(b, s, seed).batch_at(i)``, placed
    before its timer starts), the state donated and fed back."""

    def __init__(self, point: Point, compiled: Any, corpus: Corpus, host: TrainState):
        super().__init__(point.warmup_steps, point.timed_steps)
        self.point, self.compiled = point, compiled
        # Laid out as the compiled step takes them: one device, or sharded over the point's mesh.
        (state_sharding, self.batch_sharding), _ = compiled.input_shardings
        self.state = jax.block_until_ready(T.put_global(host, state_sharding))
        self.batcher = corpus.batcher(point.batch_size, point.seq_len, seed=point.seed)
        self.batch: Any = None

    def prepare(self, i: int) -> None:
        self.batch = _device_batch(self.batcher, i, self.batch_sharding)

    def call(self) -> Any:
        return jax.block_until_ready(self.compiled(self.state, self.batch))

    def finish(self, out: Any) -> float:
        self.state, metrics = out
        return float(metrics["loss"])

    def release(self) -> None:
        self.state = self.batch = None


def can_interleave(points: Sequence[Any], state_bytes: Sequence[int]) -> bool:
    """Whether the steps of ``points`` (points or policies) may be timed interleaved: the local
    backend reports no per-program peak (:func:`peak_bytes_in_use` is None, as on the CPU:
    nothing to measure alone) and their states (``state_bytes``, bytes each) fit in half the
    host's memory together (``os.sysconf``), in a single process (the processes of a
    multi-process run must run their steps in one order; each host's memory is its own). On a
    GPU each point runs alone, so its measured peak is its own."""
    if len(points) < 2 or jax.process_count() > 1 or peak_bytes_in_use() is not None:
        return False
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return sum(state_bytes) <= memory // 2


def time_runs(
    makers: Sequence[Callable[[], StepRun]],
    interleave: bool,
    on_round: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any] | BaseException]:
    """Time each run ``makers`` make (:class:`StepRun`): one after the other, each made just
    before its steps; or with ``interleave`` (see :func:`can_interleave`) every run made
    first and step ``i`` of every run taken before step ``i + 1`` of any, in the order
    :func:`round_order` gives step ``i``: a drift of the machine's speed (other processes,
    clocks) then falls on every policy alike instead of on whichever ran during it, and no run
    always follows the same one (a run right after another of the same executable measures
    faster, warm: docs/sweep.md).

    ``on_round(done, total)`` is called after each round of interleaved steps (after each run
    when they run one after the other), for progress.

    Returns:
      Per run, in order: :meth:`StepRun.result` with ``measured_peak_bytes`` /
      ``measured_peak_note`` and ``step_order`` (``"alone"`` / ``"interleaved"``), or the
      exception making or running it raised.
    """
    results: list[dict[str, Any] | BaseException] = []
    tell = on_round or (lambda done, total: None)
    if not interleave:
        for n, make in enumerate(makers, 1):
            before = peak_bytes_in_use()
            try:
                run = make()
                for i in range(run.steps):
                    run.step(i)
                results.append({
                    **run.result(), **measured_peak(before), "step_order": "alone",
                    "load_average": load_average(),
                })  # fmt: skip
            except Exception as err:
                results.append(err)
            tell(n, len(makers))
        return results
    runs: list[StepRun | BaseException] = []
    for make in makers:
        try:
            runs.append(make())
        except Exception as err:
            runs.append(err)
    live = [r for r in runs if isinstance(r, StepRun)]
    rounds = max((r.steps for r in live), default=0)
    for i in range(rounds):
        for k in round_order(len(live), i):
            live[k].step(i)
        tell(i + 1, rounds)
    # can_interleave: the backend reports no peak, so none is mixed (the note says it)
    peak = {**measured_peak(None), "step_order": "interleaved", "load_average": load_average()}
    for run in runs:
        try:
            if isinstance(run, BaseException):
                raise run
            results.append({**run.result(), **peak})
        except Exception as err:
            results.append(err)
    return results


def round_order(n: int, i: int) -> list[int]:
    """The order of ``n`` runs in round ``i`` of interleaved timing: row ``i`` (cyclically) of
    a Williams design, a Latin square in which every run takes every position once and follows
    every other run equally often (once over the ``n`` rows for even ``n``; twice over ``2n``
    rows, each row and its mirror image, for odd ``n``), so what one run leaves behind (warm
    caches, a freed allocation) does not always fall on the same next run. E. J. Williams,
    "Experimental designs balanced for the estimation of residual effects of treatments",
    Australian Journal of Scientific Research A 2(2), 1949: first row ``0, 1, n-1, 2, n-2, ...``,
    row ``j`` that row plus ``j`` modulo ``n``.

    Raises:
      ValueError: ``n`` below 1 or ``i`` negative.
    """
    if n < 1 or i < 0:
        raise ValueError(f"round_order needs n >= 1 and i >= 0, got n={n}, i={i}")
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = n if n % 2 == 0 else 2 * n
    j = i % rows
    row = [(x + j % n) % n for x in first]
    return row[::-1] if j >= n else row


def load_average() -> list[float] | None:
    """The machine's 1-, 5- and 15-minute load averages (``os.getloadavg``) right after a
    point's steps were timed: other work on the cores slows them (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def measured_peak(before: int | None) -> dict[str, Any]:
    """``measured_peak_bytes`` (bytes: :func:`peak_bytes_in_use` now, when it rose above
    ``before``, the value read before the run; else None) and ``measured_peak_note`` (why)."""
    after = peak_bytes_in_use()
    if after is None:
        peak, note = None, f"the {jax.default_backend()} backend reports no peak_bytes_in_use"
    elif before is not None and after <= before:
        peak = None
        note = "peak_bytes_in_use did not rise above an earlier point's peak in this process"
    else:
        peak = int(after)
        note = "memory_stats()['peak_bytes_in_use'] after the point (largest over devices)"
    return {"measured_peak_bytes": peak, "measured_peak_note": note}


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
      values: the pure step's arguments (``args`` of :class:`remat_kit.pure.Pure`): numpy leaves,
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
