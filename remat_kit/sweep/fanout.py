"""How a run of tasks fans out, as a command line asks for it: the engine (this machine's
worker processes, or Ray), a shard of the points, or the merge of the shards' part files.

One home for what ``experiments/sweep.py`` and ``remat-kit analyze``'s grid both take
(``--engine``, ``--address``, a worker count, ``--shard``, ``--merge``): :class:`FanOut`
checks the combination (:meth:`FanOut.check`) and makes the engine (:meth:`FanOut.engine`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from remat_kit.sweep.engine import local_engine
from remat_kit.sweep.shard import Shard

#: The engines a command line names (``--engine``).
ENGINES = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class FanOut:
    """What a command line asked of the run's fan-out.

    Attributes:
      engine: ``local`` (:func:`~remat_kit.sweep.engine.local_engine`: worker processes and
        every GPU this process can share) or ``ray``
        (:class:`~remat_kit.sweep.ray_engine.RayEngine`).
      address: the Ray cluster (``--address``; None: ``RAY_ADDRESS``, else a local instance).
      workers: processes running analysis-only tasks side by side (the local engine).
      shard: run only this part of the points (``--shard I/N``), or None.
      merge: the part files to join (``--merge PART ...``; an empty list: every part beside
        the results file), or None: no merge.
      resume: ``--resume`` given; overwrite: ``--overwrite`` given (a merge takes neither).
      workers_flag: the command's name for ``workers``, for error messages.
    """

    engine: Literal["local", "ray"] = "local"
    address: str | None = None
    workers: int = 1
    shard: Shard | None = None
    merge: Sequence[str] | None = None
    resume: bool = False
    overwrite: bool = False
    workers_flag: str = "--workers"

    def check(self) -> None:
        """Refuse what the flags cannot go with.

        Raises:
          ValueError: one line: an unknown engine; ``--address`` without Ray; a worker count
            with Ray; ``--shard`` with ``--merge``; ``--merge`` with ``--resume`` /
            ``--overwrite`` / a worker count / ``--engine``.
        """
        if self.engine not in ENGINES:
            raise ValueError(f"--engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.address is not None and self.engine != "ray":
            raise ValueError("--address: only with --engine ray (the Ray cluster to run on)")
        if self.engine == "ray" and self.workers != 1:
            raise ValueError(
                f"{self.workers_flag}: not with --engine ray (Ray runs as many points as the "
                "cluster has CPUs and GPUs for)"
            )
        if self.shard is not None and self.merge is not None:
            raise ValueError("--shard and --merge: one or the other (run the parts, then merge)")
        given = [f"--{o}" for o in ("resume", "overwrite") if getattr(self, o)]
        given += [self.workers_flag] if self.workers != 1 else []
        given += ["--engine"] if self.engine != "local" else []
        if self.merge is not None and given:
            raise ValueError(
                f"--merge: not with {' / '.join(given)} (it joins finished parts, running no "
                "point; a part resumes with --shard I/N --resume)"
            )

    def make_engine(self, worker_env: Mapping[str, str | None] | None = None) -> Any:
        """The engine :attr:`engine` names: this machine's
        (:func:`~remat_kit.sweep.engine.local_engine` with :attr:`workers`) or Ray's (its GPU
        tasks get ``worker_env``'s unset variables back as JAX's default, ``true``, as local
        workers get the user's own setting back).

        Args:
          worker_env: environment overrides for the worker processes (a value None: unset).

        Raises:
          ValueError: Ray not installed (one line naming the install command).
        """
        worker_env = dict(worker_env or {})
        if self.engine == "ray":
            from remat_kit.sweep.ray_engine import RayEngine

            env = {k: "true" if v is None else v for k, v in worker_env.items()}
            return RayEngine(self.address, runtime_env={"env_vars": env} if env else None)
        return local_engine(self.workers, env=worker_env)
