"""Several processes, one program: starting JAX's distributed runtime for the scripts.

A run over several hosts (or several processes on one host) starts one process per host, each
running the same script; :func:`initialize` calls ``jax.distributed.initialize`` in each, after
which ``jax.devices()`` lists every process's devices and one ``Mesh`` spans them all
(:func:`remat_kit.targets.local_mesh`). Each process then runs the same jitted steps (SPMD);
only process 0 writes results (:func:`is_primary`).

Where the process layout comes from, first match wins:

1. the arguments (the scripts' ``--coordinator``, ``--num-processes``, ``--process-id``);
2. the environment variables ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0),
   ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (launch by hand, one shell per host);
3. a cluster JAX detects by itself (SLURM under ``srun`` with more than one task, Open MPI's
   ``mpirun``): ``jax.distributed.initialize()`` with no arguments.

Nothing set: one process, nothing initialised. On the CPU the processes exchange collectives
over gloo (``jax_cpu_collectives_implementation``); GPUs use NCCL.

Reference: JAX, "Multi-host and multi-process environments"
(https://docs.jax.dev/en/latest/multi_process.html).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax

__all__ = ["ENV_VARS", "add_arguments", "initialize", "initialize_from_args", "is_primary"]

#: The environment variables read when the arguments are not given.
ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _cluster_detected() -> bool:
    """A multi-task SLURM step or an Open MPI launch, which ``jax.distributed`` reads itself."""
    slurm_tasks = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS")
    if "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" in os.environ and slurm_tasks:
        return slurm_tasks.isdigit() and int(slurm_tasks) > 1
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    verbose: bool = False,
) -> bool:
    """Start ``jax.distributed`` when this process is one of several; call before any JAX use.

    Args:
      coordinator_address: ``host:port`` of process 0 (reachable by every process).
      num_processes: how many processes take part (1: nothing to start).
      process_id: this process's index, ``0 .. num_processes - 1``.
      verbose: print one line to stderr before connecting (connecting waits for every process,
        up to JAX's initialization timeout of 300 s).

    Returns:
      True when the distributed runtime was started, False for a single-process run.

    Raises:
      ValueError: ``num_processes`` below 1; ``process_id`` outside ``0 .. num_processes - 1``
        or missing; a missing coordinator address or one not of the form ``host:port`` (each
        names the value and where it came from); an environment variable that is not an
        integer.
    """
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    n = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if n is None and pid is None and address is None:
        if not _cluster_detected():
            return False
        if verbose:
            print("joining the cluster's processes (jax.distributed, SLURM / MPI)", file=sys.stderr)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
        return True
    if n is None or n < 1:
        raise ValueError(
            f"num_processes (--num-processes or JAX_NUM_PROCESSES) must be an integer >= 1, "
            f"got {n!r}"
        )
    if n == 1 and pid in (None, 0):
        return False
    if pid is None or not 0 <= pid < n:
        raise ValueError(
            f"process_id (--process-id or JAX_PROCESS_ID) must be one of 0..{n - 1} for "
            f"num_processes={n}, got {'nothing' if pid is None else pid}"
        )
    if not address:
        raise ValueError(
            f"num_processes={n} needs the coordinator's host:port (--coordinator or "
            "JAX_COORDINATOR_ADDRESS), e.g. 10.0.0.1:1234, the same for every process"
        )
    if not re.fullmatch(r"\[?[^\s\[\]]*[^\s:\[\]]\]?:\d{1,5}", address):
        raise ValueError(
            f"coordinator address (--coordinator or JAX_COORDINATOR_ADDRESS) must be "
            f"host:port, e.g. 10.0.0.1:1234, got {address!r}"
        )
    if verbose:
        print(
            f"process {pid} of {n}: connecting to the coordinator at {address} (waits for "
            "every process, up to 300 s)",
            file=sys.stderr,
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=pid)
    return True


def is_primary() -> bool:
    """True in process 0 (the one that writes results and prints), and in a 1-process run."""
    return jax.process_index() == 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--mesh``, ``--coordinator``, ``--num-processes`` and ``--process-id`` to a script's
    parser (read back by :func:`initialize_from_args`)."""
    g = parser.add_argument_group("devices and processes")
    g.add_argument(
        "--mesh",
        default=None,
        help="mesh over all devices, e.g. fsdp=4 or dp=2,fsdp=2,tp=2 (product = device count; "
        "default: dp over every device; in a sweep it also sets the GPUs a deviceless target "
        "is analysed on). More CPU devices: JAX_NUM_CPU_DEVICES=N",
    )
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address, for a multi-process run "
                   "(default: $JAX_COORDINATOR_ADDRESS)")  # fmt: skip
    g.add_argument("--num-processes", type=int, default=None,
                   help="processes in the run (default: $JAX_NUM_PROCESSES or SLURM)")  # fmt: skip
    g.add_argument("--process-id", type=int, default=None,
                   help="this process, 0..N-1 (default: $JAX_PROCESS_ID or SLURM)")  # fmt: skip


def initialize_from_args(args: argparse.Namespace) -> bool:
    """:func:`initialize` with the options :func:`add_arguments` added.

    Raises:
      ValueError: see :func:`initialize`.
    """
    return initialize(args.coordinator, args.num_processes, args.process_id, verbose=True)
