"""The Ray engine: a sweep's tasks as Ray tasks, on a local Ray instance or an existing cluster.

``ray`` is an optional dependency (``pip install 'remat-kit[ray]'``), imported when a
:class:`RayEngine` is made. Each task (:class:`~remat_kit.sweep.tasks.Task`) is one Ray task
asking for what it needs: a task on the local device ``num_gpus`` = its devices (one GPU, or a
meshed point's group) on a cluster with GPUs, else one CPU; an analysis-only task one CPU, with
``JAX_PLATFORMS=cpu``. A GPU task's worker process exits after it (``max_calls=1``): JAX binds a
process to the GPUs Ray gave its first task. At most as many tasks are in flight as the cluster
has CPUs (analysis) and GPUs (device tasks) for, so "running" in the progress means running.

A task whose worker process died (killed, out of memory, a node lost) is run again by Ray up to
``retries`` times (``max_retries``); then each of its points gets an error row with Ray's
message. An exception the task itself raised is not retried (a point's own failure is already
its row). The rows reach the driver, which appends them to the one results file: a driver
killed at any moment resumes from that file (``--resume``), running only the points not in it.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from remat_kit import validation as V
from remat_kit.sweep.engine import Event, RunnerFactory
from remat_kit.sweep.tasks import Task

#: What to install when Ray is missing (the one-line error says it).
INSTALL = "pip install 'remat-kit[ray]'"


#: Variables of this process every task gets: where the compile cache is (a path every node
#: sees lets a compile made on one node serve the others: remat_kit.memory.compile_cache).
FORWARDED = ("REMAT_KIT_CACHE_DIR", "REMAT_KIT_NO_CACHE", "REMAT_KIT_CACHE_MAX_BYTES")


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
      ValueError: Ray is not installed (one line naming :data:`INSTALL`).
    """
    try:
        import ray
    except ImportError:
        raise ValueError(f"--engine ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def _run_task(make_runner: RunnerFactory, task: Task) -> list[dict[str, Any]]:
    """One task in a Ray worker process: a runner made there, the task's rows."""
    return make_runner()(task, None)


class RayEngine:
    """Tasks as Ray tasks (see the module docstring).

    Args:
      address: the cluster (``ray.init(address=...)``); None: ``RAY_ADDRESS`` if set, else a
        local Ray instance started here (its workers import this remat_kit).
      retries: times Ray runs a task again whose worker process died (``max_retries``, >= 0).
      runtime_env: Ray's runtime environment for every task (e.g. ``{"working_dir": ...}``
        where remat-kit is not installed on the cluster's nodes); merged with the engine's
        environment variables.
      init_kwargs: more arguments for ``ray.init`` (``num_cpus=2`` for a small local one).

    Raises:
      ValueError: Ray not installed; ``retries`` negative.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        retries: int = 1,
        runtime_env: Mapping[str, Any] | None = None,
        **init_kwargs: Any,
    ):
        V.nonnegative_int("retries", retries)
        self.ray = import_ray()
        self.retries = retries
        self.runtime_env = dict(runtime_env or {})
        address = address or os.environ.get("RAY_ADDRESS") or None
        if not self.ray.is_initialized():
            env = {}
            if address is None:  # a local instance: its workers import what the driver does
                root = str(Path(__file__).resolve().parents[2])
                path = os.environ.get("PYTHONPATH")
                paths = [root, *_own_paths(), *([path] if path else [])]
                env["PYTHONPATH"] = os.pathsep.join(paths)
            self.ray.init(
                address=address, runtime_env={"env_vars": env} if env else None,
                log_to_driver=False, **init_kwargs,
            )  # fmt: skip
        resources = self.ray.cluster_resources()
        self.cpus = max(1, int(resources.get("CPU", 1)))
        self.gpus = int(resources.get("GPU", 0))
        self.analysis_slots = self.cpus
        self.device_slots = max(1, self.gpus)
        #: A local point runs on one GPU where the cluster has GPUs (a meshed one, a group).
        self.local_devices = 1 if self.gpus else None
        self.backend = "gpu" if self.gpus else "cpu"  # where the device tasks run
        # a local instance's CPU is the driver's: timed once here, read by every task
        self.calibrate_here = address is None and not self.gpus

    def options(self, task: Task) -> dict[str, Any]:
        """What ``task`` asks Ray for: resources, retries, its worker's environment (with this
        process's compile cache settings, :data:`FORWARDED`)."""
        env = {k: os.environ[k] for k in FORWARDED if k in os.environ}
        env.update(self.runtime_env.get("env_vars") or {})
        gpu = task.on_device and self.gpus > 0
        if not task.on_device:  # analysis only: compiled on the CPU, no GPU touched
            env["JAX_PLATFORMS"] = "cpu"
        runtime_env = {**self.runtime_env, **({"env_vars": env} if env else {})}
        return {
            "num_cpus": 1, "num_gpus": task.devices if gpu else 0,
            "max_retries": self.retries, "retry_exceptions": False,
            **({"runtime_env": runtime_env} if runtime_env else {}),
        }  # fmt: skip

    def run(
        self, tasks: Sequence[Task], make_runner: RunnerFactory, advance: Callable
    ) -> Iterator[Event]:
        ray = self.ray
        # a GPU task's worker process exits after it (JAX keeps the GPUs its first task had)
        remote = {False: ray.remote(_run_task), True: ray.remote(max_calls=1)(_run_task)}
        runner = ray.put(make_runner)
        waiting = {k: collections.deque(t for t in tasks if t.on_device == k) for k in (0, 1)}
        limit = {0: self.analysis_slots, 1: self.device_slots}
        flying: dict[Any, Task] = {}
        try:
            while any(waiting.values()) or flying:
                for kind in (1, 0):  # as many in flight as the cluster runs at once
                    while waiting[kind] and (
                        sum(t.on_device == kind for t in flying.values()) < limit[kind]
                    ):
                        task = waiting[kind].popleft()
                        gpu = bool(task.on_device and self.gpus)
                        call = remote[gpu].options(**self.options(task))
                        flying[call.remote(runner, task)] = task
                        yield Event("start", task)
                done, _ = ray.wait(list(flying), num_returns=1, timeout=1.0)
                for ref in done:
                    task = flying.pop(ref)
                    try:
                        rows = ray.get(ref)
                    except Exception as err:  # retries spent: the worker died, a node lost
                        yield Event("done", task, error=_cause(err))
                        continue
                    yield Event("done", task, rows=rows)
        finally:
            for ref in flying:
                ray.cancel(ref, force=True)


def _cause(err: BaseException) -> BaseException:
    """The exception a task raised, out of Ray's wrapper (the row names it); Ray's own
    (a worker or node lost, out of memory) as it is."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _own_paths() -> list[str]:
    """The driver's ``sys.path`` folders outside the interpreter's installation (a script's
    folder, e.g. ``experiments/`` whose measuring harness a task's runner comes from)."""
    prefixes = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        resolved = str(Path(entry).resolve())
        if not any(resolved.startswith(prefix) for prefix in prefixes):
            out.append(resolved)
    return out
