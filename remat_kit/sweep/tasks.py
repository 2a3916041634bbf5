"""The sweep's unit of work: a :class:`Task` (points run together in one process), how the points
of a sweep become tasks (:func:`make_tasks`), what every task of a run shares
(:class:`TaskSetup`), and the progress a driver keeps over tasks run anywhere (:class:`Tally`).

A task is keyed by its points' keys (:func:`remat_kit.sweep.results.point_key`, the key
``--resume`` matches rows on), so the same points make the same task in every process and
every run; its rows may come back in any order and are appended as they come.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit.sweep import results as R
from remat_kit.sweep.config import Point
from remat_kit.sweep.rows import make_row


@dataclasses.dataclass(frozen=True)
class Task:
    """Points run together in one process: the points of one group (one model, shape, target
    and mesh, differing only in the policy: analysed together, their measured steps timed
    together), or a contiguous share of them.

    Attributes:
      points: the points, in run order (at least one).
      on_device: the task runs where the local device is (:func:`on_device`).
    """

    points: tuple[Point, ...]
    on_device: bool = False

    @property
    def key(self) -> str:
        """:func:`~remat_kit.sweep.results.point_key` of the points' keys: stable across runs
        and processes."""
        return R.point_key({"points": [p.key for p in self.points]})

    @property
    def measure(self) -> bool:
        """Whether a step is run (and timed) on the local device(s)."""
        return any(p.measure for p in self.points)

    @property
    def devices(self) -> int:
        """Devices the task's points run on: its mesh's (a meshed point's), else 1."""
        mesh = self.points[0].mesh
        return T.parse_mesh(mesh).num_devices if mesh else 1

    @property
    def label(self) -> str:
        """The group's label and how many policies (``tiny-gpt b=2 s=64 @local, 3 policies``)."""
        head = self.points[0].label.rsplit(" ", 2)[0]
        n = len(self.points)
        return f"{head} @{self.points[0].target}, {n} polic{'y' if n == 1 else 'ies'}"


def on_device(point: Point, backend: str) -> bool:
    """Whether ``point`` runs where the local device is: measured, or analysed for the local
    device when that is not the CPU (``backend``: the local one; a CPU worker process compiles
    for the CPU, a deviceless target anywhere)."""
    return point.measure or (backend != "cpu" and not T.get_target(point.target).deviceless)


def make_tasks(
    points: Sequence[Point],
    analysis_slots: int = 1,
    device_slots: int = 1,
    backend: str | None = None,
) -> list[Task]:
    """The tasks of ``points``, in run order: one per group (:attr:`Point.group`), on the
    device or not (:func:`on_device`; ``backend``: the local one, default
    ``jax.default_backend()``).

    Where more processes run tasks side by side than there are groups of a kind (analysis-only,
    run by ``analysis_slots`` processes; on the device, by ``device_slots``), each group of that
    kind
    is cut into ``ceil(slots / groups)`` contiguous shares of near-equal size, so every process
    has work. A share without ``no-remat`` compiles the no-remat step once more (the baseline
    :func:`remat_kit.memory.analyze_policies` judges memory against); the figures of a point
    do not depend on its share. One slot of each kind: whole groups, as one process runs them.

    Raises:
      ValueError: a slot count below 1.
    """
    if analysis_slots < 1 or device_slots < 1:
        raise ValueError(f"slots must be >= 1, got {analysis_slots} and {device_slots}")
    backend = backend or jax.default_backend()
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        groups.setdefault(p.group, []).append(p)
    kinds = {g: on_device(members[0], backend) for g, members in groups.items()}
    counts = {k: sum(1 for v in kinds.values() if v == k) for k in (False, True)}
    slots = {True: device_slots, False: analysis_slots}
    tasks = []
    for g, members in groups.items():
        kind = kinds[g]
        pieces = min(len(members), math.ceil(slots[kind] / counts[kind]))
        for i in range(pieces):
            share = members[i * len(members) // pieces : (i + 1) * len(members) // pieces]
            tasks.append(Task(tuple(share), kind))
    return tasks


@dataclasses.dataclass(frozen=True)
class TaskSetup:
    """What every task of one run shares (sent to each process that runs tasks; picklable).

    Attributes:
      common: fields every row of the run has (the sweep's name, fingerprint and config, the
        corpus's description when the config measures); each process adds its own
        :func:`~remat_kit.sweep.results.environment`.
      measurer: what runs and times the measured points
        (:class:`~remat_kit.sweep.run.Measurer`; None when no point measures).
      before_point: called with each point before its task is analysed; an exception it raises
        becomes that point's ``error`` row (used to test fault handling).
    """

    common: Mapping[str, Any]
    measurer: Any = None
    before_point: Callable[[Point], None] | None = None


def error_rows(task: Task, common: Mapping[str, Any], err: BaseException) -> list[dict]:
    """A row with status ``error`` (or ``oom``) and ``err``'s one-line message for every point
    of ``task``, for a task whose process failed outside a point (a worker lost, a task the
    scheduler gave up on); every field of a row, None where not reached."""
    fields = {**common, **R.environment()}
    return [make_row(p.key, {**fields, **p.to_dict()}, err, measure=p.measure) for p in task.points]


#: Seconds without a progress line after which :class:`Tally` says what is running.
HEARTBEAT_S = 10.0


class Tally:
    """Points done, running and left, as a driver sees tasks start and finish in any order;
    it says so through ``advance`` (:func:`remat_kit.sweep.output.progress`): one call per
    finished point, and a line of what is running when ``heartbeat_s`` pass without one.

    Use as a context manager (the heartbeat runs in a thread while it is open).
    """

    def __init__(self, total: int, advance: Callable, heartbeat_s: float = HEARTBEAT_S):
        self.total, self.heartbeat_s = total, heartbeat_s
        self.done = 0
        self.running: dict[str, Task] = {}
        self._said: dict[str, int] = {}  # rows said so far of each running task
        self._advance = advance
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counts(self) -> str:
        """``"3 done, 2 running, 19 left"`` (points)."""
        running = sum(len(t.points) - self._said.get(k, 0) for k, t in self.running.items())
        left = self.total - self.done - running
        return f"{self.done} done, {running} running, {left} left"

    def advance(self, n: int | None, description: str) -> None:
        """Pass a stage line on (as ``advance``); it counts as a line for the heartbeat."""
        with self._lock:
            self._last = time.monotonic()
            self._advance(n, description)

    def start(self, task: Task) -> None:
        with self._lock:
            self.running[task.key] = task

    def finish(self, task: Task, rows: Sequence[Mapping[str, Any]]) -> None:
        """``task``'s rows are written: one progress call per row, the counts first (a line cut
        to the terminal's width loses the end of the label, not the counts); the task's points
        not yet said count as running until they are."""
        labels = {p.key: p.label for p in task.points}
        for row in rows:
            with self._lock:
                self.done += 1
                self._said[task.key] = self._said.get(task.key, 0) + 1
                self._last = time.monotonic()
                status = "" if row.get("status") == "ok" else f" ({row.get('status')})"
                label = labels.get(row.get("key"), str(row.get("key")))
                self._advance(1, f"[{self.counts()}] {label}{status}")
        with self._lock:
            self.running.pop(task.key, None)
            self._said.pop(task.key, None)

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            with self._lock:
                if time.monotonic() - self._last < self.heartbeat_s or not self.running:
                    continue
                self._last = time.monotonic()
                names = [t.label for t in self.running.values()]
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                self._advance(None, f"[{self.counts()}] running {'; '.join(names[:3])}{more}")

    def __enter__(self) -> Tally:
        self._thread = threading.Thread(target=self._beat, name="sweep-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
