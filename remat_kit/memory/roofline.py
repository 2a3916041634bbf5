"""The step-time model: a roofline over every kernel of the compiled program.

The optimized HLO that XLA dumps for a compile (:mod:`remat_kit.memory.hlo`) lists, in schedule
order, the kernels one step runs (``while`` bodies ``known_trip_count`` times). Per kernel this
module counts matmul FLOPs and their dtype, elementwise and transcendental operations, and the
bytes read and written at the kernel's boundary, and times it as a roofline (Williams, Waterman,
Patterson, CACM 52(4), 2009) plus a launch cost, in seconds:

    t = max((flops - batched) / peak_flops[dtype] + batched / batched_flops[dtype],
            bytes / bandwidth,
            elementwise / elementwise_rate + transcendental / transcendental_rate) + launch_s

``bandwidth`` is the last-level cache's for bytes re-read within ``cache_bytes`` of traffic (a
reuse-distance model), else device memory's. Host transfers run at the host link, collectives
at the interconnect (ring: an all-reduce moves ``2 (n-1)/n`` of its bytes), an asynchronous one
charged only beyond the kernels scheduled between its start and done. The step time is the sum.

:class:`DeviceFigures` (:func:`device_figures`) come from the target's datasheet
(:class:`~remat_kit.targets.Target`, cited there) or, for the local device, from
:func:`calibrate`, which times a few micro-kernels through JAX and caches the figures per machine
under :func:`cache_dir` (``refresh=True`` times again). What each rule counts, the device
figures and the model's error against measured steps: docs/time-model.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform as _platform
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from remat_kit import files
from remat_kit import targets as T
from remat_kit.memory import compile_cache, hlo
from remat_kit.units import format_seconds

#: Opcodes that launch no kernel (names, views, control) and move no bytes.
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
    "after-all", "partition-id", "replica-id", "add-dependency", "domain", "iota",
})  # fmt: skip
#: Elementwise opcodes costing a transcendental-unit operation per element.
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt",
    "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf",
})  # fmt: skip
#: Opcodes counted as one elementwise operation per output element inside a kernel.
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
    "select", "and", "or", "xor", "not", "convert", "clamp", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "sign", "remainder", "reduce-precision", "is-finite", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "stochastic-convert",
})  # fmt: skip
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "ragged-all-to-all", "collective-broadcast")  # fmt: skip
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_REPLICA_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_HOST = re.compile(r"S\(5\)")


#: Smallest allocation whose pages are faulted in anew at every step on a CPU: glibc serves
#: requests at or above its mmap threshold, whose dynamic ceiling is 32 MiB on 64-bit systems,
#: with a fresh mmap (mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX); docs/time-model.md.
FRESH_ALLOCATION_MIN_BYTES = 32 * 2**20

#: Runs of the fresh-output kernel a calibration keeps the best of (the most variable figure;
#: ``experiments/bench_page_faults.py``).
FRESH_RUNS = 9


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The state of the machine while the local device's figures were timed (:func:`calibrate`).

    Attributes:
      others_share: the share of the machine's cores (0 to 1) other processes kept busy
        meanwhile (:func:`others_share`); None where it could not be read.
      load_average: the 1-minute load average when the timing ended; None where unknown.
      contended: ``others_share`` above :data:`CONTENDED_SHARE` (or, unknown, the load average
        above the core count): the figures are below an idle machine's.
    """

    others_share: float | None
    load_average: float | None
    contended: bool


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """What the roofline needs to know about one device. Rates per second, sizes in bytes.

    Attributes:
      name: the target or machine these figures describe.
      peak_flops: matmul peak FLOP/s by operand dtype (``"bf16"``, ``"f32"``); a dtype absent
        here uses the ``"f32"`` figure.
      memory_bytes_per_s: device-memory bandwidth (HBM; DRAM for a CPU).
      cache_bytes: capacity of the cache that serves re-reads (GPU L2, CPU last-level cache);
        0 to switch the reuse model off.
      cache_bytes_per_s: bandwidth of that cache.
      elementwise_per_s: elementwise operations per second (FP32 lanes x clock).
      transcendental_per_s: transcendental operations per second (special-function units).
      launch_s: fixed cost of one kernel.
      host_link_bytes_per_s: host<->device bandwidth per direction, None if there is none.
      interconnect_bytes_per_s: device<->device bandwidth per direction, None if unknown.
      source: where each figure comes from (datasheet, or the calibration and when it ran).
      measured: True when the figures were timed on this machine (calibration).
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes_per_s: float
    cache_bytes: int
    cache_bytes_per_s: float
    elementwise_per_s: float
    transcendental_per_s: float
    launch_s: float
    host_link_bytes_per_s: float | None
    interconnect_bytes_per_s: float | None
    source: str
    measured: bool = False
    #: Bytes/s at which a step's freshly allocated buffers are faulted in (XLA:CPU allocates
    #: temp and outputs at each execution); None where buffers are reused (GPU, TPU).
    fresh_bytes_per_s: float | None = None
    #: FLOP/s of a matmul with batch dimensions (attention's per-head ``Q @ K^T``, ``P @ V``)
    #: by operand dtype, from the calibration; None: at :attr:`peak_flops` (datasheets).
    batched_flops: dict[str, float] | None = None
    #: The machine's state while calibrated figures were timed; None for datasheet figures.
    calibration: Calibration | None = None
    #: Streaming multiprocessors a GPU spreads a matmul's output tiles over (wave and tile
    #: quantization, :func:`gemm_efficiency`); 0 where matmuls are not costed by tiles.
    sm_count: int = 0
    #: Devices joined by :attr:`interconnect_bytes_per_s` (a GPU node); None: any number.
    node_size: int | None = None
    #: Per-device bytes/s between nodes (a GPU's NIC), None where unknown.
    network_bytes_per_s: float | None = None
    #: FLOP/s of a fused attention call (cuDNN flash attention) by operand dtype; None: at
    #: :attr:`peak_flops`.
    attention_flops: dict[str, float] | None = None

    def matmul_peak(self, dtype: str, batched: bool = False) -> float:
        """FLOP/s of a matmul whose operands are ``dtype``; ``batched``: one with batch
        dimensions (:attr:`batched_flops` where known)."""
        if batched and self.batched_flops:
            return self.batched_flops.get(dtype) or self.batched_flops["f32"]
        return self.peak_flops.get(dtype) or self.peak_flops["f32"]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the compiled step, as the roofline costs it.

    Attributes:
      name: the HLO instruction (``fusion.12``, ``dot.3``, ``copy-start.2``).
      kind: ``matmul`` (a dot, gemm or a fusion whose time is its matmul), ``attention`` (a
        fused attention call), ``fusion``, ``copy``, ``collective``, ``host_transfer`` or
        ``other``.
      count: executions per step (the trip counts of the loops around it multiplied).
      flops: matmul FLOPs per execution; dtype: the matmul operands' dtype ("" if none).
      batched_flops: the part of ``flops`` in matmuls with batch dimensions
        (:func:`hlo.is_batched_matmul`), timed at :meth:`DeviceFigures.matmul_peak`'s batched
        rate.
      elementwise, transcendental: operations per execution.
      bytes_read, bytes_written: bytes at the kernel's boundary per execution.
      op_name: JAX's ``op_name`` of the instruction (what the user's code called).
      recompute: under JAX's remat scope or cloned by XLA's rematerialisation pass.
    """

    name: str
    kind: str
    count: int
    flops: float
    dtype: str
    elementwise: float
    transcendental: float
    bytes_read: int
    bytes_written: int
    op_name: str
    recompute: bool
    #: Bytes read per operand: ``((HLO value, bytes), ...)`` (the reuse model's input).
    reads: tuple[tuple[str, int], ...] = ()
    #: For an asynchronous start (``copy-start``, ``all-gather-start``, ``async-start``): its
    #: own name; for a ``*-done``: the start it closes; "" for a synchronous kernel.
    async_start: str = ""
    batched_flops: float = 0.0
    #: ``(batch, m, n)`` of the kernel's largest matmul output (:func:`hlo.gemm_dims`), the
    #: tiles a GPU covers; () for no matmul.
    gemm: tuple[int, int, int] = ()
    #: A collective's first replica group: the device ids that exchange data; () if unknown.
    group: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel's share of the step: its total seconds (all executions) and what bound it
    (``compute``, ``memory``, ``cache``, ``elementwise``, ``launch``, ``host_link``,
    ``interconnect``)."""

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
    collective_s + allocation_s``: each kernel's roofline time is assigned to the term that
    bound it (its launch cost to ``launch_s``); ``transfer_s`` and ``collective_s`` are the
    host-transfer and collective time the schedule could not hide behind other kernels.

    Attributes:
      kernels: executed kernels per step (loop bodies times their trip counts).
      allocation_s: faulting in the step's freshly allocated buffers (temp and outputs not
        aliased to inputs) where the backend allocates them per execution (XLA:CPU); 0 else.
      recompute_s: time of the kernels that recompute the forward pass (included above).
      top: the kernels taking the most time, largest first.
      figures: the device figures used (name and source).
      measured_figures: True when they were calibrated on this machine.
      xla_optimal_s: XLA's own cost model's time for the module (``cost_analysis()``'s
        ``optimal_seconds``, every loop body counted once), None where the backend gives none
        (deviceless GPU compiles); loop_once_s: this model's time counted the same way (each
        kernel once per step, whatever its loop's trip count): the two side by side are the
        cross-check (:func:`xla_disagreement`).
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


# -- Counting kernels ------------------------------------------------------------------------


def _nbytes(shape: str) -> int:
    return sum(hlo.shape_bytes(t, d) for t, d in hlo.array_shapes(shape) if t != "token")


def _elements(shape: str) -> int:
    return sum(math.prod(d) for _, d in hlo.array_shapes(shape))


def _dtype_of(shape: str) -> str:
    arrays = hlo.array_shapes(shape)
    return arrays[0][0] if arrays else ""


def _callees(instr: hlo.Instruction) -> list[str]:
    names = [c for kind, c in hlo._CALLEE.findall(instr.attributes) if kind != "condition"]
    calls = hlo._CALLS_SET.search(instr.attributes)
    if calls:
        names += [c.strip().lstrip("%") for c in calls.group(1).split(",") if c.strip()]
    return names


@dataclasses.dataclass
class _Inside:
    flops: float = 0.0
    batched_flops: float = 0.0
    dtype: str = ""
    elementwise: float = 0.0
    transcendental: float = 0.0
    gemm: tuple[int, int, int] = ()
    gemm_flops: float = 0.0


def _inside(comps: dict[str, hlo.Computation], name: str, memo: dict) -> _Inside:
    """Matmul FLOPs and elementwise work of a fused (or called) computation, all nested."""
    if name in memo:
        return memo[name]
    out = _Inside()
    comp = comps.get(name)
    if comp is None:
        memo[name] = out
        return out
    shapes = hlo.Shapes(comp.param_shapes)
    for instr in comp.instructions:
        shapes[instr.name] = instr.shape
        f = hlo.instruction_flops(instr, shapes)
        if f:
            out.flops += f
            out.batched_flops += f if hlo.is_batched_matmul(instr) else 0.0
            dims = hlo.gemm_dims(instr)
            if dims and f > out.gemm_flops:
                out.gemm, out.gemm_flops = dims, f
            if not out.dtype and instr.operands:
                out.dtype = _dtype_of(shapes.get(instr.operands[0], ""))
        elif instr.opcode in _TRANSCENDENTAL:
            out.transcendental += _elements(instr.shape)
        elif instr.opcode in _ELEMENTWISE:
            out.elementwise += _elements(instr.shape)
        elif instr.opcode in ("reduce", "reduce-window"):
            # one combine per input element
            first = shapes.get(instr.operands[0], "") if instr.operands else ""
            out.elementwise += _elements(first)
        for callee in _callees(instr):
            if instr.opcode in (
                "reduce",
                "reduce-window",
                "scatter",
                "sort",
                "map",
                "select-and-scatter",
            ):
                continue  # the reducer runs per element: counted above
            sub = _inside(comps, callee, memo)
            out.flops += sub.flops
            out.batched_flops += sub.batched_flops
            out.dtype = out.dtype or sub.dtype
            out.elementwise += sub.elementwise
            out.transcendental += sub.transcendental
            if sub.gemm_flops > out.gemm_flops:
                out.gemm, out.gemm_flops = sub.gemm, sub.gemm_flops
    memo[name] = out
    return out


def _fusion_bytes(
    instr: hlo.Instruction, comps: dict[str, hlo.Computation], shapes: dict[str, str]
) -> tuple[list[int], int]:
    """``(read per operand, written)`` bytes of a fusion: its operands (a parameter used only
    through slices counts the slices; the buffer an in-place dynamic-update-slice writes into
    counts nothing) and its output (an in-place dynamic-update-slice counts its update)."""
    callees = _callees(instr)
    comp = comps.get(callees[0]) if callees else None
    operand_bytes = [_nbytes(shapes.get(op, "")) for op in instr.operands]
    if comp is None:
        return operand_bytes, _nbytes(instr.shape)
    by_name = {i.name: i for i in comp.instructions}
    params: dict[int, str] = {}
    for i in comp.instructions:
        if i.opcode == "parameter":
            idx = _param_index(i)
            if idx is not None:
                params[idx] = i.name
    users: dict[str, list[hlo.Instruction]] = {}
    for i in comp.instructions:
        for op in i.operands:
            users.setdefault(op, []).append(i)
    root = comp.instructions[-1] if comp.instructions else None  # XLA prints ROOT last
    roots = [root] if root is not None else []
    if root is not None and root.opcode == "tuple":
        roots = [by_name[o] for o in root.operands if o in by_name]
    in_place: set[str] = set()
    written = 0
    for r in roots:
        r2 = _through_bitcasts(r, by_name)
        if r2.opcode == "dynamic-update-slice" and len(r2.operands) > 1:
            in_place.add(_source(r2.operands[0], by_name))
            written += _nbytes(_shape_in(comp, r2.operands[1], by_name))
        else:
            written += _nbytes(r.shape)
    read = []
    for idx, total in enumerate(operand_bytes):
        pname = params.get(idx)
        if pname is None:
            read.append(total)
            continue
        if pname in in_place:
            read.append(0)
            continue
        uses = _uses_through_bitcasts(pname, users)
        if uses and all(
            u.opcode in _SLICING and u.operands[0] in _aliases(pname, users) for u in uses
        ):
            read.append(min(total, sum(_nbytes(u.shape) for u in uses)))
        else:
            read.append(total)
    return read, written


def _param_index(instr: hlo.Instruction) -> int | None:
    m = re.match(r"\s*(\d+)", instr.operands[0]) if instr.operands else None
    return int(m.group(1)) if m else None


def _through_bitcasts(instr: hlo.Instruction, by_name: dict[str, hlo.Instruction]):
    while instr.opcode in ("bitcast", "copy") and instr.operands and instr.operands[0] in by_name:
        instr = by_name[instr.operands[0]]
    return instr


def _source(name: str, by_name: dict[str, hlo.Instruction]) -> str:
    while name in by_name and by_name[name].opcode == "bitcast" and by_name[name].operands:
        name = by_name[name].operands[0]
    return name


def _shape_in(comp: hlo.Computation, name: str, by_name: dict[str, hlo.Instruction]) -> str:
    if name in by_name:
        return by_name[name].shape
    shapes = hlo.Shapes(comp.param_shapes)  # a parameter, or an element ``x#k`` of a tuple
    base, _ = hlo.tuple_element(name)
    if base in by_name:
        shapes[base] = by_name[base].shape
    return shapes.get(name, "") or ""


def _aliases(name: str, users: dict[str, list[hlo.Instruction]]) -> set[str]:
    out, todo = {name}, [name]
    while todo:
        for u in users.get(todo.pop(), []):
            if u.opcode == "bitcast" and u.name not in out:
                out.add(u.name)
                todo.append(u.name)
    return out


def _uses_through_bitcasts(name: str, users: dict[str, list[hlo.Instruction]]):
    return [u for a in _aliases(name, users) for u in users.get(a, []) if u.opcode != "bitcast"]


_IOTA_LIST = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{\{(\d+),(\d+)\}")


def _mesh_devices(text: str | None, n: int) -> list[int]:
    """The device id at each position of a mesh (row-major) from a mesh's ``device_ids``: an
    iota (``[3,32]T(1,0)``: ``iota(96).reshape(3, 32).transpose(1, 0)`` flattened) or a list
    (``0,2,1,3``); ``range(n)`` where none is written."""
    if not text:
        return list(range(n))
    m = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", text)
    if m:
        import numpy as np

        ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        return [int(x) for x in ids.reshape(-1)]
    return [int(x) for x in re.findall(r"\d+", text)]


def replica_group(instr: hlo.Instruction) -> tuple[int, ...]:
    """The device ids of a collective's first replica group, as XLA prints it: a list
    (``replica_groups={{0,1,2,3},{4,5,6,7}}``), an iota (``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)``:
    one group a row) or a mesh (``mesh['x'=2,'y'=4] {'y'}``: the devices differing along the named
    axes only). A ``collective-permute`` gives its first source and target. () where none is
    written."""
    text = instr.attributes
    m = _REPLICA_GROUPS.search(text)
    if m and m.group(1):
        return tuple(int(x) for x in m.group(1).split(","))
    m = _IOTA_LIST.search(text)
    if m:
        import numpy as np

        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return tuple(int(x) for x in ids.reshape(shape[0], -1)[0])
    m = _MESH_GROUPS.search(text)
    if m:
        axes = re.findall(r"'([^']*)'=(\d+)", m.group(1))
        chosen = set(re.findall(r"'([^']*)'", m.group(3)))
        sizes = [int(n) for _, n in axes]
        strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        ids = [0]
        for (name, n), stride in zip(axes, strides, strict=True):
            if name in chosen:
                ids = [i + k * stride for i in ids for k in range(int(n))]
        devices = _mesh_devices(m.group(2), math.prod(sizes))
        return tuple(sorted(devices[i] for i in ids))
    m = _PAIRS.search(text)
    if m:
        return (int(m.group(1)), int(m.group(2)))
    return ()


def _collective_factor(opcode: str, n: int) -> float:
    """Bytes on the wire per byte of the collective's larger side, ring algorithms (Thakur,
    Rabenseifner, Gropp, "Optimization of collective communication operations in MPICH",
    IJHPCA 19(1), 2005)."""
    if n <= 1:
        return 0.0
    if opcode.startswith("all-reduce"):
        return 2.0 * (n - 1) / n
    if opcode.startswith("collective-permute") or opcode.startswith("collective-broadcast"):
        return 1.0
    return (n - 1) / n


def executed_kernels(comps: dict[str, hlo.Computation]) -> list[Kernel]:
    """Every kernel one step executes, in schedule order, loop bodies once per kernel with
    ``count`` = the trip counts around it (conditionals: their costliest branch by bytes).

    A loop of unknown trip count is counted once (the memory reader warns about it)."""
    memo: dict = {}
    out: list[Kernel] = []

    def walk(name: str, count: int, recompute: bool, depth: int = 0) -> None:
        comp = comps.get(name)
        if comp is None or depth > 64:
            return
        shapes = hlo.Shapes(comp.param_shapes)
        for instr in comp.instructions:
            shapes[instr.name] = instr.shape
            op = instr.opcode
            rec = (
                recompute
                or hlo.is_xla_remat(instr.name)
                or (hlo.JAX_RECOMPUTE_SCOPE in instr.op_name)
            )
            if op in _FREE:
                continue
            if op == "while":
                body = re.search(r"\bbody=%([\w.\-]+)", instr.attributes)
                trip = hlo._TRIP_COUNT.search(instr.attributes)
                # the TPU compiler writes no known_trip_count: read it from the condition
                n = int(trip.group(1)) if trip else hlo.inferred_trip_count(instr, comp, comps)
                n = 1 if n is None else n
                if body:
                    walk(body.group(1), count * n, rec, depth + 1)
                continue
            if op == "conditional":
                branches = hlo._BRANCHES.search(instr.attributes)
                names = (
                    [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                    if branches
                    else _callees(instr)
                )
                best: list[Kernel] = []
                for b in names:
                    sub_out: list[Kernel] = []
                    _walk_into(b, count, rec, depth, sub_out)
                    if sum(k.bytes_read + k.bytes_written for k in sub_out) >= sum(
                        k.bytes_read + k.bytes_written for k in best
                    ):
                        best = sub_out
                out.extend(best)
                continue
            if op == "call":
                for callee in _callees(instr):
                    walk(callee, count, rec, depth + 1)
                continue
            if op == "async-start":  # the wrapped operation runs until its async-done
                sub: list[Kernel] = []
                for callee in _callees(instr):
                    _walk_into(callee, count, rec, depth, sub)
                out.extend(dataclasses.replace(k, async_start=instr.name) for k in sub)
                continue
            if op == "async-update":
                continue
            if op.endswith("-done"):
                out.append(_marker(instr, count, rec))
                continue
            out.append(_kernel(instr, comps, shapes, count, rec, memo))

    def _walk_into(name: str, count: int, rec: bool, depth: int, sink: list[Kernel]) -> None:
        nonlocal out
        saved, out = out, sink
        try:
            walk(name, count, rec, depth + 1)
        finally:
            out = saved

    entry = next((c.name for c in comps.values() if c.is_entry), None)
    if entry:
        walk(entry, 1, False)
    return out


def _marker(instr: hlo.Instruction, count: int, rec: bool) -> Kernel:
    """The ``*-done`` of an asynchronous operation: no work of its own (the schedule closes
    the transfer there); ``async_start`` names the start it closes (its operand)."""
    start = instr.operands[0] if instr.operands else ""
    return Kernel(instr.name, "done", count, 0.0, "", 0.0, 0.0, 0, 0, instr.op_name, rec, (), start)


@dataclasses.dataclass
class _Cost:
    """One instruction's cost per execution as :func:`_kernel` works it out (bytes, FLOPs,
    operations); its fields become the :class:`Kernel`'s."""

    kind: str
    operand_bytes: list[int]  # bytes read per operand
    bytes_read: int
    bytes_written: int
    flops: float
    batched_flops: float
    dtype: str
    gemm: tuple[int, int, int] | tuple[()]
    elementwise: float = 0.0
    transcendental: float = 0.0
    group: tuple[int, ...] = ()


def _kernel(
    instr: hlo.Instruction,
    comps: dict[str, hlo.Computation],
    shapes: dict[str, str],
    count: int,
    rec: bool,
    memo: dict,
) -> Kernel:
    """One executed instruction as the roofline costs it: ``count`` executions per step,
    ``rec`` whether it recomputes; ``memo`` caches what fused computations hold."""
    cost = _direct_cost(instr, shapes)
    if instr.opcode == "fusion":
        _fusion_cost(instr, comps, shapes, memo, cost)
    else:
        _opcode_cost(instr, shapes, cost)
    if instr.opcode == "custom-call" and _HOST.search(instr.shape):
        cost.kind = "host_transfer"
    reads = cost.operand_bytes
    if cost.bytes_read != sum(reads):  # a whole-kernel rule changed the bytes: spread them
        total = sum(reads) or 1
        reads = [int(cost.bytes_read * r / total) for r in reads]
    return Kernel(
        name=instr.name,
        kind=cost.kind,
        count=count,
        flops=cost.flops,
        dtype=cost.dtype,
        elementwise=cost.elementwise,
        transcendental=cost.transcendental,
        bytes_read=cost.bytes_read,
        bytes_written=cost.bytes_written,
        op_name=instr.op_name,
        recompute=rec,
        reads=tuple(zip(instr.operands, reads, strict=True)),
        async_start=instr.name if instr.opcode.endswith("-start") else "",
        batched_flops=cost.batched_flops,
        gemm=cost.gemm,
        group=cost.group,
    )


def _direct_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> _Cost:
    """An instruction's cost read off its own shapes, before its opcode's rule: its operands'
    and output's bytes, its matmul FLOPs (dtype, ``gemm`` dims); kind ``other``."""
    reads = [_nbytes(shapes.get(o, "")) for o in instr.operands]
    written = _nbytes(instr.shape)
    flops = hlo.instruction_flops(instr, shapes)
    batched = flops if flops and hlo.is_batched_matmul(instr) else 0.0
    dtype = _dtype_of(shapes.get(instr.operands[0], "")) if flops and instr.operands else ""
    gemm = (hlo.gemm_dims(instr) or ()) if flops else ()
    return _Cost("other", reads, sum(reads), written, flops, batched, dtype, gemm)


def _fusion_cost(
    instr: hlo.Instruction,
    comps: dict[str, hlo.Computation],
    shapes: dict[str, str],
    memo: dict,
    cost: _Cost,
) -> None:
    """Set a fusion's ``cost``: bytes at its boundary (:func:`_fusion_bytes`), FLOPs and
    operations of the computation it calls (:func:`_inside`); kind ``matmul`` or ``fusion``."""
    cost.operand_bytes, cost.bytes_written = _fusion_bytes(instr, comps, shapes)
    cost.bytes_read = sum(cost.operand_bytes)
    inner = _inside(comps, _callees(instr)[0], memo) if _callees(instr) else _Inside()
    cost.flops, cost.batched_flops, cost.dtype = inner.flops, inner.batched_flops, inner.dtype
    cost.gemm = inner.gemm
    cost.elementwise, cost.transcendental = inner.elementwise, inner.transcendental
    cost.kind = "matmul" if cost.flops else "fusion"


def _touches_host(instr: hlo.Instruction, shapes: dict[str, str]) -> bool:
    """Whether the instruction's output or an operand lives in host memory (``S(5)``)."""
    return bool(
        _HOST.search(instr.shape) or any(_HOST.search(shapes.get(o, "")) for o in instr.operands)
    )


def _opcode_cost(instr: hlo.Instruction, shapes: dict[str, str], cost: _Cost) -> None:
    """Apply the rule of an unfused instruction's opcode to ``cost``: its kind, the bytes it
    moves (a ``copy-start`` its array once, a collective its wire bytes, a slice or in-place
    update its slice) and its elementwise or transcendental operations."""
    op = instr.opcode
    base = op.removesuffix("-start")
    if cost.flops:
        target = hlo._call_target(instr)
        cost.kind = "attention" if target.startswith("__cudnn$fmha") else "matmul"
    elif op in ("copy-start",) or (op == "copy" and _touches_host(instr, shapes)):
        cost.kind = "host_transfer" if _touches_host(instr, shapes) else "copy"
        if op == "copy-start":  # (dest, src, context) tuple: the array moved once
            arrays = hlo.array_shapes(instr.shape)
            moved = hlo.shape_bytes(*arrays[0]) if arrays else 0
            cost.bytes_read, cost.bytes_written = moved, moved
    elif base in _COLLECTIVES:
        cost.kind = "collective"
        cost.group = replica_group(instr)
        side = max(cost.bytes_read, cost.bytes_written)
        cost.bytes_read = int(side * _collective_factor(base, len(cost.group)))
        cost.bytes_written = 0
    elif op in ("copy", "transpose"):
        cost.kind = "copy"
    elif op in ("dynamic-update-slice",) and len(instr.operands) > 1:
        update = _nbytes(shapes.get(instr.operands[1], ""))
        cost.bytes_read, cost.bytes_written = update, update
    elif op in ("dynamic-slice", "slice"):
        cost.bytes_read = cost.bytes_written
    elif op in _TRANSCENDENTAL:
        cost.transcendental = _elements(instr.shape)
    elif op in _ELEMENTWISE:
        cost.elementwise = _elements(instr.shape)
    elif op in ("reduce", "reduce-window") and instr.operands:
        cost.elementwise = _elements(shapes.get(instr.operands[0], ""))


# -- Timing the schedule ---------------------------------------------------------------------


def estimate(
    comps: dict[str, hlo.Computation],
    figures: DeviceFigures,
    fresh_bytes: int = 0,
    top_k: int = 8,
) -> StepTime:
    """The estimated step time of a compiled module on a device (see the module docstring).

    Args:
      comps: the optimized HLO module (:func:`remat_kit.memory.hlo.parse_hlo_module`).
      figures: the device's figures (:func:`device_figures`).
      fresh_bytes: bytes the step allocates anew at each execution: temp + output - alias
        (``memory_analysis()``); costed only where ``figures.fresh_bytes_per_s`` is set.
      top_k: how many of the costliest kernels to keep in ``StepTime.top``.
    """
    return time_kernels(executed_kernels(comps), figures, fresh_bytes, top_k)


def cross_checked(
    step: StepTime, comps: dict[str, hlo.Computation], figures: DeviceFigures, xla_cost: Any
) -> StepTime:
    """``step`` with XLA's own estimate beside it: ``xla_cost`` is the compile's cost analysis
    (:func:`remat_kit.memory.compile_cache.cost_fields`); its ``optimal_seconds`` counts each
    loop body once, so this model's time is counted the same way for the comparison. ``step``
    unchanged where XLA gives no time."""
    optimal = (xla_cost or {}).get("optimal_seconds")
    if not optimal or optimal <= 0:
        return step
    once = [dataclasses.replace(k, count=1) for k in executed_kernels(comps)]
    return dataclasses.replace(
        step, xla_optimal_s=float(optimal), loop_once_s=time_kernels(once, figures).step_time_s
    )


#: The factor between this model's and XLA's own time (both counting loop bodies once) beyond
#: which :func:`xla_disagreement` says so.
XLA_DISAGREEMENT = 2.0


def xla_disagreement(step: StepTime | None) -> str | None:
    """A one-line warning where this model and XLA's own cost model (:func:`cross_checked`)
    differ by more than :data:`XLA_DISAGREEMENT` times; None where they agree or XLA gave no
    time."""
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
    """Sum the roofline over ``kernels`` in schedule order (see the module docstring), plus
    ``fresh_bytes / figures.fresh_bytes_per_s`` where the backend allocates per step."""
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
    """Walk ``kernels`` in schedule order: ``(seconds per term, recompute seconds, kernel
    executions, each kernel's time)``, asynchronous work hidden behind what runs meanwhile."""
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
    """``(seconds per execution, term)`` of a host transfer (``host_link``) or a collective
    (``interconnect``): its bytes over the link's bandwidth; 0 where the bandwidth is unknown."""
    term = "host_link" if k.kind == "host_transfer" else "interconnect"
    bw = (
        figures.host_link_bytes_per_s
        if term == "host_link"
        else collective_bandwidth(k.group, figures)
    )
    # a transfer's bytes cross once (read on one side, written on the other); a
    # collective's wire bytes are its bytes_read (see _collective_factor)
    nbytes = k.bytes_read if k.kind == "collective" else max(k.bytes_read, k.bytes_written)
    return (nbytes / bw if bw else 0.0), term


def _roofline_body(k: Kernel, figures: DeviceFigures, reuse: _ReuseModel) -> tuple[float, str]:
    """``(seconds per execution, bound)`` of a kernel's work, launch left out: the longest of
    its matmul, memory (cache or DRAM, per ``reuse``) and vector times, and which bound it."""
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
    """A kernel's matmul time: a fused attention call's FLOPs at the device's attention rate
    where it has one; else its FLOPs in matmuls with batch dimensions at the batched rate, the
    rest at the matmul peak, both over :func:`gemm_efficiency` of its largest matmul."""
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


#: Output tiles (rows x columns) a GPU matmul kernel computes one per thread block, the sizes
#: cuBLAS picks among for large matmuls (NVIDIA, "Matrix Multiplication Background User's
#: Guide", docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication,
#: "Tile quantization" and "Wave quantization").
GEMM_TILES = ((256, 128), (128, 256), (128, 128))


def gemm_efficiency(gemm: tuple[int, int, int] | tuple[()], sm_count: int) -> float:
    """The share of a GPU's matmul rate a ``(batch, m, n)`` output keeps after tile and wave
    quantization (NVIDIA, "Matrix Multiplication Background User's Guide"): for each tile in
    :data:`GEMM_TILES`, ``useful / (waves * sm_count * tile area)`` with ``waves = ceil(batch *
    ceil(m / tm) * ceil(n / tn) / sm_count)``, the best tile taken. 1.0 where ``sm_count`` is 0 or
    the shape unknown; a large matmul keeps about 1.0 (the peak it scales is measured at a best
    shape)."""
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
    """Bus bandwidth (bytes/s per device) of a ring collective over the devices ``group``: the
    interconnect's inside one node; across nodes at most ``devices of the group per node x
    figures.network_bytes_per_s`` (Bekman, ML Engineering Open Book, network/README.md,
    "Inter-node speed depends on intra-node speed"). None where no figure is known."""
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
    """Asynchronous work in flight runs while a kernel (``per_exec`` seconds, ``count``
    executions) does: what is left of each shrinks by the kernel's time per its own execution."""
    for entry in in_flight.values():
        entry[0] = max(0.0, entry[0] - per_exec * count / max(entry[2], 1))


class _ReuseModel:
    """Which of a kernel's reads come from the cache: an operand read while the traffic since
    it was last written or read, plus its own size, fits ``capacity`` bytes (reuse distance,
    Mattson et al., "Evaluation techniques for storage hierarchies", IBM Systems Journal
    9(2), 1970). Values never seen before (the step's arguments) come from memory. A loop body
    is seen once, so its values are judged as in one iteration."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.position = 0  # bytes of traffic so far
        self.last: dict[str, int] = {}  # value -> position when last touched

    def split(self, k: Kernel) -> tuple[int, int]:
        """``(cached, uncached)`` bytes of ``k``'s traffic; its output is written to memory
        (counted uncached) and becomes recent."""
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


#: Environment variable naming a calibration file (the JSON :func:`calibrate` writes) to use
#: instead of timing this machine: figures timed on a quiet machine, or fixed ones for tests.
CALIBRATION_ENV = "REMAT_KIT_CALIBRATION"

#: Version of the calibration's file format and micro-kernels (a change re-times).
CALIBRATION_VERSION = 4

#: Issue rate of the special-function units per SM per clock for 32-bit transcendental
#: instructions on compute capability 8.x and 9.0 (CUDA C++ Programming Guide, "Arithmetic
#: Instructions" throughput table).
_SFU_PER_SM_PER_CLOCK = 16
#: Launch cost of one GPU kernel: a few microseconds back to back (NVIDIA Developer Blog,
#: "Getting Started with CUDA Graphs", 2019, measured ~3 us per short kernel without graphs).
#: An assumption until the GPU check calibrates it on a real H200.
GPU_LAUNCH_S = 3e-6
#: Fixed cost per HLO kernel on a TPU, where the whole step runs as one program on the chip
#: (no host launch per kernel): an assumption of 1 us (pipeline fill and sync between fused
#: ops), no published figure.
TPU_OP_S = 1e-6


def cache_dir() -> Path:
    """remat-kit's cache folder (:func:`remat_kit.memory.compile_cache.default_folder`:
    ``$REMAT_KIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat-kit``, else ``~/.cache/remat-kit``);
    calibrations go in its ``calibration/`` folder."""
    return compile_cache.default_folder()


def datasheet_figures(target: T.Target) -> DeviceFigures | None:
    """Figures of a GPU or TPU target from its vendor figures; None where the target lacks a
    peak FLOP/s or memory bandwidth (the CPU, an unknown local device).

    Elementwise rate: FP32 lanes x SMs x boost clock (one operation per lane per clock);
    transcendental rate: 16 per SM per clock (see :data:`_SFU_PER_SM_PER_CLOCK`). The GPU's L2
    bandwidth is not published: every byte is costed at HBM bandwidth (``cache_bytes=0``).
    A TPU target without a ``gpu`` spec takes its vector rate as a tenth of its matmul peak
    (its VPU's share; an assumption, stated in ``source``).
    """
    if not target.peak_flops_bf16 or not target.hbm_bytes_per_s:
        return None
    gpu = target.gpu
    f32 = target.peak_flops_f32 or target.peak_flops_bf16
    if gpu is not None:
        clock = gpu.clock_rate_ghz * 1e9
        elementwise = gpu.core_count * gpu.fpus_per_core * clock
        transcendental = gpu.core_count * _SFU_PER_SM_PER_CLOCK * clock
        vector_source = (
            f"elementwise {elementwise / 1e12:.1f} Top/s = {gpu.core_count} SMs x "
            f"{gpu.fpus_per_core} FP32 lanes x {gpu.clock_rate_ghz} GHz; transcendental "
            f"{transcendental / 1e12:.2f} Top/s = 16/SM/clock (CUDA C++ Programming Guide)"
        )
    else:
        elementwise = target.peak_flops_bf16 / 10
        transcendental = elementwise / 4
        vector_source = "vector units assumed at 1/10 of the matmul peak (no published figure)"
    if target.launch_s is not None:
        launch, launch_note = target.launch_s, ""
    elif target.platform == "tpu":  # one program on the chip, no host launch per kernel
        launch, launch_note = TPU_OP_S, " (assumed: no published per-op figure for TPUs)"
    else:
        launch, launch_note = GPU_LAUNCH_S, " (assumed: NVIDIA blog, CUDA Graphs)"
    mm = target.matmul_efficiency or 1.0
    hbm = target.hbm_bytes_per_s * (target.memory_efficiency or 1.0)
    achieved = (
        f"; matmuls at {mm:.1%} of peak, memory at {target.memory_efficiency or 1.0:.0%} of its "
        "bandwidth (measured shares, in the datasheet source)"
    )
    return DeviceFigures(
        name=target.name,
        peak_flops={
            "bf16": target.peak_flops_bf16 * mm,
            "f32": f32 * mm,
            "f16": target.peak_flops_bf16 * mm,
        },
        memory_bytes_per_s=hbm,
        cache_bytes=0,
        cache_bytes_per_s=hbm,
        elementwise_per_s=elementwise,
        transcendental_per_s=transcendental,
        launch_s=launch,
        host_link_bytes_per_s=target.host_link_bytes_per_s,
        interconnect_bytes_per_s=target.interconnect_bytes_per_s,
        sm_count=gpu.core_count if gpu is not None else 0,
        node_size=target.node_size,
        network_bytes_per_s=target.network_bytes_per_s,
        attention_flops=(
            {
                "bf16": target.peak_flops_bf16 * target.attention_efficiency,
                "f16": target.peak_flops_bf16 * target.attention_efficiency,
            }
            if target.attention_efficiency
            else None
        ),  # fmt: skip
        source=(
            f"datasheet: {target.source}; {vector_source}; launch {launch * 1e6:.1f} us"
            + launch_note
            + achieved
        ),
    )


def cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_key() -> dict[str, str]:
    """What the local figures depend on: platform, device kind, CPU model, cores, versions."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "cpu_model": cpu_model() or _platform.processor(),
        "cpu_count": str(os.cpu_count()),
        "machine": _platform.machine(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "version": str(CALIBRATION_VERSION),
    }


def _best_of(fn: Callable[[], object], runs: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile + warm
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def measure(runs: int = 5) -> dict[str, float]:
    """Time the micro-kernels on JAX's default device (docs/time-model.md, "Device figures").

    Returns rates per second, ``cache_bytes`` and ``launch_s``.
    """
    out = _measure_matmuls(runs)
    out.update(_measure_memory(runs))
    out["launch_s"] = _measure_launch(runs)
    out["cache_bytes_per_s"] = _measure_cache(runs, out["launch_s"])
    out.update(_measure_vector(runs, out["cache_bytes_per_s"]))
    out["cache_bytes"] = float(_last_level_cache_bytes() or 0)
    return out


def _measure_matmuls(runs: int) -> dict[str, float]:
    """Matmul rates, FLOP/s per dtype: ``peak_flops_*`` from a [1024, 1024] square matmul,
    ``batched_flops_*`` from attention's two batched matmuls (32 heads, 256 tokens, dim 64)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    out: dict[str, float] = {}
    n = 1024
    for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
        a = jax.random.normal(key, (n, n), dtype)
        b = jax.random.normal(key, (n, n), dtype)
        mm = jax.jit(lambda x, y: x @ y)
        out[f"peak_flops_{name}"] = 2 * n**3 / _best_of(lambda mm=mm, a=a, b=b: mm(a, b), runs)
        heads, seq, dim = 32, 256, 64
        q = jax.random.normal(key, (heads, seq, dim), dtype)
        kt = jax.random.normal(key, (heads, dim, seq), dtype)
        p = jax.random.normal(key, (heads, seq, seq), dtype)
        bmm = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y))
        t_scores = _best_of(lambda bmm=bmm, q=q, kt=kt: bmm(q, kt), runs)
        t_context = _best_of(lambda bmm=bmm, p=p, q=q: bmm(p, q), runs)
        out[f"batched_flops_{name}"] = 2 * 2 * heads * seq * seq * dim / (t_scores + t_context)
    return out


def _measure_memory(runs: int) -> dict[str, float]:
    """``memory_bytes_per_s`` (DRAM bytes/s, a 256 MiB update in place) and
    ``fresh_bytes_per_s`` (bytes/s of a fresh output's pages faulted in, beyond that)."""
    import jax
    import jax.numpy as jnp

    nbytes = 256 * 2**20
    state = {"x": jnp.ones((nbytes // 4,), jnp.float32)}
    axpb = jax.jit(lambda x: x * 1.0001 + 0.5)
    # Faulting pages in is the most variable figure on a virtual machine, and a step's faults,
    # spread among its compute, cost what the undisturbed runs cost: the best of FRESH_RUNS,
    # not of two.
    t_fresh = _best_of(lambda: axpb(state["x"]), max(FRESH_RUNS, runs))
    # The same in place (the input donated): no fresh output buffer to fault in.
    inplace = jax.jit(lambda x: x * 1.0001 + 0.5, donate_argnums=0)

    def step():
        state["x"] = inplace(state["x"])
        return state["x"]

    t_inplace = _best_of(step, max(2, runs // 2))
    state.clear()
    return {
        "memory_bytes_per_s": 2 * nbytes / t_inplace,
        # What a fresh 256 MiB output costs beyond the same work in place: faulting its pages in.
        "fresh_bytes_per_s": nbytes / max(t_fresh - t_inplace, 1e-9),
    }


def _measure_launch(runs: int) -> float:
    """Seconds to launch one kernel: a loop of 2,000 iterations of two tiny kernels against
    one iteration."""
    import jax
    import jax.numpy as jnp

    # Launch: a loop whose body is two tiny kernels (an [8, 8] matmul and an add), so each
    # iteration dispatches real kernels (XLA compiles a purely elementwise loop into one).
    def tiny_loop(k):
        def body(i, v):
            return jnp.tanh(v @ v) + 0.5

        return jax.jit(lambda x: jax.lax.fori_loop(0, k, body, x))

    iters = 2000
    tiny = jnp.eye(8, dtype=jnp.float32)
    long_loop, one = tiny_loop(iters), tiny_loop(1)
    t_loop = _best_of(lambda: long_loop(tiny), runs)
    t_one = _best_of(lambda: one(tiny), runs)
    return max((t_loop - t_one) / (iters - 1) / 2, 1e-9)


def _measure_cache(runs: int, launch_s: float) -> float:
    """Cache bandwidth, bytes/s: 1 MiB re-read 200 times (fits any L2/LLC), the loop's
    ``launch_s`` (seconds per kernel) taken out."""
    import jax
    import jax.numpy as jnp

    small = jnp.ones((2**18,), jnp.float32)
    reps = 200
    cached = jax.jit(lambda x: jax.lax.fori_loop(0, reps, lambda i, v: v * 1.0001 + 0.5, x))
    t_small = _best_of(lambda: cached(small), runs)
    per = max(t_small / reps - launch_s, 1e-9)
    return 2 * small.nbytes / per


def _measure_vector(runs: int, cache_bytes_per_s: float) -> dict[str, float]:
    """``elementwise_per_s`` (operations/s: 32 dependent multiply-adds per element of a 4 MiB
    array) and ``transcendental_per_s`` (tanh/s, its bytes' time at ``cache_bytes_per_s``
    taken out)."""
    import jax
    import jax.numpy as jnp

    mid = jnp.ones((2**20,), jnp.float32)  # 4 MiB

    def chain(x):
        for i in range(32):
            x = x * 1.0001 + (0.5 + i)
        return x

    chained, tanh = jax.jit(chain), jax.jit(jnp.tanh)
    t_chain = _best_of(lambda: chained(mid), runs)
    elementwise = 64 * mid.size / t_chain  # mul and add each one operation
    t_tanh = _best_of(lambda: tanh(mid), runs)
    # tanh's own bytes are small beside its arithmetic on a CPU; take the bytes' time out.
    t_tanh_ops = max(t_tanh - 2 * mid.nbytes / cache_bytes_per_s, t_tanh / 4)
    return {"elementwise_per_s": elementwise, "transcendental_per_s": mid.size / t_tanh_ops}


def _last_level_cache_bytes() -> int | None:
    """The largest CPU cache (L3 on most machines), from sysfs; None if unknown."""
    best = None
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        value = int(size.rstrip("KMG")) * mult
        best = max(best or 0, value)
    return best


#: Held while a calibration is read or timed: two timed at once would each see a loaded machine.
_CALIBRATING = threading.Lock()

#: Above this share of the machine's cores taken by other processes while the micro-kernels
#: ran, a calibration is *contended*: its rates are too low and every estimate too high
#: (docs/time-model.md, "Device figures").
CONTENDED_SHARE = 0.25
#: A contended calibration in the cache is timed again when asked for this long after it was
#: last timed (seconds), and the quieter of the two is kept: a busy machine is not re-timed at
#: every ask, a quiet one replaces the figures taken beside other work.
RETIME_AFTER_S = 600.0


def _busy_cpu_s() -> float | None:
    """CPU seconds every process on the machine has spent busy since boot (``/proc/stat``: user,
    nice, system, irq, softirq and steal, the time a hypervisor gave other guests); None where
    there is no ``/proc/stat``."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in first[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_share(fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """``fn()`` and the share of the machine's cores (0 to 1) that other processes kept busy
    while it ran: the busy CPU time of the whole machine (:func:`_busy_cpu_s`) less this
    process's own (``time.process_time``), over the wall time times ``os.cpu_count()``. None
    where the machine's busy time cannot be read."""
    busy0, own0, t0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
    out = fn()
    busy1, own1, wall = _busy_cpu_s(), time.process_time(), time.perf_counter() - t0
    if busy0 is None or busy1 is None or wall <= 0:
        return out, None
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    return out, min(1.0, other / (wall * (os.cpu_count() or 1)))


def calibrate(refresh: bool = False, runs: int = 5) -> DeviceFigures:
    """Figures for JAX's default device, timed here once per machine and cached.

    A calibration timed while other processes kept more than :data:`CONTENDED_SHARE` of the
    cores busy is said so in ``source`` and timed again when asked for :data:`RETIME_AFTER_S`
    later; the quieter of the two is kept.

    Args:
      refresh: time again even when a cached calibration exists.
      runs: timed runs per micro-kernel (the best is kept).

    Returns:
      :class:`DeviceFigures` with ``measured=True``; ``source`` names the machine, the date
      the figures were timed, the share of the cores other processes used meanwhile and the
      load average.
    """
    with _CALIBRATING:  # threads asking at once: one times the machine, the others read it
        return _calibrate(refresh, runs)


def _others_share_of(data: dict[str, Any]) -> float | None:
    """The share of the cores other processes used while ``data``'s figures were timed; where
    it was not read, 1.0 when the load average exceeded the core count (other work certain:
    the calibration's own kernels hold at most every core), else None."""
    share = data.get("others_share")
    if share is not None:
        return float(share)
    load = data.get("load_average")
    cores = int((data.get("key") or {}).get("cpu_count") or os.cpu_count() or 1)
    return 1.0 if load is not None and float(load) > cores else None


def _contended(data: dict[str, Any]) -> bool:
    share = _others_share_of(data)
    return share is not None and share > CONTENDED_SHARE


def _timed_now(key: dict[str, str], runs: int) -> dict[str, Any]:
    figures, share = others_share(lambda: measure(runs))
    now, load = time.time(), os.getloadavg()[0]
    where = "" if share is None else f", other processes {share:.0%} of the cores"
    return {
        "key": key,
        "figures": figures,
        "others_share": share,
        "load_average": round(load, 2),
        "timed_at": now,
        "when": f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(now))}{where}, load "
        f"average {load:.2f}",
    }


def _calibrate(refresh: bool, runs: int) -> DeviceFigures:
    key = machine_key()
    return _figures_of(_calibration_data(key, refresh, runs), key)


@contextlib.contextmanager
def pinned_calibration(path: str | Path) -> Iterator[None]:
    """Within the ``with``, every calibration of this process and of the processes it starts is
    the one in ``path``, so a long run (a sweep) prices all its rows with one set of figures.
    ``path`` is kept when it holds this machine's calibration (a resumed run); otherwise the cached
    calibration (timed now if there is none) is written there. Nothing is pinned when
    :data:`CALIBRATION_ENV` already names a file."""
    if os.environ.get(CALIBRATION_ENV):
        yield
        return
    path = Path(path)
    key = machine_key()
    try:
        kept = json.loads(path.read_text()).get("key") == key
    except (OSError, json.JSONDecodeError, AttributeError):
        kept = False
    if not kept:
        with _CALIBRATING:
            data = _calibration_data(key, False, 5)
        files.write_text(path, json.dumps({**data, "pinned": True}, indent=1))
    os.environ[CALIBRATION_ENV] = str(path)
    try:
        yield
    finally:
        os.environ.pop(CALIBRATION_ENV, None)


def _calibration_data(key: dict[str, str], refresh: bool, runs: int) -> dict[str, Any]:
    """The calibration file's content for this machine: the given one, the cached one, or
    timed now (written to the cache)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "calibration" / f"{digest}.json"
    given = os.environ.get(CALIBRATION_ENV)
    data = None
    if given:  # figures fixed by the user (or the tests): used as they are, never re-timed
        data = json.loads(Path(given).read_text())
        data["key"] = key
        where = (  # a run's own copy (pinned_calibration), or a file the user named
            f"kept for this run in {given}"
            if data.get("pinned")
            else f"read from ${CALIBRATION_ENV}={given}"
        )
        data["when"] = f"{data.get('when', 'unknown date')}, {where}"
    elif path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            data = None
    if not given:
        cached = data if data is not None and data.get("key") == key else None
        if cached is None:  # none, another machine's, or refresh asked
            data = _timed_now(key, runs)
            files.write_text(path, json.dumps(data, indent=1))
        elif _contended(cached) and time.time() - cached.get("timed_at", 0) >= RETIME_AFTER_S:
            new = _timed_now(key, runs)
            share = new["others_share"]
            quieter = share is not None and share < (_others_share_of(cached) or 0.0)
            # no quieter: keep the figures, and wait as long again before the next try
            data = new if quieter else {**cached, "timed_at": new["timed_at"]}
            files.write_text(path, json.dumps(data, indent=1))
    assert data is not None
    return data


def _figures_of(data: dict[str, Any], key: dict[str, str]) -> DeviceFigures:
    f = data["figures"]
    return DeviceFigures(
        name=f"local {key['platform']} ({key['cpu_model'] or key['device_kind']})",
        peak_flops={"f32": f["peak_flops_f32"], "bf16": f["peak_flops_bf16"]},
        batched_flops=(  # absent from a figures file written before version 3
            {"f32": f["batched_flops_f32"], "bf16": f["batched_flops_bf16"]}
            if "batched_flops_f32" in f
            else None
        ),
        memory_bytes_per_s=f["memory_bytes_per_s"],
        cache_bytes=int(f["cache_bytes"]),
        cache_bytes_per_s=f["cache_bytes_per_s"],
        elementwise_per_s=f["elementwise_per_s"],
        transcendental_per_s=f["transcendental_per_s"],
        launch_s=f["launch_s"],
        host_link_bytes_per_s=None,
        interconnect_bytes_per_s=None,
        fresh_bytes_per_s=f["fresh_bytes_per_s"] if key["platform"] == "cpu" else None,
        calibration=Calibration(
            data.get("others_share"), data.get("load_average"), _contended(data)
        ),
        source=(
            f"calibrated on this machine {data['when']} (jax {key['jax']}, {key['cpu_count']} "
            f"cores{'; contended: its rates are low' if _contended(data) else ''}): "
            f"{', '.join(f'{k}={v:.4g}' for k, v in sorted(f.items()))}"
        ),
        measured=True,
    )


def device_figures(target: T.Target) -> DeviceFigures | None:
    """The figures the time model uses for ``target``: the datasheet's for a GPU or TPU model
    compiled deviceless, the calibration's for the local device (a local GPU of a known model too).
    None when neither is available (a CPU target while JAX's default device is not a CPU)."""
    import jax

    if not target.deviceless and target.platform == jax.devices()[0].platform:
        return calibrate()
    return datasheet_figures(target)


def figures_for(target: T.Target) -> DeviceFigures:
    """The device figures to time steps on ``target`` with (datasheet or calibration), or an error.

    Raises:
      ValueError: the target has no figures (no peak FLOP/s or bandwidth, and it is not the
        local device, which would be calibrated).
    """
    figures = device_figures(target)
    if figures is None:
        timed = [T.LOCAL] + [n for n in T.target_names() if datasheet_figures(T.get_target(n))]
        raise ValueError(
            f"target {target.name!r} has no peak FLOP/s or memory bandwidth to time steps "
            f"with (and is not the local device, which is calibrated); pick one of "
            f"{', '.join(timed)}"
        )
    return figures


#: Error of the datasheet (GPU and TPU) estimates between two policies, as a fraction of step
#: time: the largest gap between an estimated and a published overhead of recomputation over
#: the published GPU configurations (docs/results/published.md, ``experiments/
#: bench_published.py``: 43.5 percentage points, full recomputation against none on a
#: tensor-parallel layer, rounded up). A policy that recomputes less is preferred to one
#: estimated faster by less than this.
DATASHEET_ESTIMATE_ERROR = 0.44


def estimate_error(target: T.Target) -> float:
    """The share of step time within which two estimates on ``target`` cannot be told apart
    when one recomputes more: :data:`DATASHEET_ESTIMATE_ERROR` for a GPU or TPU target timed by
    its datasheet, 0 for the calibrated local device (its steps are measured beside the
    estimates by the sweep, and remat measures faster there)."""
    figures = device_figures(target)
    return 0.0 if figures is None or figures.measured else DATASHEET_ESTIMATE_ERROR


#: Below this estimated step time (seconds) on a calibrated CPU, the estimate has been measured
#: furthest off (docs/time-model.md, "Small steps": 10-63% below the measured step).
SMALL_STEP_S = 0.03


def small_step_note(
    step_times_s: Iterable[float | None], measured: bool, timed: bool = False
) -> str | None:
    """A caveat for estimates of small steps on the calibrated local device, or None.

    Args:
      step_times_s: the estimated step times (seconds) a tool shows; None entries are skipped.
      measured: whether the device figures were calibrated on this machine (the local CPU);
        datasheet targets get no caveat: no small GPU or TPU step has been measured yet.
      timed: the estimates stand beside measured steps (the sweep): the caveat points to them
        rather than to the sweep.

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
    """Why no-remat is estimated slower than a policy that recomputes, on a datasheet (GPU or
    TPU) target: a scanned step that keeps its residuals stacks them per layer and reads them back
    (docs/time-model.md, "On GPUs"). ``step_times_s``: estimated seconds by policy label. None where
    no-remat is not among them, is not slower, or the figures are calibrated (``measured``)."""
    mine = step_times_s.get("no-remat")
    others = {k: v for k, v in step_times_s.items() if k != "no-remat" and v}
    if measured or not mine or not others:
        return None
    label, best = min(others.items(), key=lambda kv: kv[1])
    if mine <= best:
        return None
    return (
        f"no-remat is estimated {mine / best - 1:.0%} slower than {label}: the estimate charges "
        "a scanned step that keeps its residuals the copies that stack them per layer "
        "(dynamic-update-slice), read them back (dynamic-slice), transpose and zero-fill the "
        "stacks; recomputation avoids them. No measurement of remat-kit's on a GPU or TPU "
        "confirms this yet (docs/time-model.md): time both before trusting the order"
    )


def time_model_note(target: T.Target) -> str:
    """The note every recommendation carries about the time model and its limits."""
    figures = device_figures(target)
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
