"""The time model of recommend: each candidate's estimated step time is its compiled report's.

A compiled candidate is timed by the roofline over its compiled kernels
(:mod:`remat_kit.memory.roofline`: matmul FLOPs at the target's peak for their dtype, bytes at
its memory bandwidth, elementwise work, launches, host transfers hidden as the schedule allows;
device figures from the datasheet, or calibrated on the local device by
:mod:`remat_kit.memory.calibrate`). That estimate is ``MemoryReport.step_time_s``; recommend
ranks by it.

Before compiling, ``solve`` predicts the per-tag choices it has not compiled with an additive
model (:func:`flops_step_time`) anchored at the compiled ``save-nothing``: its roofline time plus
the difference in matmul FLOPs time and exposed host transfers. Every compiled choice measures
that model's error, which decides what else is compiled (:mod:`remat_kit.recommend.solver`).

FLOPs basis across ``attention`` choices: the compiled FLOPs (:mod:`remat_kit.memory.hlo`) count
the matmul work each program executes. XLA attention (einsum) computes the full [seq, seq]
scores, masked or not; cuDNN's fused attention call is counted by the same matmul formula,
halved under a causal mask and times 2.5 backward (FlashAttention-2, arXiv:2307.08691). The
roofline also prices the softmax and the HBM traffic of XLA's materialised scores, which the
fused kernel avoids.
"""

from __future__ import annotations

from remat_kit import targets as T
from remat_kit.memory import calibrate
from remat_kit.memory.roofline import DeviceFigures, StepTime
from remat_kit.recommend.types import Candidate


def host_link_source(target: T.Target) -> str:
    """Where a target's host<->device bandwidth (``Target.host_link_bytes_per_s``) comes from.

    PCIe Gen5 x16 (H100 SXM, H200): 32 GT/s x 16 lanes, 128b/130b encoding = 63 GB/s per
    direction, written 64 GB/s (NVIDIA datasheets give 128 GB/s for both directions together).
    PCIe Gen4 x16 (A100, L4): half that, 32 GB/s per direction (datasheets: 64 GB/s). These
    are line rates: real copies get less, so the time model's transfers are optimistic.
    """
    bw = target.host_link_bytes_per_s
    if bw is None:
        return f"target {target.name!r}: host link unknown"
    gen = {64e9: "PCIe Gen5 x16", 32e9: "PCIe Gen4 x16"}.get(bw)
    what = f"{gen}, " if gen else ""
    return (
        f"{bw / 1e9:.0f} GB/s per direction ({what}PCI-SIG line rate x16 lanes, 128b/130b; "
        f"{target.description} datasheet: see Target.source)"
    )


def figures_for(target: T.Target) -> DeviceFigures:
    """The device figures recommend times ``target`` with (datasheet or calibration).

    Raises:
      ValueError: the target has no figures (no peak FLOP/s or bandwidth, and it is not the
        local device, which would be calibrated).
    """
    figures = calibrate.device_figures(target)
    if figures is None:
        timed = [T.LOCAL] + [
            n for n in T.target_names() if calibrate.datasheet_figures(T.get_target(n))
        ]
        raise ValueError(
            f"target {target.name!r} has no peak FLOP/s or memory bandwidth to time steps "
            f"with (and is not the local device, which is calibrated); pick one of "
            f"{', '.join(timed)}"
        )
    return figures


def flops_step_time(
    figures: DeviceFigures,
    flops: float,
    flops_no_remat: float,
    host_bytes: int,
) -> tuple[float, float]:
    """``(compute_s, transfer_s)`` of the additive model ``solve`` predicts choices with.

    ``compute_s = flops / peak`` (bf16 matmul peak); offloaded bytes cross the host link once
    each way, device -> host during the forward pass (a third of the no-remat FLOPs) and back
    during the backward pass; only what cannot hide behind that pass counts.

    Args:
      figures: the device's figures (:func:`figures_for`).
      flops: matmul FLOPs of the choice; flops_no_remat: of the step without remat.
      host_bytes: bytes offloaded to host memory.
    """
    peak = figures.matmul_peak("bf16")
    compute = flops / peak
    link_bw = figures.host_link_bytes_per_s
    if host_bytes <= 0 or not link_bw:
        return compute, 0.0
    fwd = min(compute, flops_no_remat / 3 / peak)
    link = host_bytes / link_bw
    return compute, max(0.0, link - fwd) + max(0.0, link - (compute - fwd))


def candidate_times(step: StepTime | None) -> tuple[float, float, float]:
    """``(compute_s, transfer_s, step_time_s)`` of a compiled candidate from its report's
    roofline (:class:`~remat_kit.memory.roofline.StepTime`): compute is everything but the
    exposed host transfers. ``inf`` where the report has no estimate (ranked last)."""
    if step is None:
        return float("inf"), 0.0, float("inf")
    return step.step_time_s - step.transfer_s, step.transfer_s, step.step_time_s


def rank(c: Candidate) -> tuple:
    """Least estimated time; on a tie, no host traffic over some (the overlap is the least
    certain part of the model), then least device memory."""
    return (c.step_time_s, c.host_bytes, c.peak_bytes)


def time_model_note(target: T.Target) -> str:
    """The note every :class:`Recommendation` carries about the time model and its limits."""
    figures = calibrate.device_figures(target)
    where = (
        "device figures calibrated on this machine"
        if figures is not None and figures.measured
        else "datasheet device figures"
    )
    return (
        f"step time = roofline over the compiled kernels on {target.name} ({where}): each "
        "kernel's matmul, memory and elementwise time, whichever is largest, plus launches and "
        "the host transfers and collectives the schedule cannot hide; it leaves out kernels "
        "running concurrently, caches beyond one level and latency-bound kernels: an estimate "
        "to rank by, not a measurement"
    )
