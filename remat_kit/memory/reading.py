"""Turning one compile's XLA output into report pieces: the ``memory_analysis()`` parts, the
buffers live at the peak named by what produced them, matmul FLOPs, and the warnings worth
showing."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from remat_kit import names as N
from remat_kit.memory import hlo
from remat_kit.memory.report import PeakBuffer
from remat_kit.memory.timeline import live_at_peak
from remat_kit.memory.xla_compile import CompileResult, user_dump_flags

#: Flax module names -> the checkpoint name of their output. The bundled model names each
#: projection's module after its tag; these are the plain names other models use.
_MODULE_TAGS = {
    **{tag: tag for tag in N.CHECKPOINT_NAMES},
    "query": N.QUERY_PROJ,
    "key": N.KEY_PROJ,
    "value": N.VALUE_PROJ,
    "out": N.OUT_PROJ,
    "wi": N.MLPWI,
    "wi_0": N.MLPWI_0,
    "wi_1": N.MLPWI_1,
    "wo": N.MLPWO,
}
_NORMS = ("attn_norm", "mlp_norm", "final_norm")
#: Warnings from XLA's log worth showing a user (absl source file, message pattern).
_SURFACED = re.compile(
    r"rematerializ|memory|offload|host|exceed|spill|too large|buffer", re.IGNORECASE
)

_XLA_DTYPES = {
    "float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int32": "s32",
    "int64": "s64", "int8": "s8", "uint8": "u8", "bool": "pred",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Hints:
    """What a model job knows that lets buffers at the peak be named."""

    logits_elems: int | None = None
    #: "bf16[32,1,8192,4096]" (stacked over remat segments) -> the tags of that shape.
    stacked: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: "bf16[32,4096,14336]" -> True for parameter shapes (gradients and copies share them).
    param_shapes: frozenset[str] = frozenset()


def xla_shape(dtype: str, dims: Sequence[int]) -> str:
    """XLA's text for an array shape: ``xla_shape("bfloat16", (2, 3)) == "bf16[2,3]"``."""
    return f"{_XLA_DTYPES.get(dtype, dtype)}[{','.join(str(d) for d in dims)}]"


def _phase(value: str, op: str) -> str:
    if ".remat" in value:
        return "xla_remat"
    if "rematted_computation" in op:
        return "recompute"
    if "transpose(" in op:
        return "backward"
    return "forward"


def _kind_and_phase(
    found: tuple[hlo.Instruction, hlo.Computation] | None, value: str, shape: str, hints: Hints
) -> tuple[str, str]:
    """What a buffer live at the peak is (see :class:`PeakBuffer`), and in which phase."""
    instr, comp = found if found else (None, None)
    op = instr.op_name if instr else ""
    if instr is not None and instr.opcode == "parameter" and comp is not None and comp.is_entry:
        return hlo.argument_category(op), "argument"
    phase = _phase(value, op)
    arrays = hlo.array_shapes(shape)
    if hints.logits_elems and arrays and math.prod(arrays[0][1]) == hints.logits_elems:
        return ("logits_grad" if phase == "backward" else "logits"), phase
    if shape in hints.param_shapes and phase == "backward":  # a gradient, whatever else has
        return "param_shaped", phase  # its shape (a scan saves its weights' slices stacked)
    # Shapes only guess: a value recomputed inside JAX's remat is neither a saved residual nor
    # a parameter, whatever shape it shares with one (B = L = H, S = D); its module names it.
    recomputed = phase == "recompute"
    if shape in hints.stacked and not recomputed:
        return "stacked:" + "|".join(hints.stacked[shape]), phase
    parts = [p for p in op.split("/") if p]
    for part in reversed(parts[:-1]):
        if part in _MODULE_TAGS:
            return _MODULE_TAGS[part], phase
        if part in _NORMS:
            return "norm", phase
        if part == "attn":
            return "attention", phase
        if part in ("lm_head", "embed"):
            return part, phase
    if shape in hints.param_shapes and not recomputed:
        return "param_shaped", phase
    if instr is not None and instr.opcode in ("while", "parameter", "get-tuple-element", "tuple"):
        return "loop_state", phase
    if "dynamic_update_slice" in op or "dynamic_slice" in op:
        return "loop_state", phase
    return "other", phase


def _element_shape(found: tuple[hlo.Instruction, hlo.Computation] | None, value: str) -> str:
    if found is None:
        return ""
    instr = found[0]
    m = re.search(r"\{([0-9,]*)\}$", value)
    if not m or not m.group(1):
        return instr.shape
    elems = hlo._split_top_level(instr.shape.strip()[1:-1])  # noqa: SLF001
    elems = [re.sub(r"/\*index=\d+\*/", "", e).strip() for e in elems]
    index = int(m.group(1).split(",")[0])
    return elems[index] if index < len(elems) else ""


@dataclasses.dataclass(frozen=True)
class DumpReading:
    """What one compile's XLA dumps give: matmul FLOPs (and the part that recomputes, see
    :class:`~remat_kit.memory.hlo.FlopCount`), the largest buffers live at the peak, the
    live-range peak (bytes), the logits bytes live there, and warnings."""

    flops: float | None
    peak_buffers: tuple[PeakBuffer, ...]
    live_peak_bytes: int | None
    logits_live_bytes: int
    warnings: tuple[str, ...]
    recomputed_flops: float | None = None
    xla_remat_flops: float | None = None


_VAGUE_KINDS = ("other", "loop_state")


def _borrowed_op_name(
    instr: hlo.Instruction,
    name: str,
    instrs: Mapping[str, tuple[hlo.Instruction, hlo.Computation]],
    comps: Mapping[str, hlo.Computation],
) -> str:
    """An op_name for an instruction XLA left without one: an XLA remat clone takes its
    original's; a fusion takes the most specific one of the instructions inside it."""
    if ".remat" in name:
        origin = instrs.get(re.sub(r"\.remat\d*.*$", "", name))
        if origin is not None and origin[0].op_name:
            return origin[0].op_name
        instr = origin[0] if origin is not None else instr
    return hlo.op_name_of(instr, comps)


def _telling(buf: PeakBuffer) -> tuple[int, int, int]:
    """How much a value's name says about its buffer (the best of aliases is shown)."""
    return (
        buf.kind not in _VAGUE_KINDS,
        buf.phase != "forward" or bool(buf.op_name),
        -len(buf.value),
    )


def no_dump_line() -> str:
    """The warning for a compile that left no dump to read, naming the ``--xla_dump*`` flags of
    ``XLA_FLAGS`` where any is set (the analysis overrides the known ones:
    :data:`~remat_kit.memory.xla_compile.DUMP_OPTIONS`)."""
    line = "XLA wrote no dump of this compile: no buffers at peak, FLOPs unknown (None)"
    flags = user_dump_flags()
    if flags:
        line += (
            f"; XLA_FLAGS sets {' '.join(flags)}, which may keep XLA from writing it: unset "
            "them for the analysis"
        )
    return line


def read_dump(dump: hlo.DumpFiles, top_k: int, hints: Hints) -> DumpReading:
    """Flops, the physical buffers live at XLA's peak (largest ``top_k``) and warnings."""
    warnings: list[str] = []
    if dump.hlo is None:
        return DumpReading(None, (), None, 0, (no_dump_line(),))
    comps = dump.module
    count = dump.flop_count
    if count.unknown_trip_counts:
        warnings.append(
            f"{count.unknown_trip_counts} while loop(s) of unknown trip count counted once in "
            "the FLOPs"
        )
    instrs = hlo.instructions_by_name(comps)
    slots = dump.slots
    live = live_at_peak(dump) or []  # where the most bytes are live, aliases counted once
    # Values that alias (a loop's carry, the body's parameter, the in-place update) share one
    # slot of one allocation: count each slot once, named after its most telling value.
    groups: dict[object, list[PeakBuffer]] = {}
    for buf in live:
        name = buf.value.split("{")[0]
        found = instrs.get(name)
        argument = hlo.entry_argument(*found, instrs) if found is not None else None
        if argument is not None:  # an argument, or XLA's copy of a donated one: named as it
            found = (argument, found[1])
        if found is not None and not found[0].op_name:
            op_name = _borrowed_op_name(found[0], name, instrs, comps)
            found = (dataclasses.replace(found[0], op_name=op_name), found[1])
        slot = slots.get(buf.value)
        shape = slot.shape if slot else _element_shape(found, buf.value)
        bare = re.sub(r"\{[0-9,]*(:S\(\d+\))?\}$", "", shape)  # drop the layout
        kind, phase = _kind_and_phase(found, buf.value, bare, hints)
        key = (slot.allocation, slot.offset) if slot else buf.value  # aliases share a slot
        on_host = slot.on_host if slot else ":S(5)" in shape
        groups.setdefault(key, []).append(
            PeakBuffer(
                value=buf.value,
                nbytes=buf.nbytes,
                shape=bare,
                kind=kind,
                phase=phase,
                op_name=found[0].op_name if found else "",
                memory="host" if on_host else "device",
            )
        )
    buffers = []
    for group in groups.values():
        best = max(group, key=_telling)
        buffers.append(dataclasses.replace(best, nbytes=max(b.nbytes for b in group)))
    logits_live = sum(b.nbytes for b in buffers if b.kind in ("logits", "logits_grad"))
    buffers.sort(key=lambda b: -b.nbytes)
    uncounted = hlo.uncounted_kernels(comps)
    if uncounted:
        warnings.append(
            f"{len(uncounted)} TPU kernel(s) carry no cost estimate ({', '.join(uncounted[:4])}"
            f"{', ...' if len(uncounted) > 4 else ''}): their FLOPs are in neither the FLOPs, "
            "the recompute ratio nor the estimated step time's compute (a Pallas kernel's "
            "pl.CostEstimate gives them)"
        )
    n_xla_remat = sum(1 for i in instrs if hlo.is_xla_remat(i))
    if n_xla_remat:
        warnings.append(
            f"XLA's rematerialisation pass recomputed {n_xla_remat} instruction(s) on its own to "
            "lower the peak (the FLOPs include them)"
        )
    return DumpReading(
        flops=count.flops,
        recomputed_flops=count.recomputed_flops,
        xla_remat_flops=count.xla_remat_flops,
        peak_buffers=tuple(buffers[:top_k]),
        live_peak_bytes=sum(b.nbytes for b in buffers if b.memory == "device") if buffers else None,
        logits_live_bytes=logits_live,
        warnings=tuple(warnings),
    )


#: Said after XLA's "Can't reduce memory use below X": X is not the device's memory. XLA's GPU
#: compiler (``GetMemoryLimitInBytes``) starts from 80% of the device's memory (unless the
#: module sets its own size), adjusts it for the entry's arguments and outputs, and scales it by
#: ``xla_gpu_memory_limit_slop_factor`` / 100 (default 95): 76% of a device's memory plus a
#: constant (checked in tests/test_analyze_programs.py with two device sizes).
XLA_REMAT_LIMIT_NOTE = (
    " [remat-kit: that limit is XLA's own rematerialization target, not the device's memory "
    "(on a GPU about 76% of it: 80% x xla_gpu_memory_limit_slop_factor 95%, adjusted for the "
    "step's arguments and outputs); whether the step fits is judged on its whole compiled peak]"
)


def log_warnings(result: CompileResult) -> list[str]:
    """The compiler's warning/error lines worth showing a user (e.g. XLA's "Can't reduce
    memory use below ...", with :data:`XLA_REMAT_LIMIT_NOTE`), each once."""
    out = list(result.notes)
    for line in result.log_lines():
        if line.severity in "WEF" and _SURFACED.search(line.message):
            text = str(line)
            if "Can't reduce memory use below" in text:
                text += XLA_REMAT_LIMIT_NOTE
            if text not in out:
                out.append(text)
    return out


_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
}
_HOST_FIELDS = ("host_argument_size_in_bytes", "host_output_size_in_bytes",
                "host_temp_size_in_bytes", "host_alias_size_in_bytes")  # fmt: skip


def _field(m: Any, field: str) -> int | None:
    """One ``memory_analysis()`` field in bytes; None where the backend does not give it (the
    analysis is None, the field absent or None, or -1: jax#18954, jax#12848)."""
    value = getattr(m, field, None) if m is not None else None
    if value is None or int(value) < 0:
        return None
    return int(value)


def unknown_memory_fields(compiled: Any) -> list[str]:
    """The ``memory_analysis()`` fields of the device parts the backend left unknown (all of
    them when it returns None); empty when every figure is known."""
    m = compiled.memory_analysis()
    return [f for f in _MEMORY_FIELDS.values() if _field(m, f) is None]


def memory_parts(compiled: Any, unknown_as_none: bool = False) -> dict[str, int | None]:
    """``compiled.memory_analysis()`` as integer bytes: argument, output, temp, alias and their
    host counterparts (XLA's ``*_size_in_bytes`` fields).

    An unknown field (see :func:`unknown_memory_fields`) is None with ``unknown_as_none``
    (then :func:`peak_bytes_of` is None too: never a number that "fits"), else 0 (the host
    fields are 0 where the backend has no host memory figures)."""
    m = compiled.memory_analysis()
    default = None if unknown_as_none else 0
    parts: dict[str, int | None] = {}
    for key, field in _MEMORY_FIELDS.items():
        value = _field(m, field)
        parts[key] = default if value is None else value
    host = [_field(m, f) or 0 for f in _HOST_FIELDS]
    parts["host_bytes"] = host[0] + host[1] + host[2] - host[3]
    return parts


def compiled_peak_bytes(
    compiled: Any, platform: str, parts: Mapping[str, int | None] | None = None
) -> int | None:
    """The per-device peak of a compiled step, in bytes; None when unknown (never 0).

    CPU and GPU: ``argument + output + temp - alias`` (:func:`peak_bytes_of`; their
    ``peak_memory_in_bytes`` is not meaningful on CPU). TPU: XLA's own
    ``memory_analysis().peak_memory_in_bytes``, because there ``temp_size_in_bytes`` leaves
    out most temporaries (figures: docs/results/compiler.md).

    Args:
      compiled: a ``jax.stages.Compiled``.
      platform: the target's platform (``"cpu"``, ``"cuda"``, ``"tpu"``).
      parts: :func:`memory_parts` of ``compiled`` when already read.
    """
    if platform == "tpu":
        return _field(compiled.memory_analysis(), "peak_memory_in_bytes")
    return peak_bytes_of(parts if parts is not None else memory_parts(compiled, True))


def peak_bytes_of(parts: Mapping[str, int | None]) -> int | None:
    """``argument + output + temp - alias`` bytes (see :class:`MemoryReport`); None when any
    part is unknown."""
    keys = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")
    if any(parts[k] is None for k in keys):
        return None
    return (
        parts["argument_bytes"] + parts["output_bytes"] + parts["temp_bytes"] - parts["alias_bytes"]
    )
