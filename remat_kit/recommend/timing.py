"""The time model of recommend: estimated step time from compiled FLOPs and host transfers.

See :mod:`remat_kit.recommend` for the formula; :func:`host_link_source` for the link figures.

FLOPs basis across ``attention`` choices: the compiled FLOPs (:mod:`remat_kit.memory.hlo`) count
the matmul work each program executes. XLA attention (einsum) computes the full [seq, seq]
scores, masked or not: ``4 * b * heads * s^2 * head_dim`` forward, twice that backward. cuDNN's
fused attention call is counted by the same matmul formula, halved under a causal mask (the flash
kernel skips the masked tiles) and times 2.5 backward (it recomputes the scores; FlashAttention-2,
arXiv:2307.08691); the traced baseline (:mod:`remat_kit.memory.flops`) uses the same rules. Both
are then timed at the same dense bf16 peak, so xla and cudnn candidates are compared on executed
matmul work; what the model leaves out (the softmax and HBM traffic of the materialised scores,
which cuDNN avoids) would only widen cuDNN's lead.
"""

from __future__ import annotations

from remat_kit import targets as T
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


def step_time(
    target: T.Target, flops: float, flops_no_remat: float, host_bytes: int
) -> tuple[float, float]:
    """``(compute_s, transfer_s)`` of a step (the model: :mod:`remat_kit.recommend`).

    Args:
      target: gives ``peak_flops_bf16`` (FLOP/s) and ``host_link_bytes_per_s`` (bytes/s).
      flops: compiled matmul FLOPs; flops_no_remat: FLOPs of the step without remat.
      host_bytes: bytes offloaded to host memory (each crosses the link once each way).

    Raises:
      ValueError: the target's peak FLOP/s is unknown.
    """
    if not target.peak_flops_bf16:
        raise ValueError(f"target {target.name!r} has no peak FLOP/s; pick a GPU target")
    peak = target.peak_flops_bf16
    compute = flops / peak
    if host_bytes <= 0 or not target.host_link_bytes_per_s:
        return compute, 0.0
    fwd = min(compute, flops_no_remat / 3 / peak)
    link = host_bytes / target.host_link_bytes_per_s
    return compute, max(0.0, link - fwd) + max(0.0, link - (compute - fwd))


def rank(c: Candidate) -> tuple:
    """Least estimated time; on a tie (offload transfers fully hidden), no host traffic over
    some (the overlap is the least certain part of the model), then least device memory."""
    return (c.step_time_s, c.host_bytes, c.peak_bytes)


def time_model_note(target: T.Target) -> str:
    """The note every :class:`Recommendation` carries about the time model's limits."""
    return (
        f"step time = compiled matmul FLOPs / {target.peak_flops_bf16 / 1e12:.1f} TFLOP/s (bf16 "
        "dense peak) + host transfers that cannot hide behind the forward (device->host) or "
        "backward (host->device) pass: a lower bound for ranking, not a measured time"
    )
