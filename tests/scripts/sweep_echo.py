"""Tasks and a task runner that run nothing, for tests of the sweep's engines: the standard
library alone, so a worker process running them starts at once (it imports no JAX)."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class EchoPoint:
    key: str
    seed: int
    label: str = "echo"


@dataclasses.dataclass(frozen=True)
class EchoTask:
    """What an engine reads of a task: its key, points, kind and devices."""

    seed: int
    on_device: bool = False
    devices: int = 1

    @property
    def key(self) -> str:
        return f"task-{self.seed}"

    @property
    def points(self) -> tuple[EchoPoint, ...]:
        return (EchoPoint(f"point-{self.seed}", self.seed),)

    @property
    def label(self) -> str:
        return self.key


class EchoRunner:
    """One row per point saying where it ran. A task whose seed is in ``always`` kills its
    process (SIGKILL) every time; in ``once``, on its first try (a file under ``marker``
    remembers it)."""

    def __init__(self, once: tuple[int, ...] = (), always: tuple[int, ...] = (), marker=None):
        self.once, self.always, self.marker = once, always, marker

    def __call__(self, task: EchoTask, advance=None) -> list[dict]:
        tried = Path(f"{self.marker}-{task.seed}")
        if task.seed in self.always or (task.seed in self.once and not tried.exists()):
            if task.seed in self.once:
                tried.touch()
            print(f"dying on seed {task.seed}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")}
        return [{"key": p.key, "status": "ok", "pid": os.getpid(), **env} for p in task.points]
