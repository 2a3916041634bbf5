"""Reading XLA's own reports of one compile: the optimized HLO, its live ranges, its FLOPs.

Parses the text files ``xla_dump_to`` writes (``*after_optimizations.txt``, its
``-live-range.txt``, ``*buffer-assignment.txt``, ``*memory-usage-report.txt``); no JAX calls.
Matmul FLOPs are counted here, times every enclosing loop's trip count
(:func:`instruction_flops`), because ``compiled.cost_analysis()`` counts a ``while`` body once
and is ``None`` for deviceless GPU executables.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path

#: Bytes per element of XLA primitive types (``pred`` is stored as one byte).
_ITEMSIZE = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_INDEX_COMMENT = re.compile(r"^/\*[^*]*\*/")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_LIVE_LINE = re.compile(r"^\s+([\w.\-]+)(\{[0-9,]*\}): (\d+) bytes")
#: XLA's memory space for pinned host memory (``S(5)`` in layouts, ``@5`` on values).
HOST_MEMORY_SPACE = 5

_ALLOCATION_LINE = re.compile(r"^allocation (\d+): size (\d+)")
_VALUE_LINE = re.compile(
    r"^ value: <\d+ ([\w.\-]+)(\{[0-9,]*\})?(?: \(\w+\))? @(\d+)> "
    r"\(size=(\d+),offset=(\d+)\): (.*)$"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_BATCH = re.compile(r"lhs_batch_dims=\{([0-9,]*)\}")
_GEMM_BATCH = re.compile(r'"lhs_batch_dimensions":\[([^\]]*)\]')
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLS_SET = re.compile(r"\bcalls=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``%name = shape opcode(operands), attributes``."""

    name: str
    shape: str  # "bf16[8192,4096]{1,0}" or a tuple "(s32[], f32[2,4])"
    opcode: str
    operands: tuple[str, ...]
    attributes: str  # everything after the operand list
    op_name: str  # JAX's op_name metadata ("jit(step)/.../attn/query/dot_general"), or ""


@dataclasses.dataclass(frozen=True)
class Computation:
    """One HLO computation of a module dump: its instructions and parameter shapes."""

    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]
    param_shapes: dict[str, str]  # from the header "(param_0: f32[2,3], ...)"


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """A value live at the peak of XLA's schedule (from the live-range dump)."""

    value: str  # HLO value: instruction name plus tuple index, e.g. "while.24{3}"
    nbytes: int


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(dtype, dims), ...]`` of every array in an HLO shape string (one for an array shape,
    one per element for a tuple)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def shape_bytes(dtype: str, dims: Iterable[int]) -> int:
    """Bytes of a dense array of XLA type ``dtype`` (``"bf16"``) and dimensions ``dims``."""
    return math.prod(dims) * _ITEMSIZE.get(dtype, 4)


def tuple_element(operand: str) -> tuple[str, int | None]:
    """``("while.3", 2)`` for the operand ``while.3#2`` (newer XLA's tuple element);
    ``(operand, None)`` for a plain operand."""
    name, sep, index = operand.rpartition("#")
    return (name, int(index)) if sep and index.isdigit() else (operand, None)


class Shapes(dict):
    """Instruction name -> HLO shape, ``name#k`` (:func:`tuple_element`) included."""

    def __missing__(self, key: str) -> str:
        name, index = tuple_element(key)
        if index is None or name not in self:
            raise KeyError(key)
        shape = dict.__getitem__(self, name).strip()
        elements = _split_top_level(shape[1:-1]) if shape.startswith("(") else []
        if index >= len(elements):
            raise KeyError(key)
        return elements[index]

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _matching(text: str, open_index: int) -> int:
    """Index of the bracket closing the one at ``open_index``."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):  # tuple shape
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = _matching(rest, paren)
    operands = tuple(  # "/*index=5*/%copy.3" (XLA numbers every fifth operand): "copy.3"
        _INDEX_COMMENT.sub("", op.split()[-1]).lstrip("%")
        for op in _split_top_level(rest[paren + 1 : close])
        if op
    )
    attributes = rest[close + 1 :]
    op_name = _OP_NAME.search(attributes)
    return Instruction(
        name=name,
        shape=shape,
        opcode=opcode,
        operands=operands,
        attributes=attributes,
        op_name=op_name.group(1).replace("\\'", "'") if op_name else "",
    )


def _open_braces(line: str) -> int:
    """``{`` less ``}`` in ``line`` outside double-quoted strings (a Pallas kernel's
    ``kernel_metadata`` frontend attribute holds JSON over several lines)."""
    if line.count("{") == line.count("}"):
        return 0
    depth, quoted, escaped = 0, False, False
    for ch in line:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif not quoted:
            depth += (ch == "{") - (ch == "}")
    return depth


def _logical_lines(text: str) -> Iterator[str]:
    """The lines of an HLO text module, an instruction whose attributes span several lines
    (unbalanced braces outside strings) joined into one."""
    pending, depth = [], 0
    for line in text.splitlines():
        if pending:
            pending.append(line)
            depth += _open_braces(line)
            if depth <= 0:
                yield " ".join(pending)
                pending, depth = [], 0
            continue
        opened = _open_braces(line)
        if opened > 0 and not _HEADER.match(line):  # a header's brace opens its computation
            pending, depth = [line], opened
            continue
        yield line
    if pending:
        yield " ".join(pending)


def parse_hlo_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO text module (as XLA dumps it), by name."""
    comps: dict[str, Computation] = {}
    current = None
    for line in _logical_lines(text):
        if current is None:
            m = _HEADER.match(line)
            if m:
                params = {}
                for part in _split_top_level(m.group(3)):
                    pname, _, pshape = part.partition(": ")
                    params[pname.strip().lstrip("%")] = pshape.strip()
                current = (m.group(2), bool(m.group(1)), [], params)
            continue
        if line.startswith("}"):
            name, is_entry, instrs, params = current
            comps[name] = Computation(name, is_entry, tuple(instrs), params)
            current = None
            continue
        instr = _parse_instruction(line)
        if instr is not None:
            current[2].append(instr)
    return comps


def _dot_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    """``2 * prod(output) * prod(lhs contracting dims)`` of a dot or a gemm custom call."""
    out = array_shapes(instr.shape)
    if not out or not instr.operands:
        return 0.0
    lhs = array_shapes(shapes.get(instr.operands[0], ""))
    if not lhs:
        return 0.0
    if instr.opcode == "dot":
        m = _CONTRACTING.search(instr.attributes)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
    else:
        m = _GEMM_CONTRACTING.search(instr.attributes)
        dims = [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()] if m else []
    lhs_dims = lhs[0][1]
    contracted = math.prod(lhs_dims[d] for d in dims if d < len(lhs_dims))
    return 2.0 * math.prod(out[0][1]) * contracted


_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_DIM_LABELS = re.compile(r"dim_labels=[0-9a-z]+_([0-9a-z]+)->")
_BACKEND_CONFIG = "backend_config="
#: Matmul FLOPs of a fused attention's backward pass over its forward (FlashAttention-2, Dao
#: 2023, arXiv:2307.08691: five matmuls against two).
FMHA_BACKWARD_FACTOR = 2.5


def _call_target(instr: Instruction) -> str:
    m = _CALL_TARGET.search(instr.attributes) if instr.opcode == "custom-call" else None
    return m.group(1) if m else ""


def _conv_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    """``2 * prod(output) * prod(kernel) / kernel_output_features`` of the forward convolution an
    instruction computes or differentiates (layout from ``dim_labels``). cuDNN backward calls
    carry the forward's labels: ``convBackwardFilter``'s forward output is operand 1 and kernel
    the result, ``convBackwardInput``'s forward output operand 0; each costs the forward."""
    result = array_shapes(instr.shape)
    labels = _DIM_LABELS.search(instr.attributes)
    if not result or len(instr.operands) < 2 or not labels:
        return 0.0
    operand = [array_shapes(shapes.get(instr.operands[i], "")) for i in (0, 1)]
    target = _call_target(instr)
    if "BackwardFilter" in target:
        out, kernel = operand[1], result
    elif "BackwardInput" in target:
        out, kernel = operand[0], operand[1]
    else:
        out, kernel = result, operand[1]
    o = labels.group(1).find("o")
    if not out or not kernel or o < 0 or o >= len(kernel[0][1]):
        return 0.0
    k = kernel[0][1]
    flops = 2.0 * math.prod(out[0][1]) * math.prod(k) / max(k[o], 1)
    # the window's padding share is read against the forward input (operand 0 but for the
    # backward-input call, whose operand 0 is the output gradient)
    return flops * (1.0 if "BackwardInput" in target else _padding_share(instr, shapes))


_WINDOW = re.compile(r"window=\{([^}]*)\}")
_FULL_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")


def _padding_share(instr: Instruction, shapes: dict[str, str]) -> float:
    """The share of a convolution's (output position, window tap) pairs that multiply input
    values, not padding or the holes of a dilated input.

    XLA:TPU writes some dots as convolutions over a padded size-1 dimension
    (``window={size=1x4 pad=0_0x3_3}``: a quarter of ``output x kernel``) or a dilated one
    (``lhs_dilate=2x1``); only such dimensions are corrected. 1.0 otherwise (``rhs_dilate`` is
    not corrected)."""
    window = _WINDOW.search(instr.attributes)
    labels = _FULL_LABELS.search(instr.attributes)
    if not window or not labels:
        return 1.0
    fields = dict(f.split("=", 1) for f in window.group(1).split() if "=" in f)
    if "rhs_dilate" in fields or not ({"pad", "lhs_dilate"} & set(fields)):
        return 1.0
    sizes = [int(x) for x in fields.get("size", "").split("x") if x]
    ndim = len(sizes)

    def per_dim(key: str, default: int) -> list[int]:
        return [int(v) for v in fields[key].split("x")] if key in fields else [default] * ndim

    pads = (
        [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")]
        if "pad" in fields
        else [(0, 0)] * ndim
    )
    strides, dilations = per_dim("stride", 1), per_dim("lhs_dilate", 1)
    lhs = array_shapes(shapes.get(instr.operands[0], ""))
    if not lhs or not (len(pads) == len(strides) == len(dilations) == ndim):
        return 1.0
    share = 1.0
    for d in range(ndim):
        w, (lo, hi), st, dl = sizes[d], pads[d], strides[d], dilations[d]
        pos = labels.group(1).find(str(d))
        if pos < 0 or pos >= len(lhs[0][1]):
            return 1.0
        n = lhs[0][1][pos]
        if dl == 1 and n >= w:
            continue
        span = (n - 1) * dl + 1  # the dilated input
        out_len = (span + lo + hi - w) // st + 1
        if out_len <= 0:
            return 1.0
        valid = sum(
            1
            for o in range(out_len)
            for t in range(w)
            if 0 <= o * st + t - lo < span and (o * st + t - lo) % dl == 0
        )
        share *= valid / (out_len * w)
    return share


@functools.lru_cache(maxsize=4096)
def _json_object(text: str) -> dict:
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def backend_config(instr: Instruction) -> dict:
    """An instruction's ``backend_config={...}`` parsed as JSON (``{}`` if absent or not JSON;
    XLA's writers differ in key order and spacing)."""
    at = instr.attributes.find(_BACKEND_CONFIG)
    if at < 0:
        return {}
    return _json_object(instr.attributes[at + len(_BACKEND_CONFIG) :])


def _fmha_flops(instr: Instruction) -> float:
    """A cuDNN fused attention call (``__cudnn$fmha*``): ``4 * prod(output) * kv_len``
    (``Q K^T`` and ``P V``; scores [batch, heads, q_len, kv_len]), halved if causal, times
    :data:`FMHA_BACKWARD_FACTOR` for a backward call."""
    config = backend_config(instr).get("cudnn_fmha_backend_config", {})
    scores = config.get("intermediate_tensor_shape", {}).get("dimensions", [])
    out = array_shapes(instr.shape)
    if not scores or not out:
        return 0.0
    kv_len = int(scores[-1])
    flops = 4.0 * math.prod(out[0][1]) * kv_len
    if str(config.get("mask_type", "")).endswith("CAUSAL"):
        flops /= 2
    if "Backward" in _call_target(instr):
        flops *= FMHA_BACKWARD_FACTOR
    return flops


_COST_ESTIMATE = re.compile(r'cost_estimate\\?"\s*:\s*\{([^}]*)\}')
_FLOPS_FIELD = re.compile(r'flops\\?"\s*:\s*\\?"?(\d+)')


def _kernel_cost_flops(instr: Instruction) -> float | None:
    """The FLOPs a Mosaic kernel's author estimated (``pl.CostEstimate``, which JAX writes into
    the ``tpu_custom_call``'s backend config: JAX's flash attention forward, a user's Pallas
    kernel, libtpu's ragged dot), or None where it carries none (:func:`uncounted_kernels`)."""
    block = _COST_ESTIMATE.search(instr.attributes)  # its keys in either order
    m = _FLOPS_FIELD.search(block.group(1)) if block else None
    return float(m.group(1)) if m else None


def uncounted_kernels(comps: dict[str, Computation]) -> list[str]:
    """The TPU kernel calls (``tpu_custom_call``, a Pallas/Mosaic kernel) whose FLOPs
    :func:`instruction_flops` cannot read: no cost estimate, and a floating-point output (an
    integer-only kernel, such as the ragged dot's group metadata, does no matmul). JAX's flash
    attention backward kernels and splash attention carry none. Their instruction names (XLA
    names a kernel call after its kernel function), each once."""
    out: dict[str, None] = {}
    for comp in comps.values():
        for instr in comp.instructions:
            target = _call_target(instr)
            if target != "tpu_custom_call" or _kernel_cost_flops(instr) is not None:
                continue
            if all(dtype[0] in "su" or dtype == "pred" for dtype, _ in array_shapes(instr.shape)):
                continue  # integer outputs only: bookkeeping, no matmul
            out[re.sub(r"\.\d+$", "", instr.name.lstrip("%"))] = None  # named after the kernel
    return list(out)


def instruction_flops(instr: Instruction, shapes: dict[str, str]) -> float:
    """FLOPs of one instruction: dots and gemm calls, convolutions (and cuDNN convolution
    calls), cuDNN fused attention calls, a TPU's Mosaic kernels (their cost estimate: libtpu's
    ragged dot, a Pallas kernel's ``pl.CostEstimate``); 0 for anything else."""
    if instr.opcode == "dot" or _is_gemm_call(instr):
        return _dot_flops(instr, shapes)
    target = _call_target(instr)
    if instr.opcode == "convolution" or target.startswith("__cudnn$conv"):
        return _conv_flops(instr, shapes)
    if target.startswith("__cudnn$fmha"):
        return _fmha_flops(instr)
    if target == "tpu_custom_call" and (flops := _kernel_cost_flops(instr)) is not None:
        return flops
    return 0.0


def is_batched_matmul(instr: Instruction) -> bool:
    """Whether a dot or gemm call has batch dimensions (attention's ``Q @ K^T`` over
    [batch, heads, seq, head_dim])."""
    if instr.opcode == "dot":
        m = _BATCH.search(instr.attributes)
    elif _is_gemm_call(instr):
        m = _GEMM_BATCH.search(instr.attributes)
    else:
        return False
    return bool(m and m.group(1).strip())


def gemm_dims(instr: Instruction) -> tuple[int, int, int] | None:
    """``(batch, m, n)`` of a dot or gemm call's output (batch dims first, n the last), else
    None; for :func:`remat_kit.memory.roofline.gemm_efficiency`."""
    if instr.opcode != "dot" and not _is_gemm_call(instr):
        return None
    out = array_shapes(instr.shape)
    if not out or not out[0][1]:
        return None
    dims = out[0][1]
    m = _BATCH.search(instr.attributes) if instr.opcode == "dot" else (
        _GEMM_BATCH.search(instr.attributes))  # fmt: skip
    nb = len([d for d in m.group(1).split(",") if d.strip()]) if m else 0
    nb = min(nb, max(len(dims) - 1, 0))
    rest = dims[nb:]
    return math.prod(dims[:nb]), math.prod(rest[:-1]), rest[-1]


def _is_gemm_call(instr: Instruction) -> bool:
    if instr.opcode != "custom-call":
        return False
    target = re.search(r'custom_call_target="([^"]*)"', instr.attributes)
    return bool(target) and any(k in target.group(1) for k in ("gemm", "matmul"))


#: JAX's name-stack scope of the forward ops a remat re-runs in the backward pass
#: (``jax/_src/ad_checkpoint.py``); XLA keeps it in each instruction's ``op_name``.
JAX_RECOMPUTE_SCOPE = "rematted_computation"


def is_xla_remat(name: str) -> bool:
    """Whether an instruction is a clone made by XLA's rematerialisation pass (``fusion.3.remat``,
    ``dot.5.remat2``)."""
    return bool(re.search(r"\.remat\d*(\.|$)", name))


def _remat_origin(name: str) -> str:
    """The instruction an XLA remat clone was made from: ``fusion.3.remat2`` -> ``fusion.3``."""
    return re.sub(r"\.remat\d*(\..*)?$", "", name)


def _remat_order(name: str) -> tuple[int, str]:
    """The original first, then its clones in the order XLA's pass numbered them."""
    found = re.search(r"\.remat(\d*)(\..*)?$", name)
    return (0, name) if found is None else (int(found.group(1) or 1), name)


#: Opcodes that move or name data rather than compute (not counted as recomputation).
BOOKKEEPING_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "copy-start",
    "copy-done", "opt-barrier",
})  # fmt: skip


def count_recomputed_ops(comps: dict[str, Computation]) -> int:
    """Instructions under :data:`JAX_RECOMPUTE_SCOPE`, :data:`BOOKKEEPING_OPCODES` excluded (0:
    nothing recomputed, or CSE merged it back)."""
    return sum(
        1
        for comp in comps.values()
        for instr in comp.instructions
        if JAX_RECOMPUTE_SCOPE in instr.op_name and instr.opcode not in BOOKKEEPING_OPCODES
    )


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """Matmul FLOPs of a compiled module, with loop trip counts applied.

    Attributes:
      flops: every dot and gemm call, times its loops' trip counts.
      unknown_trip_counts: while loops counted once for want of a known trip count.
      recomputed_flops: dots under :data:`JAX_RECOMPUTE_SCOPE` or in XLA remat clones.
      xla_remat_flops: what XLA's pass added: all but one of each original and its clones
        (``fusion.3``, ``fusion.3.remat``); ``flops - xla_remat_flops`` is the policy's own.
    """

    flops: float
    unknown_trip_counts: int
    recomputed_flops: float = 0.0
    xla_remat_flops: float = 0.0


def _scalar_constant(name: str, by_name: dict[str, Instruction]) -> int | None:
    """The integer value of ``name`` when it is a scalar constant, through copies and bitcasts."""
    for _ in range(8):
        instr = by_name.get(name)
        if instr is None:
            return None
        if instr.opcode == "constant":
            value = instr.operands[0] if instr.operands else ""
            return int(value) if re.fullmatch(r"-?\d+", value) else None
        if instr.opcode not in ("copy", "bitcast", "convert") or len(instr.operands) != 1:
            return None
        name = instr.operands[0]
    return None


def inferred_trip_count(
    loop: Instruction, comp: Computation, comps: dict[str, Computation]
) -> int | None:
    """Trip count of a ``while`` without ``known_trip_count`` (XLA's TPU compiler writes none),
    from its condition ``ROOT compare(get-tuple-element(param), index=0), constant(N)),
    direction=LT`` (``compare(param#0, constant(N))`` in newer XLA's text) and the counter's
    initial constant ``c`` in the loop's init tuple: ``N - c`` (the TPU compiler peels a first
    iteration out of the loop and starts the counter at 1: the peeled copy's dots are counted
    where they are). None when the loop is not of that form."""
    cond = re.search(r"\bcondition=%([\w.\-]+)", loop.attributes)
    cond_comp = comps.get(cond.group(1)) if cond else None
    if cond_comp is None or not cond_comp.instructions or len(loop.operands) != 1:
        return None
    in_cond = {i.name: i for i in cond_comp.instructions}
    root = cond_comp.instructions[-1]
    if root.opcode != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
        return None
    k = tuple_element(root.operands[0])[1]  # the counter written as ``param#k``
    if k is None:  # or as a get-tuple-element(param), index=k
        counter = in_cond.get(root.operands[0])
        if counter is None or counter.opcode != "get-tuple-element":
            return None
        index = re.search(r"\bindex=(\d+)", counter.attributes)
        k = int(index.group(1)) if index else None
    limit = _scalar_constant(root.operands[1], in_cond)
    in_comp = {i.name: i for i in comp.instructions}
    init = in_comp.get(loop.operands[0])
    if k is None or limit is None or init is None or init.opcode != "tuple":
        return None
    start = _scalar_constant(init.operands[k], in_comp) if k < len(init.operands) else None
    return None if start is None or limit < start else limit - start


_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")


def _padded_share(
    name: str,
    comp: Computation,
    by_name: Mapping[str, Instruction],
    comps: Mapping[str, Computation],
) -> float:
    """Elements before / after the ``pad`` XLA added that made value ``name`` of ``comp``
    (through bitcasts, or a fusion whose root is a pad); 1.0 for any other value, and for the
    program's own pads (those with a JAX ``op_name``: ``jnp.pad``, a transpose rule's, counted
    in the jaxpr as padded too). ``by_name``: the instructions of ``comp`` by name."""
    instr = by_name.get(name)
    while instr is not None and instr.opcode == "bitcast" and instr.operands:
        instr = by_name.get(instr.operands[0])
    if instr is None:
        return 1.0
    home = comp
    if instr.opcode == "fusion" and (callee := _CALLS.search(instr.attributes)):
        inner = comps.get(callee.group(1))
        pads = [i for i in inner.instructions if i.opcode == "pad"] if inner else []
        if not pads or pads[-1].shape != instr.shape:  # the fusion's value is the pad's
            return 1.0
        instr, home = pads[-1], inner
    if instr.opcode != "pad" or not instr.operands or instr.op_name:
        return 1.0
    source = (by_name if home is comp else {i.name: i for i in home.instructions}).get(
        instr.operands[0]
    )
    before = array_shapes(source.shape if source else home.param_shapes.get(instr.operands[0], ""))
    after = array_shapes(instr.shape)
    if not before or not after:
        return 1.0
    return math.prod(before[0][1]) / max(math.prod(after[0][1]), 1)


def padding_share(
    instr: Instruction,
    comp: Computation,
    by_name: Mapping[str, Instruction],
    comps: Mapping[str, Computation],
) -> float:
    """The share of a call's matmul FLOPs that multiply the program's values, not the zeros
    XLA padded its operands with (its GPU split-K rewrite pads the contracting dimension of
    both operands of a weight gradient to a multiple of the split; tensor-core alignment
    pads others): one padded share where every padded operand has the same (a shared
    contracting dimension), their product otherwise; 1.0 with no padded operand."""
    shares = {_padded_share(op, comp, by_name, comps) for op in instr.operands} - {1.0}
    if len(shares) <= 1:
        return min(shares, default=1.0)
    return math.prod(shares)


def count_flops(comps: dict[str, Computation]) -> FlopCount:
    """Matmul FLOPs (:func:`instruction_flops`) of the entry computation times enclosing
    ``known_trip_count``; a conditional's costliest branch; elementwise ops not counted."""
    unknown = [0]
    nothing = (0.0, 0.0, 0.0)
    # Of an original and its clones one member is the program's own work (FlopCount).
    own: dict[str, str] = {}
    for name in sorted((i.name for c in comps.values() for i in c.instructions), key=_remat_order):
        own.setdefault(_remat_origin(name), name)

    def added_by_xla(instr: Instruction) -> bool:
        return is_xla_remat(instr.name) and own.get(_remat_origin(instr.name)) != instr.name

    @cache
    def flops_of(name: str) -> tuple[float, float, float]:  # (all, recomputed, XLA's clones)
        comp = comps.get(name)
        if comp is None:
            return nothing
        shapes = Shapes(comp.param_shapes)
        by_name = {i.name: i for i in comp.instructions}
        total = rec = xla = 0.0

        def add(f: tuple[float, float, float], instr: Instruction) -> None:
            nonlocal total, rec, xla
            total += f[0]
            # Everything inside an XLA remat clone (a cloned fusion's dots) is recomputation.
            rec += f[0] if is_xla_remat(instr.name) else f[1]
            xla += f[0] if added_by_xla(instr) else f[2]

        for instr in comp.instructions:
            shapes[instr.name] = instr.shape
            f = instruction_flops(instr, shapes)
            if f:  # a dot or gemm call whose operands XLA padded in this computation
                f *= padding_share(instr, comp, by_name, comps)
                add((f, f if JAX_RECOMPUTE_SCOPE in instr.op_name else 0.0, 0.0), instr)
            if instr.opcode == "while":
                body = re.search(r"\bbody=%([\w.\-]+)", instr.attributes)
                trip = _TRIP_COUNT.search(instr.attributes)
                n = int(trip.group(1)) if trip else inferred_trip_count(instr, comp, comps)
                if n is None:
                    unknown[0] += 1
                    n = 1
                add(tuple(n * x for x in (flops_of(body.group(1)) if body else nothing)), instr)
                continue
            branches = _BRANCHES.search(instr.attributes)
            if branches:
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                add(max((flops_of(b) for b in names if b), default=nothing), instr)
                continue
            callees = [c for kind, c in _CALLEE.findall(instr.attributes) if kind != "condition"]
            calls_set = _CALLS_SET.search(instr.attributes)
            if calls_set:
                callees += [c.strip().lstrip("%") for c in calls_set.group(1).split(",")]
            counts = [flops_of(c) for c in callees]
            if instr.opcode == "conditional":
                add(max(counts, default=nothing), instr)
            else:
                scale = padding_share(instr, comp, by_name, comps) if counts else 1.0
                add(tuple(scale * sum(c[k] for c in counts) for k in range(3)), instr)
        return total, rec, xla

    entry = next((c.name for c in comps.values() if c.is_entry), None)
    total, rec, xla = flops_of(entry) if entry else nothing
    return FlopCount(
        flops=total, unknown_trip_counts=unknown[0], recomputed_flops=rec, xla_remat_flops=xla
    )


def op_name_of(instr: Instruction, comps: Mapping[str, Computation]) -> str:
    """The JAX ``op_name`` of ``instr``; for one XLA left without it (a fusion), the most
    specific one (deepest module path) of the instructions in the computation it calls;
    ``""`` when none has one."""
    if instr.op_name:
        return instr.op_name
    callee = _CALLS.search(instr.attributes)
    if callee and callee.group(1) in comps:
        names = [i.op_name for i in comps[callee.group(1)].instructions if i.op_name]
        if names:
            return max(reversed(names), key=lambda n: n.count("/"))
    return ""


def instructions_by_name(
    comps: dict[str, Computation],
) -> dict[str, tuple[Instruction, Computation]]:
    """Every instruction of the module by its (module-unique) name, with its computation."""
    return {i.name: (i, c) for c in comps.values() for i in c.instructions}


def argument_category(op: str) -> str:
    """What an entry argument holds, from its JAX ``op_name`` (the argument's path in the step's
    signature): ``params`` / ``opt_state`` for a train state's fields, else the path's root
    (``batch``, ``tokens``), or ``argument`` when JAX named none."""
    root = re.split(r"[.\[]", op, maxsplit=1)[0] if op else "argument"
    if root == "state":
        return "params" if op.startswith("state.params") else "opt_state"
    return root or "argument"


def entry_argument(
    instr: Instruction, comp: Computation, instrs: Mapping[str, tuple[Instruction, Computation]]
) -> Instruction | None:
    """The entry parameter whose value ``instr`` (of ``comp``) holds whole: the parameter itself,
    or a ``copy`` of it in the entry computation, through bitcasts (XLA copies a donated
    argument aside when the output aliasing its buffer is written before the argument's last
    use: the copy holds the argument, optimizer moments included, whatever parameter's shape
    it shares); None for any other value.

    Args:
      instrs: :func:`instructions_by_name` of the module.
    """
    if not comp.is_entry:
        return None
    if instr.opcode == "copy" and len(instr.operands) == 1:
        source = instrs.get(instr.operands[0])
        while source is not None and source[0].opcode == "bitcast" and source[0].operands:
            source = instrs.get(source[0].operands[0])
        if source is None:
            return None
        instr, comp = source
    return instr if instr.opcode == "parameter" and comp.is_entry else None


def parse_live_at_peak(text: str) -> list[LiveBuffer]:
    """The values listed under "Live ranges at N (peak):" in a ``*-live-range.txt`` dump."""
    out: list[LiveBuffer] = []
    inside = False
    for line in text.splitlines():
        if "Live ranges at" in line and "(peak)" in line:
            inside = True
            continue
        if inside:
            m = _LIVE_LINE.match(line)
            if not m:
                break
            index = m.group(2)
            value = m.group(1) + ("" if index == "{}" else index)
            out.append(LiveBuffer(value=value, nbytes=int(m.group(3))))
    return out


@dataclasses.dataclass(frozen=True)
class BufferSlot:
    """Where buffer assignment put one HLO value: allocation, offset and size in bytes, and its
    memory space (0 device; XLA's host memory space, 5, for offloaded values)."""

    shape: str
    allocation: int
    offset: int
    nbytes: int
    memory_space: int = 0

    @property
    def on_host(self) -> bool:
        return self.memory_space == HOST_MEMORY_SPACE


def parse_buffer_slots(text: str) -> dict[str, BufferSlot]:
    """HLO value name ("fusion.3" or "while.2{1}") -> its :class:`BufferSlot`, from a
    ``*buffer-assignment.txt`` dump. Values that alias one another (a loop's carried value,
    the loop body's parameter, the in-place update) share a slot."""
    out = {}
    allocation = -1
    for line in text.splitlines():
        alloc = _ALLOCATION_LINE.match(line)
        if alloc:
            allocation = int(alloc.group(1))
            continue
        m = _VALUE_LINE.match(line)
        if m:
            index = m.group(2) or ""
            name = m.group(1) + ("" if index == "{}" else index)
            out[name] = BufferSlot(
                shape=m.group(6).strip(),
                allocation=allocation,
                offset=int(m.group(5)),
                nbytes=int(m.group(4)),
                memory_space=int(m.group(3)),
            )
    return out


def parse_allocation_sizes(text: str) -> dict[int, int]:
    """Allocation number -> its size in bytes, from a ``*buffer-assignment.txt`` dump."""
    return {
        int(m.group(1)): int(m.group(2))
        for m in map(_ALLOCATION_LINE.match, text.splitlines())
        if m
    }


_RANGE_LINE = re.compile(r"^\s+([\w.\-]+)(\{[0-9,]*\}):(\d+)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class LiveRanges:
    """XLA's ``HloLiveRange`` dump: the flattened schedule and each value's ``[start, end]``."""

    sequence: tuple[str, ...]  # instruction names, by schedule position
    ranges: dict[str, tuple[int, int]]  # value ("while.2{1}", "fusion.3") -> [start, end]


def parse_live_ranges(text: str) -> LiveRanges:
    """The ``InstructionSequence`` and ``BufferLiveRange`` sections of a ``*-live-range.txt``."""
    sequence: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped in ("InstructionSequence:", "BufferLiveRange:"):
            section = stripped
            continue
        if stripped.startswith("Live ranges at"):
            break
        if section == "InstructionSequence:":
            sequence.append(stripped.partition(":")[2])
        elif section == "BufferLiveRange:":
            m = _RANGE_LINE.match(line)
            if m:
                name = m.group(1) + ("" if m.group(2) == "{}" else m.group(2))
                ranges[name] = (int(m.group(3)), int(m.group(4)))
    return LiveRanges(tuple(sequence), ranges)


@dataclasses.dataclass(frozen=True)
class DumpFiles:
    """The text files XLA wrote for one compiled module (``None`` where missing), each parsed
    once, when first read, into what every reader takes (:attr:`module`, :attr:`slots`,
    :attr:`live_ranges`)."""

    hlo: str | None
    live_range: str | None
    buffer_assignment: str | None
    memory_usage_report: str | None

    @functools.cached_property
    def module(self) -> dict[str, Computation]:
        """The optimized HLO module (:func:`parse_hlo_module`; empty without the dump)."""
        return parse_hlo_module(self.hlo) if self.hlo else {}

    @functools.cached_property
    def slots(self) -> dict[str, BufferSlot]:
        """The buffer assignment's slots (:func:`parse_buffer_slots`)."""
        return parse_buffer_slots(self.buffer_assignment or "")

    @functools.cached_property
    def live_ranges(self) -> LiveRanges:
        """The live-range dump (:func:`parse_live_ranges`; empty without it)."""
        return parse_live_ranges(self.live_range or "")

    @functools.cached_property
    def flop_count(self) -> FlopCount:
        """The module's FLOPs (:func:`count_flops` of :attr:`module`)."""
        return count_flops(self.module)


def read_dump(directory: str | Path) -> DumpFiles:
    """The optimized-HLO, live-range and buffer-assignment dumps of the largest module in
    ``directory`` (the step itself; JAX may compile small helper modules alongside)."""
    directory = Path(directory)
    hlo_files = list(directory.glob("*after_optimizations.txt"))
    if not hlo_files:
        return DumpFiles(None, None, None, None)
    main = max(hlo_files, key=lambda p: p.stat().st_size)
    stem = main.name[: -len(".txt")]

    def sibling(suffix: str) -> str | None:
        path = directory / f"{stem}-{suffix}.txt"
        return path.read_text() if path.exists() else None

    return DumpFiles(
        hlo=main.read_text(),
        live_range=sibling("live-range"),
        buffer_assignment=sibling("buffer-assignment"),
        memory_usage_report=sibling("memory-usage-report"),
    )
