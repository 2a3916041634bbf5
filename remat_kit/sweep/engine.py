"""Engines: what runs a sweep's tasks (:class:`~remat_kit.sweep.tasks.Task`) and reports them
back to the driver, which appends each task's rows as it finishes, in whatever order.

An engine's :meth:`run` takes the tasks and a factory of task runners (picklable: called once
in each process that runs tasks, e.g. ``functools.partial(TaskRunner, setup)``; the runner,
called with a task and an ``advance`` for stage lines, returns its rows) and yields
:class:`Event` s: a task started, a task done (its rows, or the exception that lost them).
Its attributes say how it runs them: ``analysis_slots`` / ``device_slots`` (tasks of each kind
side by side, for :func:`~remat_kit.sweep.tasks.make_tasks`), ``local_devices`` (the devices
a local point runs on, for :meth:`~remat_kit.sweep.SweepConfig.points`: None, every device),
``backend`` (where the device tasks run: None, this process's JAX backend) and
``calibrate_here`` (the tasks' local device is this machine's and no worker holds it yet: the
driver times it for the step-time model before they start, and they read its figures).

:class:`SerialEngine` runs every task in the driver's own process, one after the other.
:class:`LocalEngine` runs them side by side on this machine: analysis-only tasks on CPU worker
processes, the local device's tasks each on its own GPU(s) (one worker process per GPU, or per
group of a meshed point's size). :func:`local_engine` picks one for this machine.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from remat_kit import validation as V
from remat_kit.sweep.tasks import Task

#: A factory of task runners: ``make_runner()(task, advance) -> rows``.
RunnerFactory = Callable[[], Callable[[Task, Callable | None], list[dict[str, Any]]]]


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

    analysis_slots = 1
    device_slots = 1
    local_devices: int | None = None
    backend: str | None = None
    calibrate_here = True

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


class WorkerLost(RuntimeError):
    """The process running a task ended before it returned the task's rows (killed, out of
    memory, a crash)."""


#: Seconds a worker process is given to exit once its input is closed, before it is killed.
STOP_S = 30.0


class _Process:
    """One worker process (:mod:`remat_kit.sweep.worker`, run as a file: it imports only what
    its runner and tasks need) and a thread that puts its messages
    on the engine's queue as ``(self, message)``, then ``(self, ("lost", None, exit code))``
    when its output ends."""

    def __init__(
        self, env: Mapping[str, str], make_runner: RunnerFactory, events: queue.Queue, log: Path
    ):
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("worker.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=dict(env),
            start_new_session=True,  # a Ctrl-C reaches the driver alone, which stops its workers
        )  # fmt: skip
        self._events = events
        self.send(list(sys.path))  # the worker imports what the driver imports
        self.send(make_runner)
        threading.Thread(target=self._read, name="sweep-worker-reader", daemon=True).start()

    def send(self, message: Any) -> None:
        """Write one message (a worker gone is reported by its reader, not here)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(data)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            pass

    def _read(self) -> None:
        try:
            while True:
                self._events.put((self, pickle.load(self.proc.stdout)))  # type: ignore[arg-type]
        except Exception:  # the end of its output, or a message torn by a kill
            pass
        self._events.put((self, ("lost", None, self.proc.wait())))

    def last_line(self) -> str:
        """The last line the process wrote to standard error ("" when none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")

    def stop(self, kill: bool = False) -> None:
        """End the process: its input closed (it exits when idle; killed if still there after
        :data:`STOP_S`, waited for in a thread), or with ``kill`` killed now."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        if kill:
            self._end(0.0)
        else:
            threading.Thread(target=self._end, args=(STOP_S,), daemon=True).start()

    def _end(self, wait_s: float) -> None:
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class _Thread:
    """Tasks run in a thread of the driver's own process (the local device, where it is not
    handed to worker processes), reporting to the engine's queue as a worker process does."""

    def __init__(self, make_runner: RunnerFactory, events: queue.Queue, advance: Callable):
        self._inbox: queue.Queue = queue.Queue()
        self._make, self._events, self._advance = make_runner, events, advance
        threading.Thread(target=self._loop, name="sweep-local-device", daemon=True).start()

    def send(self, message: Any) -> None:
        self._inbox.put(message)

    def _loop(self) -> None:
        runner = None
        while (message := self._inbox.get()) is not None:
            task_id, task = message
            try:
                runner = runner or self._make()
                self._events.put((self, ("done", task_id, runner(task, self._advance))))
            except Exception as err:
                self._events.put((self, ("failed", task_id, err)))

    def last_line(self) -> str:
        return ""

    def stop(self, kill: bool = False) -> None:
        self._inbox.put(None)


@dataclasses.dataclass
class _Slot:
    """Where one task at a time runs: a worker process with ``env`` (overrides of the driver's
    environment; a value None is unset there), or a thread of the driver (``env`` None); for
    tasks on the local device or not, and on the device, tasks of ``size`` devices."""

    on_device: bool
    env: dict[str, str | None] | None
    size: int = 1
    worker: _Process | _Thread | None = None
    task: tuple[int, Task] | None = None


class LocalEngine:
    """Tasks side by side on this machine.

    Analysis-only tasks run on ``workers`` CPU worker processes (``JAX_PLATFORMS=cpu``). Tasks
    on the local device (measured, or analysed for a local GPU: see
    :func:`~remat_kit.sweep.tasks.make_tasks`) run each on its own GPU(s) where ``gpus`` are
    given: one worker process per GPU, or per group of as many GPUs as a meshed point's mesh
    has, its ``CUDA_VISIBLE_DEVICES`` set to them; without ``gpus``, one at a time in a thread
    of this process (the CPU, or a GPU this process holds). A worker process starts when it has
    a task and exits when none of its kind is left.

    A worker process that ends mid-task (killed, out of memory, a crash) is replaced and its
    task run again, up to ``retries`` times; then each of the task's points gets an error row
    (:class:`WorkerLost`: how the process ended and the last line it wrote to standard error).
    Worker processes are killed when the run stops (a Ctrl-C reaches the driver alone).

    Args:
      workers: processes for analysis-only tasks (>= 1).
      gpus: the GPUs to hand to worker processes (``CUDA_VISIBLE_DEVICES`` ids); None: the
        local device's tasks run in this process.
      retries: times a task whose worker process was lost is run again (>= 0).
      env: environment overrides for every worker process (a value None: unset there).
      log_dir: where each worker process's standard error goes (``worker-N.log``); None: a
        temporary folder, removed when the run ends.
    """

    def __init__(
        self,
        workers: int = 1,
        *,
        gpus: Sequence[str] | None = None,
        retries: int = 1,
        env: Mapping[str, str | None] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ):
        V.positive_int("workers", workers)
        V.nonnegative_int("retries", retries)
        if gpus is not None and not gpus:
            raise ValueError("gpus: give at least one GPU id, or None")
        self.workers, self.retries = workers, retries
        self.gpus = None if gpus is None else [str(g) for g in gpus]
        self.env = dict(env or {})
        self.log_dir = log_dir
        self.analysis_slots = workers
        self.device_slots = len(self.gpus) if self.gpus else 1
        self.local_devices = 1 if self.gpus else None
        self.backend: str | None = None
        self.calibrate_here = self.gpus is None

    def run(
        self, tasks: Sequence[Task], make_runner: RunnerFactory, advance: Callable
    ) -> Iterator[Event]:
        """Run ``tasks`` (see the module docstring).

        Raises:
          ValueError: ``make_runner`` cannot be sent to a worker process (not picklable: a
            lambda or a local function, e.g. a ``before_point`` hook).
        """
        try:
            pickle.dumps(make_runner)
        except Exception as err:
            raise ValueError(
                f"worker processes need a task runner they can import (pickle): {err}"
            ) from None
        with contextlib.ExitStack() as stack:
            logs = Path(self.log_dir or stack.enter_context(tempfile.TemporaryDirectory()))
            logs.mkdir(parents=True, exist_ok=True)
            yield from _Schedule(self, tasks, make_runner, advance, logs).run()

    def device_groups(self, size: int) -> list[list[str]]:
        """The GPUs in groups of ``size`` (contiguous; the rest idle).

        Raises:
          ValueError: more than the engine has.
        """
        gpus = self.gpus or []
        if size > len(gpus):
            raise ValueError(f"a point needs {size} GPUs; the engine has {len(gpus)}")
        return [gpus[i : i + size] for i in range(0, len(gpus) - size + 1, size)]


class _Schedule:
    """One :meth:`LocalEngine.run`: the tasks waiting by kind, the slots, the events."""

    def __init__(self, engine: LocalEngine, tasks, make_runner, advance, logs: Path):
        self.engine, self.make_runner, self.advance, self.logs = engine, make_runner, advance, logs
        self.events: queue.Queue = queue.Queue()
        self.waiting = {
            k: collections.deque(t for t in tasks if t.on_device == k) for k in (False, True)
        }
        cpu = {**engine.env, "JAX_PLATFORMS": "cpu"}
        n = min(engine.workers, len(self.waiting[False]))
        self.slots = [_Slot(False, cpu) for _ in range(n)]
        self.lost: collections.Counter = collections.Counter()
        self.ids = itertools.count()
        self.logs_made = itertools.count()

    def run(self) -> Iterator[Event]:
        try:
            while self.waiting[False] or self.waiting[True] or any(s.task for s in self.slots):
                yield from self._fill()
                try:
                    worker, message = self.events.get(timeout=1.0)
                except queue.Empty:
                    continue
                yield from self._handle(worker, *message)
        finally:
            for slot in self.slots:
                if slot.worker is not None:
                    slot.worker.stop(kill=True)

    def _next(self, slot: _Slot) -> Task | None:
        """The first waiting task the slot can run (of its kind; on a GPU, of its size)."""
        waiting = self.waiting[slot.on_device]
        for i, task in enumerate(waiting):
            if not slot.on_device or self.engine.gpus is None or task.devices == slot.size:
                del waiting[i]
                return task
        return None

    def _fill(self) -> Iterator[Event]:
        """Give every idle slot a task; stop the workers with none left; open device slots
        for the next size of device task once the last size's are done."""
        device = [s for s in self.slots if s.on_device]
        if self.waiting[True] and not device:
            self.slots += self._device_slots(self.waiting[True][0].devices)
        for slot in self.slots:
            if slot.task is not None:
                continue
            task = self._next(slot)
            if task is None:
                if slot.worker is not None:
                    slot.worker.stop()
                    slot.worker = None
                continue
            slot.worker = slot.worker or self._start(slot)
            slot.task = (next(self.ids), task)
            slot.worker.send(slot.task)
            yield Event("start", task)
        self.slots = [s for s in self.slots if s.worker is not None or not s.on_device]

    def _device_slots(self, size: int) -> list[_Slot]:
        if self.engine.gpus is None:
            return [_Slot(True, None)]
        groups = self.engine.device_groups(size)
        n = min(len(groups), sum(t.devices == size for t in self.waiting[True]))
        env = self.engine.env
        return [_Slot(True, {**env, "CUDA_VISIBLE_DEVICES": ",".join(g)}, size) for g in groups[:n]]

    def _start(self, slot: _Slot) -> _Process | _Thread:
        if slot.env is None:
            return _Thread(self.make_runner, self.events, self.advance)
        env = {k: v for k, v in os.environ.items() if slot.env.get(k, "") is not None}
        env.update({k: v for k, v in slot.env.items() if v is not None})
        # what the worker imports of remat_kit is the driver's remat_kit
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        log = self.logs / f"worker-{next(self.logs_made)}.log"
        return _Process(env, self.make_runner, self.events, log)

    def _handle(self, worker: Any, kind: str, task_id: Any, payload: Any) -> Iterator[Event]:
        slot = next((s for s in self.slots if s.worker is worker), None)
        if slot is None or kind == "ready":
            return
        if kind == "lost":
            slot.worker = None
        if slot.task is None or (kind != "lost" and slot.task[0] != task_id):
            return
        task = slot.task[1]
        slot.task = None
        if kind == "done":
            yield Event("done", task, rows=payload)
        elif kind == "failed":
            yield Event("done", task, error=payload)
        else:
            self.lost[task.key] += 1
            if self.lost[task.key] <= self.engine.retries:
                self.waiting[slot.on_device].appendleft(task)
                return
            last = worker.last_line()
            err = WorkerLost(
                f"the worker process running it {_ended(payload)} "
                f"({self.lost[task.key]} time(s))" + (f"; its last line: {last}" if last else "")
            )
            yield Event("done", task, error=err)


def _ended(code: int) -> str:
    """How a worker process ended: ``exited with code 3`` / ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


#: The environment variable that stops JAX from taking most of each GPU's memory when it
#: starts; a driver that hands its GPUs to worker processes must set it before JAX starts.
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def shareable_gpus() -> list[str] | None:
    """The GPUs this process can hand to worker processes (``CUDA_VISIBLE_DEVICES`` ids, in
    JAX's device order), or None: not a GPU backend, several processes (``jax.distributed``:
    every process runs every point together), or a process that took most of each GPU's
    memory when JAX started (:data:`PREALLOCATE` not ``false``, nor the ``platform``
    allocator), which leaves the worker processes too little."""
    import jax

    if jax.process_count() > 1 or jax.default_backend() != "gpu":
        return None
    leaves = os.environ.get(PREALLOCATE, "").lower() in ("false", "0")
    if not leaves and os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "") != "platform":
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    ordinals = [int(d.local_hardware_id) for d in jax.local_devices()]
    return [visible[o] if o < len(visible) else str(o) for o in ordinals]


def local_engine(
    workers: int = 1,
    *,
    retries: int = 1,
    env: Mapping[str, str | None] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> SerialEngine | LocalEngine:
    """The engine for this machine: a :class:`LocalEngine` handing every GPU this process can
    share (:func:`shareable_gpus`) to points side by side and ``workers`` processes to
    analysis-only tasks; a :class:`SerialEngine` (this process) when neither is more than one.

    Raises:
      ValueError: ``workers`` or ``retries`` not a positive / non-negative integer.
    """
    V.positive_int("workers", workers)
    gpus = shareable_gpus()
    if workers == 1 and not gpus:
        return SerialEngine()
    return LocalEngine(workers, gpus=gpus, retries=retries, env=env, log_dir=log_dir)
