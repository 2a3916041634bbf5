"""The policy's own figures, told apart from XLA's own rematerialisation.

When a program exceeds the target's memory, XLA's GPU compiler recomputes instructions on its
own (``hlo_rematerialization.cc``: "Can't reduce memory use below ..."), cloning them as
``name.remat``, and removes an original once a clone took all its uses: compiled FLOPs and peaks
then mix what the policy asks for with what XLA added (docs/analyze.md). The policy's own FLOPs
are the as-run ones less every clone but one per original
(:class:`~remat_kit.memory.hlo.FlopCount`); its own peak needs the step compiled again with the
pass off (:func:`~remat_kit.memory.xla_compile.add_policy_only`). This module turns them into
:class:`~remat_kit.memory.report.PolicyOnly` and the one line that says what XLA did.
"""

from __future__ import annotations

from remat_kit.memory.reading import DumpReading, Hints, compiled_peak_bytes, read_dump
from remat_kit.memory.report import PolicyOnly
from remat_kit.memory.xla_compile import CompileResult
from remat_kit.units import format_bytes


def policy_only_figures(
    result: CompileResult,
    reading: DumpReading,
    flops_no_remat: float | None,
    platform: str = "cuda",
) -> PolicyOnly | None:
    """:class:`PolicyOnly` where XLA's pass cloned instructions in ``result``, else None.

    Args:
      result: the as-run compile (its ``policy_only``, when made, is the pass-off compile:
        the peak of the policy alone is read from it).
      reading: that compile's dumps read (:func:`~remat_kit.memory.reading.read_dump`): its
        FLOPs and the part XLA's clones add.
      flops_no_remat: the no-remat baseline of the recompute ratio (matmul FLOPs).
      platform: the target's platform (the peak is read as
        :func:`remat_kit.memory.reading.compiled_peak_bytes` reads it there).
    """
    if not result.xla_remat_instructions:
        return None
    flops = None
    if reading.flops is not None and reading.xla_remat_flops is not None:
        flops = reading.flops - reading.xla_remat_flops
    off = result.policy_only
    return PolicyOnly(
        xla_remat_instructions=result.xla_remat_instructions,
        flops=flops,
        recompute_ratio=flops / flops_no_remat if flops and flops_no_remat else None,
        peak_bytes=compiled_peak_bytes(off.compiled, platform) if off else None,
        # the live peak read as the as-run compile's is (aliased slots once, device only)
        live_peak_bytes=read_dump(off.dump, 0, Hints()).live_peak_bytes if off else None,
        compile_s=round(off.compile_s, 3) if off else None,
    )


def xla_remat_line(peak_bytes: int, compiled_ratio: float | None, policy_only: PolicyOnly) -> str:
    """``"XLA's remat pass recomputed on its own, beyond the policy: 56 instructions to reach
    81.17 GiB, the policy alone peaking at 82.15 GiB with x1.25 FLOPs (x1.53 as compiled)"``
    (without the policy's own peak when the pass-off compile was not made); the words before
    ``": "`` are the same for every policy (:func:`remat_kit.terminal.group_notes`)."""
    ratio = policy_only.recompute_ratio
    flops = f"x{ratio:.2f} FLOPs" if ratio else "FLOPs unknown"
    compiled = f" (x{compiled_ratio:.2f} as compiled)" if compiled_ratio else ""
    if policy_only.peak_bytes is not None:
        alone = f" peaking at {format_bytes(policy_only.peak_bytes)} with {flops}"
    else:
        alone = f" {flops}"
    return (
        "XLA's remat pass recomputed on its own, beyond the policy: "
        f"{policy_only.xla_remat_instructions} instructions to reach {format_bytes(peak_bytes)}, "
        f"the policy alone{alone}{compiled}"
    )
