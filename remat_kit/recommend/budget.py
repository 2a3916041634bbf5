"""The per-device memory budget of recommend: parsed from the user, or the target's memory less
a margin."""

from __future__ import annotations

import math

from remat_kit import targets as T
from remat_kit.units import format_bytes, parse_bytes

#: Fraction of device memory kept free by default: XLA's peak leaves out the CUDA context,
#: cuBLAS/cuDNN workspaces and allocator fragmentation (about 1-3 GiB on an 80 GB GPU). It
#: matches XLA:GPU's own target (``xla_gpu_memory_limit_slop_factor`` = 95%). Run with
#: ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``: JAX preallocates 75% of the GPU by default.
DEFAULT_MARGIN = 0.05


def format_gib(n: float | None) -> str:
    """Bytes in the unit that fits them (``"75.15 GiB"``, ``"1.00 KiB"``; ``"-"`` for unknown):
    :func:`remat_kit.units.format_bytes`. The name is kept for imports."""
    return format_bytes(n)


def parse_budget(budget: int | float | str) -> int:
    """Bytes from an int, a float (``8e10``) or a string (``"76GiB"``, ``"80GB"``, ``"8e10"``;
    the units of :func:`remat_kit.units.parse_bytes`: kB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB
    powers of 1024).

    Raises:
      ValueError: not a positive size (the message lists the units).
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be a size in bytes, got {budget!r}")
    if isinstance(budget, (int, float)):
        if not 0 < budget < math.inf:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        return int(budget)
    try:
        return parse_bytes(str(budget))
    except ValueError as err:
        raise ValueError(f"budget: {err}") from None


def resolve_budget(
    target: T.Target, budget: int | float | str | None, margin: float
) -> tuple[int, str]:
    """``(budget bytes per device, where it comes from)``: ``budget`` parsed, or the target's
    memory less ``margin``.

    Raises:
      ValueError: ``budget`` not a size (see :func:`parse_budget`); no ``budget`` and the
        target's memory is unknown.
    """
    if budget is None:
        if target.memory_bytes is None:
            raise ValueError(f"target {target.name!r} has unknown memory: give a budget")
        note = (
            f"{target.name} memory {format_gib(target.memory_bytes)} less {margin:.0%} for the "
            "CUDA context, workspaces and fragmentation; run with "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={1 - margin:.2f}"
        )
        if target.platform == "tpu":  # the TPU compiler's usable HBM: no CUDA context there
            note = (
                f"{target.name} HBM per chip {format_gib(target.memory_bytes)} (what the TPU "
                f"compiler lets a program use) less the {margin:.0%} margin"
            )
        return int(target.memory_bytes * (1 - margin)), note
    nbytes = parse_budget(budget)
    note = "given"
    if target.memory_bytes is not None and nbytes > target.memory_bytes:
        note += f", above the {format_gib(target.memory_bytes)} of device memory of {target.name}"
    return nbytes, note
