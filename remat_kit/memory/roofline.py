"""The step-time model: a roofline over every kernel of the compiled program.

Each kernel of the optimized HLO (:mod:`remat_kit.memory.kernels`; loop bodies times their trip
count) is timed as a roofline (Williams, Waterman, Patterson, CACM 52(4), 2009) plus a launch
cost, in seconds:

    t = max((flops - batched) / peak_flops[dtype] + batched / batched_flops[dtype],
            bytes / bandwidth,
            elementwise / elementwise_rate + transcendental / transcendental_rate) + launch_s

``bandwidth`` is the cache's for re-reads within ``cache_bytes`` (:class:`_ReuseModel`), else device
memory's; transfers and collectives (ring) run at their links, asynchronous ones charged beyond
what overlaps them. The step time is the sum. Figures: :mod:`remat_kit.memory.calibration`;
rules and measured error: docs/time-model.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from remat_kit import targets as T
from remat_kit.memory import hlo
from remat_kit.memory.calibration import (
    FRESH_ALLOCATION_MIN_BYTES,
    Calibration,
    DeviceFigures,
    device_figures,
)
from remat_kit.memory.kernels import Kernel, executed_kernels
from remat_kit.units import format_seconds


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel's seconds per step (all executions) and its bound (``compute``, ``memory``,
    ``cache``, ``elementwise``, ``launch``, ``host_link``, ``interconnect``)."""

    name: str
    kind: str
    count: int
    time_s: float
    bound: str
    op_name: str


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The estimated time of one step and where it goes. Seconds.

    ``step_time_s = compute_s + memory_s + elementwise_s + launch_s + transfer_s +
    collective_s + allocation_s``, each kernel's time under the term that bound it;
    ``transfer_s`` and ``collective_s`` are what the schedule could not hide.

    Attributes:
      kernels: executed kernels per step.
      allocation_s: faulting in fresh buffers (XLA:CPU); 0 else.
      recompute_s: of the kernels that recompute the forward pass (included above).
      top: the costliest kernels, largest first. figures: name and source of the figures used.
      xla_optimal_s: XLA's ``cost_analysis()`` ``optimal_seconds`` (loop bodies once; None where
        not given); loop_once_s: this model counted the same way (:func:`xla_disagreement`).
    """

    step_time_s: float
    compute_s: float
    memory_s: float
    elementwise_s: float
    launch_s: float
    transfer_s: float
    collective_s: float
    allocation_s: float
    recompute_s: float
    kernels: int
    top: tuple[KernelTime, ...]
    figures: str
    measured_figures: bool
    xla_optimal_s: float | None = None
    loop_once_s: float | None = None
    calibration: Calibration | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepTime:
        data = dict(data)
        data["top"] = tuple(KernelTime(**k) for k in data["top"])
        if data.get("calibration") is not None:
            data["calibration"] = Calibration(**data["calibration"])
        return cls(**data)

    def summary(self) -> str:
        """E.g. ``"812 ms (compute 41%, memory 52%, launch 2%, host 5%)"``."""
        parts = [
            ("compute", self.compute_s), ("memory", self.memory_s),
            ("elementwise", self.elementwise_s), ("launch", self.launch_s),
            ("host", self.transfer_s), ("collectives", self.collective_s),
            ("allocation", self.allocation_s),
        ]  # fmt: skip
        total = self.step_time_s or 1.0
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts if v / total >= 0.005)
        return f"{format_seconds(self.step_time_s, 3)} ({shares})"


def estimate(
    comps: dict[str, hlo.Computation],
    figures: DeviceFigures,
    fresh_bytes: int = 0,
    top_k: int = 8,
) -> StepTime:
    """The estimated step time of a compiled module (see the module docstring).

    Args:
      comps: the optimized HLO module (:func:`remat_kit.memory.hlo.parse_hlo_module`).
      fresh_bytes: bytes allocated anew per execution; costed where ``fresh_bytes_per_s`` is set.
      top_k: kernels kept in ``StepTime.top``.
    """
    return time_kernels(executed_kernels(comps), figures, fresh_bytes, top_k)


def cross_checked(
    step: StepTime, comps: dict[str, hlo.Computation], figures: DeviceFigures, xla_cost: Any
) -> StepTime:
    """``step`` with XLA's ``optimal_seconds``
    (:func:`remat_kit.memory.compile_cache.cost_fields`) and this model's loop-once time."""
    optimal = (xla_cost or {}).get("optimal_seconds")
    if not optimal or optimal <= 0:
        return step
    once = [dataclasses.replace(k, count=1) for k in executed_kernels(comps)]
    return dataclasses.replace(
        step, xla_optimal_s=float(optimal), loop_once_s=time_kernels(once, figures).step_time_s
    )


#: Factor between this model's and XLA's loop-once times above which
#: :func:`xla_disagreement` warns.
XLA_DISAGREEMENT = 2.0


def xla_disagreement(step: StepTime | None) -> str | None:
    """A warning where :func:`cross_checked`'s times differ by over :data:`XLA_DISAGREEMENT`."""
    if step is None or not step.xla_optimal_s or not step.loop_once_s:
        return None
    ratio = step.loop_once_s / step.xla_optimal_s
    if 1 / XLA_DISAGREEMENT <= ratio <= XLA_DISAGREEMENT:
        return None
    return (
        "time model and XLA's own cost model (cost_analysis optimal_seconds) disagree, each "
        f"loop body counted once: {format_seconds(step.loop_once_s, 3)} against XLA's "
        f"{format_seconds(step.xla_optimal_s, 3)} ({ratio:.2f}x)"
    )


def time_kernels(
    kernels: Iterable[Kernel], figures: DeviceFigures, fresh_bytes: int = 0, top_k: int = 8
) -> StepTime:
    """Sum the roofline over ``kernels``, plus ``fresh_bytes / figures.fresh_bytes_per_s``."""
    terms, recompute, n_kernels, per_kernel = _tally(kernels, figures)
    per_kernel.sort(key=lambda t: -t.time_s)
    allocation = fresh_bytes / figures.fresh_bytes_per_s if figures.fresh_bytes_per_s else 0.0
    total = sum(terms.values()) + allocation
    return StepTime(
        step_time_s=total,
        compute_s=terms["compute"],
        memory_s=terms["memory"] + terms["cache"],
        elementwise_s=terms["elementwise"],
        launch_s=terms["launch"],
        transfer_s=terms["host_link"],
        collective_s=terms["interconnect"],
        allocation_s=allocation,
        recompute_s=recompute,
        kernels=n_kernels,
        top=tuple(per_kernel[:top_k]),
        figures=f"{figures.name}: {figures.source}",
        measured_figures=figures.measured,
        calibration=figures.calibration,
    )


def _tally(
    kernels: Iterable[Kernel], figures: DeviceFigures
) -> tuple[dict[str, float], float, int, list[KernelTime]]:
    """``(seconds per term, recompute seconds, executions, per-kernel times)`` in schedule order."""
    terms = dict.fromkeys(
        ("compute", "memory", "cache", "elementwise", "launch", "host_link", "interconnect"), 0.0
    )
    recompute = 0.0
    per_kernel: list[KernelTime] = []
    n_kernels = 0
    # Asynchronous work in flight: start name -> [seconds left per execution, term, count].
    in_flight: dict[str, list] = {}
    reuse = _ReuseModel(figures.cache_bytes)
    for k in kernels:
        if k.kind == "done":
            left = in_flight.pop(k.async_start, None)
            if left:
                terms[left[1]] += left[0] * left[2]
            continue
        n_kernels += k.count
        if k.kind in ("host_transfer", "collective"):
            seconds, term = _transfer_seconds(k, figures)
            if k.async_start:
                in_flight[k.async_start] = [seconds, term, k.count]
            else:
                terms[term] += seconds * k.count
                _hide(in_flight, seconds, k.count)
            per_kernel.append(
                KernelTime(k.name, k.kind, k.count, seconds * k.count, term, k.op_name)
            )
            continue
        body, bound = _roofline_body(k, figures, reuse)
        per_exec = body + figures.launch_s
        terms[bound] += body * k.count
        terms["launch"] += figures.launch_s * k.count
        if k.recompute:
            recompute += per_exec * k.count
        if k.async_start:  # work wrapped in an async-start (not a transfer): runs alongside
            in_flight[k.async_start] = [per_exec, bound, k.count]
            terms[bound] -= body * k.count
            terms["launch"] -= figures.launch_s * k.count
            continue
        _hide(in_flight, per_exec, k.count)
        per_kernel.append(KernelTime(k.name, k.kind, k.count, per_exec * k.count, bound, k.op_name))
    for seconds, term, count in in_flight.values():  # never closed: exposed
        terms[term] += seconds * count
    return terms, recompute, n_kernels, per_kernel


def _transfer_seconds(k: Kernel, figures: DeviceFigures) -> tuple[float, str]:
    """``(seconds per execution, term)`` of a transfer or collective (0: bandwidth unknown)."""
    term = "host_link" if k.kind == "host_transfer" else "interconnect"
    bw = (
        figures.host_link_bytes_per_s
        if term == "host_link"
        else collective_bandwidth(k.group, figures)
    )
    # a transfer crosses once; a collective's wire bytes are its bytes_read
    nbytes = k.bytes_read if k.kind == "collective" else max(k.bytes_read, k.bytes_written)
    return (nbytes / bw if bw else 0.0), term


def _roofline_body(k: Kernel, figures: DeviceFigures, reuse: _ReuseModel) -> tuple[float, str]:
    """``(seconds per execution, bound)``: the longest of matmul, memory and vector time."""
    compute = _matmul_seconds(k, figures)
    cached, uncached = reuse.split(k)
    memory = cached / figures.cache_bytes_per_s + uncached / figures.memory_bytes_per_s
    vector = (
        k.elementwise / figures.elementwise_per_s + k.transcendental / figures.transcendental_per_s
    )
    body = max(compute, memory, vector)
    if body == compute and compute:
        bound = "compute"
    elif body == memory:
        bound = "cache" if cached > uncached else "memory"
    else:
        bound = "elementwise"
    return body, bound


def _matmul_seconds(k: Kernel, figures: DeviceFigures) -> float:
    """A kernel's matmul seconds: fused attention at the attention rate where known; else
    batched and plain FLOPs at their rates, over :func:`gemm_efficiency`."""
    if not k.flops:
        return 0.0
    dtype = k.dtype or "f32"
    if k.kind == "attention" and figures.attention_flops:
        rate = figures.attention_flops.get(dtype) or figures.attention_flops["bf16"]
        return k.flops / rate
    plain = k.flops - k.batched_flops
    seconds = plain / figures.matmul_peak(dtype) + k.batched_flops / figures.matmul_peak(
        dtype, batched=True
    )
    return seconds / gemm_efficiency(k.gemm, figures.sm_count)


#: cuBLAS output tiles (rows x columns) per thread block (NVIDIA, "Matrix Multiplication
#: Background User's Guide",
#: docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication).
GEMM_TILES = ((256, 128), (128, 256), (128, 128))


def gemm_efficiency(gemm: tuple[int, int, int] | tuple[()], sm_count: int) -> float:
    """Share of the matmul rate a ``(batch, m, n)`` output keeps after tile and wave quantization
    (ibid.): best over :data:`GEMM_TILES` of ``useful / (waves * sm_count * tile area)``,
    ``waves = ceil(batch * ceil(m / tm) * ceil(n / tn) / sm_count)``; 1.0 if ``sm_count`` is 0."""
    if not sm_count or not gemm:
        return 1.0
    batch, m, n = gemm
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sm_count)
        best = max(best, batch * m * n / (waves * sm_count * tm * tn))
    return min(best, 1.0) or 1.0


def collective_bandwidth(group: tuple[int, ...], figures: DeviceFigures) -> float | None:
    """Bytes/s per device of a ring over ``group``: the interconnect's within a node; across
    nodes at most ``group devices per node x network_bytes_per_s`` (Bekman, ML Engineering Open
    Book, network/README.md, "Inter-node speed depends on intra-node speed"). None: unknown."""
    bw = figures.interconnect_bytes_per_s
    size = figures.node_size
    if not group or not size or not figures.network_bytes_per_s:
        return bw
    nodes: dict[int, int] = {}
    for device in group:
        nodes[device // size] = nodes.get(device // size, 0) + 1
    if len(nodes) <= 1:
        return bw
    per_node = min(nodes.values())
    network = per_node * figures.network_bytes_per_s
    return network if bw is None else min(bw, network)


def _hide(in_flight: dict[str, list], per_exec: float, count: int) -> None:
    """Shrink the asynchronous work in flight by a kernel's time."""
    for entry in in_flight.values():
        entry[0] = max(0.0, entry[0] - per_exec * count / max(entry[2], 1))


class _ReuseModel:
    """Reads served by the cache: traffic since last use plus the operand's size within
    ``capacity`` bytes (reuse distance, Mattson et al., "Evaluation techniques for storage
    hierarchies", IBM Systems Journal 9(2), 1970); loop bodies judged as one iteration."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.position = 0  # bytes of traffic so far
        self.last: dict[str, int] = {}  # value -> position when last touched

    def split(self, k: Kernel) -> tuple[int, int]:
        """``(cached, uncached)`` bytes of ``k``'s traffic (outputs uncached)."""
        if not self.capacity:
            return 0, k.bytes_read + k.bytes_written
        cached = 0
        for name, nbytes in k.reads:
            seen = self.last.get(name)
            if seen is not None and self.position - seen + nbytes <= self.capacity:
                cached += nbytes
        traffic = k.bytes_read + k.bytes_written
        self.position += traffic
        for name, _ in k.reads:
            self.last[name] = self.position
        self.last[k.name] = self.position
        return cached, traffic - cached


#: Error of datasheet estimates between two policies (share of step time): the largest gap to
#: a published recompute overhead, rounded up (docs/results/published.md,
#: ``experiments/bench_published.py``).
DATASHEET_ESTIMATE_ERROR = 0.44


def estimate_error(target: T.Target) -> float:
    """Share of step time within which two estimates on ``target`` are a tie:
    :data:`DATASHEET_ESTIMATE_ERROR` for datasheet targets, 0 for the calibrated local device."""
    figures = device_figures(target)
    return 0.0 if figures is None or figures.measured else DATASHEET_ESTIMATE_ERROR


#: Seconds below which calibrated CPU estimates are furthest off
#: (docs/time-model.md, "Small steps").
SMALL_STEP_S = 0.03


def small_step_note(
    step_times_s: Iterable[float | None], measured: bool, timed: bool = False
) -> str | None:
    """A caveat for estimates of small steps on the calibrated local device, or None.

    Args:
      step_times_s: estimated seconds (None skipped).
      measured: figures calibrated here (datasheet targets get no caveat).
      timed: measured steps stand beside the estimates (the sweep).

    Returns None when no estimate is below :data:`SMALL_STEP_S`.
    """
    times = [t for t in step_times_s if t is not None]
    if not measured or not times or min(times) >= SMALL_STEP_S:
        return None
    advice = (
        "go by the measured steps beside them"
        if timed
        else "time the policies you consider (experiments/sweep.py)"
    )
    return (
        f"small steps (estimated {min(times) * 1e3:.3g} ms and up): below about "
        f"{SMALL_STEP_S * 1e3:.0f} ms on a CPU the estimate has measured 10-63% below the step "
        "in the runs docs/time-model.md records (small steps), more for the smallest, and its "
        f"order of the policies did not hold; {advice}"
    )


def no_remat_slower_note(step_times_s: dict[str, float | None], measured: bool) -> str | None:
    """Why no-remat is estimated slower than a recomputing policy on a datasheet target (stacked
    residuals, docs/time-model.md, "On GPUs"); None where it is not, or ``measured``."""
    slower = None if measured else no_remat_slower_by(step_times_s)
    if slower is None:
        return None
    label, fraction = slower
    return f"no-remat is estimated {fraction:.0%} slower than {label}: {NO_REMAT_SLOWER}"


def no_remat_slower_by(step_times_s: dict[str, float | None]) -> tuple[str, float] | None:
    """``(label, fraction)``: the policy estimated fastest and how much slower no-remat is than
    it (``t_no_remat / t - 1``, > 0), from step seconds by policy label; None where no-remat is
    not slower or either is unknown."""
    mine = step_times_s.get("no-remat")
    others = {k: v for k, v in step_times_s.items() if k != "no-remat" and v}
    if not mine or not others:
        return None
    label, best = min(others.items(), key=lambda kv: kv[1])
    return (label, mine / best - 1) if mine > best else None


#: Why no-remat can be estimated slower than recomputation (:func:`no_remat_slower_note`).
NO_REMAT_SLOWER = (
    "the estimate charges a scanned step that keeps its residuals the copies that stack them per "
    "layer (dynamic-update-slice), read them back (dynamic-slice), transpose and zero-fill the "
    "stacks; recomputation avoids them. No measurement of remat-kit's on a GPU or TPU confirms "
    "this yet (docs/time-model.md): time both before trusting the order"
)


def time_model_note(target: T.Target) -> str:
    """The note every recommendation carries about the time model and its limits."""
    figures = device_figures(target)
    where = (
        "device figures calibrated on this machine"
        if figures is not None and figures.measured
        else "device figures from the datasheet, at the share of peak measured in published "
        "runs where known"
    )
    return (
        f"step time = roofline over the compiled kernels on {target.name} ({where}): each "
        "kernel's matmul, memory and elementwise time, whichever is largest, plus launches and "
        "the host transfers and collectives the schedule cannot hide; it leaves out kernels "
        "running concurrently, caches beyond one level and latency-bound kernels: an estimate "
        "to rank by, not a measurement"
    )


def step_time_of(
    target: T.Target,
    dump: hlo.DumpFiles,
    parts: dict[str, int | None],
    xla_cost: dict[str, float] | None = None,
) -> StepTime | None:
    """The roofline estimate of a compiled step (None without a dump or device figures), with
    :func:`fresh_bytes` where allocation costs and XLA's ``xla_cost`` beside it
    (:func:`cross_checked`)."""
    figures = device_figures(target)
    if figures is None or not dump.hlo:
        return None
    step = estimate(dump.module, figures, fresh_bytes=fresh_bytes(parts))
    return cross_checked(step, dump.module, figures, xla_cost)


def fresh_bytes(parts: dict[str, int | None]) -> int:
    """Bytes an execution allocates anew on XLA:CPU: temp and non-aliased outputs, each of at
    least :data:`FRESH_ALLOCATION_MIN_BYTES` (smaller ones come from glibc's heap).
    Checked by ``experiments/bench_page_faults.py``."""
    outputs = (parts["output_bytes"] or 0) - (parts["alias_bytes"] or 0)
    return sum(n for n in (parts["temp_bytes"] or 0, outputs) if n >= FRESH_ALLOCATION_MIN_BYTES)
