"""The kernels one compiled step runs, counted from XLA's optimized HLO
(:mod:`remat_kit.memory.hlo`): per kernel its matmul FLOPs and dtype, elementwise and
transcendental operations, the bytes read and written at its boundary, host transfers and
collectives (``while`` bodies ``known_trip_count`` times). The roofline
(:mod:`remat_kit.memory.roofline`) times them; docs/time-model.md says what each rule counts.
"""

from __future__ import annotations

import dataclasses
import math
import re

from remat_kit.memory import hlo

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
        (:func:`hlo.is_batched_matmul`), timed at the batched rate of
        :meth:`~remat_kit.memory.calibration.DeviceFigures.matmul_peak`.
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
