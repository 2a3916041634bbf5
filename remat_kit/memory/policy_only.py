"""The policy's own figures, told apart from XLA's own rematerialisation.

When a program exceeds the target's memory, XLA's GPU compiler recomputes instructions on its
own (``hlo_rematerialization.cc``: "Can't reduce memory use below ..."), cloning them as
``name.remat``: compiled FLOPs and peaks then mix what the policy asks for with what XLA added
(llama3-8b b=1 s=8192 save-nothing on h100-sxm: x1.53 FLOPs compiled against x1.25 for the
policy). :func:`~remat_kit.memory.xla_compile.add_policy_only` compiles such a step a second
time with the pass off (``xla_disable_hlo_passes=rematerialization``), only when the pass
cloned something; this module turns that compile into :class:`~remat_kit.memory.report.
PolicyOnly` and the one line that says what XLA did.
"""

from __future__ import annotations

from remat_kit.memory import hlo
from remat_kit.memory.reading import compiled_peak_bytes
from remat_kit.memory.report import PolicyOnly
from remat_kit.memory.timeline import live_at_peak
from remat_kit.memory.xla_compile import CompileResult
from remat_kit.units import format_bytes


def policy_only_figures(
    result: CompileResult, flops_no_remat: float | None, platform: str = "cuda"
) -> PolicyOnly | None:
    """:class:`PolicyOnly` from a compile whose ``policy_only`` compile ran, else None.

    Args:
      result: the as-run compile (its ``policy_only`` is the pass-off compile).
      flops_no_remat: the no-remat baseline of the recompute ratio (matmul FLOPs).
      platform: the target's platform (the peak is read as
        :func:`remat_kit.memory.reading.compiled_peak_bytes` reads it there).
    """
    off = result.policy_only
    if off is None:
        return None
    flops = None
    if off.dump.hlo is not None:
        flops = hlo.count_flops(off.dump.module).flops
    live = live_at_peak(off.dump)
    slots = off.dump.slots
    live_bytes = None
    if live:
        by_slot: dict[object, int] = {}
        for buf in live:
            slot = slots.get(buf.value)
            if slot is not None and slot.on_host:
                continue
            key = (slot.allocation, slot.offset) if slot else buf.value
            by_slot[key] = max(by_slot.get(key, 0), buf.nbytes)
        live_bytes = sum(by_slot.values())
    return PolicyOnly(
        xla_remat_instructions=result.xla_remat_instructions,
        peak_bytes=compiled_peak_bytes(off.compiled, platform),
        live_peak_bytes=live_bytes,
        flops=flops,
        recompute_ratio=flops / flops_no_remat if flops and flops_no_remat else None,
        compile_s=round(off.compile_s, 3),
    )


def xla_remat_line(peak_bytes: int, compiled_ratio: float | None, policy_only: PolicyOnly) -> str:
    """``"XLA recomputed 56 instructions on its own to reach 81.17 GiB; the policy alone peaks
    at 82.15 GiB, x1.25 FLOPs (x1.53 as compiled)"``."""
    ratio = policy_only.recompute_ratio
    flops = f", x{ratio:.2f} FLOPs" if ratio else ""
    compiled = f" (x{compiled_ratio:.2f} as compiled)" if compiled_ratio else ""
    return (
        f"XLA recomputed {policy_only.xla_remat_instructions} instructions on its own to reach "
        f"{format_bytes(peak_bytes)}; the policy alone peaks at "
        f"{format_bytes(policy_only.peak_bytes)}{flops}{compiled}"
    )
