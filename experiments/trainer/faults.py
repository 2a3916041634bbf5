"""Fault injection: make a training process SIGKILL itself at a named moment, to test resume.

Set ``REMAT_KIT_KILL_AT=POINT@STEP`` in the environment of a process that runs
:func:`trainer.train` (or ``experiments/train.py``); unset, nothing changes. Points:

=============== =================================================================================
``compile``     the call that starts at update ``STEP`` (0: a fresh run) has lowered its train
                step and is about to compile it; nothing of this call is on disk yet
``micro-batch`` inside the compiled step of update ``STEP`` (0-based), after micro-batch 0 and
                before micro-batch 1 (a ``jax.debug.callback`` in the accumulation scan; the run
                compiles that variant of the step)
``before-save`` checkpoint ``STEP`` (updates done) is about to be saved
``mid-save``    inside orbax's save of checkpoint ``STEP``: every item is written to
                ``STEP.orbax-checkpoint-tmp``, the atomic rename has not happened
``after-save``  checkpoint ``STEP`` is complete (renamed; older ones beyond ``keep`` deleted)
=============== =================================================================================

The kill is ``os.kill(os.getpid(), SIGKILL)``: no Python cleanup, no atexit, no flush of orbax's
threads, as a preemption or the OOM killer would do it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orbax.checkpoint.path import atomicity

from remat_kit.validation import unknown_value_error

ENV_VAR = "REMAT_KIT_KILL_AT"
POINTS = ("compile", "micro-batch", "before-save", "mid-save", "after-save")


@dataclasses.dataclass(frozen=True)
class KillAt:
    """Kill the process at ``point`` (one of :data:`POINTS`) of update or checkpoint ``step``."""

    point: str
    step: int

    @classmethod
    def from_env(cls) -> KillAt | None:
        """The kill point ``REMAT_KIT_KILL_AT`` names, or None when it is unset or empty.

        Raises:
          ValueError: not ``POINT@STEP`` with a known point and an integer step >= 0.
        """
        text = os.environ.get(ENV_VAR, "")
        if not text:
            return None
        point, sep, step = text.partition("@")
        if point not in POINTS:
            raise unknown_value_error(f"{ENV_VAR} point", point, POINTS)
        if not sep or not step.isdigit():
            raise ValueError(f"{ENV_VAR} must be POINT@STEP with a step >= 0, got {text!r}")
        return cls(point, int(step))

    def check(self, point: str, step: int) -> None:
        """Kill the process now if this is the named point and step."""
        if (point, step) == (self.point, self.step):
            kill_self()

    def on_micro_batch(self) -> _MicroBatchKill | None:
        """The ``on_micro_batch`` host callback for the train step, for the ``micro-batch``
        point (None for the others: the step compiles without a callback)."""
        return _MicroBatchKill(self.step) if self.point == "micro-batch" else None

    def temporary_path_class(self) -> type[atomicity.AtomicRenameTemporaryPath] | None:
        """orbax's ``CheckpointManagerOptions.temporary_path_class`` for the ``mid-save`` point:
        orbax's atomic rename, killing the process just before it renames ``STEP``'s folder."""
        return _killing_rename(str(self.step)) if self.point == "mid-save" else None


def kill_self() -> None:
    """SIGKILL this process (output flushed first, so a parent sees what was printed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class _MicroBatchKill:
    step: int

    def __call__(self, step: Any, micro_batch: Any) -> None:
        if int(step) == self.step and int(micro_batch) == 1:
            kill_self()


@functools.lru_cache(maxsize=4)
def _killing_rename(step_name: str) -> type[atomicity.AtomicRenameTemporaryPath]:
    from orbax.checkpoint.path import atomicity  # imported only when a test asks for the kill

    class KillingRename(atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args: Any, **kwargs: Any) -> Any:
            if self.get_final().name == step_name:  # the step folder, not one of its items
                kill_self()
            return await super().finalize(*args, **kwargs)

    return KillingRename
