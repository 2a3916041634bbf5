"""``MemoryReport``: what one compiled step needs, in bytes, on one target; JSON in and out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from remat_kit.memory.roofline import StepTime
from remat_kit.memory.timeline import Timeline
from remat_kit.units import format_bytes, format_seconds
from remat_kit.walker import TagResiduals

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at the peak of XLA's schedule (from its live-range dump).

    Attributes:
      value: XLA's value name (``"while.24{3}"``). shape: as XLA prints it
        (``"bf16[32,1,8192,4096]"``), "" if unknown. nbytes: bytes.
      kind: an argument name (``params``, ``opt_state``, ``batch``), ``logits`` / ``logits_grad``,
        a checkpoint name, ``attention``, ``norm``, ``loop_state`` (scan carry) or ``other``.
      phase: ``forward``, ``backward``, ``recompute`` (JAX remat), ``xla_remat`` (XLA's pass) or
        ``argument``. op_name: JAX's ``op_name`` ("" if none). memory: ``device`` or ``host``.
    """

    value: str
    nbytes: int
    shape: str
    kind: str
    phase: str
    op_name: str
    memory: str = "device"


@dataclasses.dataclass(frozen=True)
class LogitsLine:
    """The logits ``[batch, seq, vocab]`` and their gradient: remat does not shrink them.

    Attributes:
      logits_bytes, grad_bytes: in the compute ``dtype``; f32_bytes: the loss's float32 copy.
      live_at_peak_bytes: compiled buffers of the logits' element count live at XLA's peak.
    """

    shape: tuple[int, int, int]
    dtype: str
    logits_bytes: int
    f32_bytes: int
    grad_bytes: int
    live_at_peak_bytes: int


@dataclasses.dataclass(frozen=True)
class PolicyOnly:
    """The policy's own figures where XLA's rematerialisation pass changed the program
    (:mod:`remat_kit.memory.policy_only`).

    Attributes:
      xla_remat_instructions: instructions XLA's pass cloned (as run).
      flops: matmul FLOPs without XLA's clones; recompute_ratio: ``flops / flops_no_remat``.
      peak_bytes, live_peak_bytes, compile_s: of a compile with the pass off (bytes, seconds);
        None unless asked for (``policy_alone_peak=True``, ``--policy-alone-peak``).
    """

    xla_remat_instructions: int
    flops: float | None
    recompute_ratio: float | None
    peak_bytes: int | None = None
    live_peak_bytes: int | None = None
    compile_s: float | None = None


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Memory (and FLOPs) of one compiled step on one target. Integers are bytes.

    ``peak_bytes = argument_bytes + output_bytes + temp_bytes - alias_bytes`` per device, from
    XLA's ``compiled.memory_analysis()`` (donated arguments counted once); framework overhead is
    not in it (``Target.usable_bytes``). On TPU it is XLA's ``peak_memory_in_bytes``
    (:func:`remat_kit.memory.reading.compiled_peak_bytes`).

    Attributes:
      name: what was analysed. target: the target name; the CPU backend's numbers are not GPU
        numbers. platform: ``cpu``/``cuda``/``tpu``; backend: compiler and jax version.
      policy: remat policy name or per-tag label (:func:`remat_kit.policies.policy_label`), None
        for an arbitrary function.
      host_bytes: bytes in host memory (offloaded; 0 on the CPU backend).
      arguments: argument bytes by part (``params``, ``opt_state``, ``batch``, ...).
      flops: matmul FLOPs of the compiled program (loops by trip count). flops_no_remat: without
        remat, from the jaxpr (per device on a mesh). recompute_ratio: the policy's own
        ``flops / flops_no_remat`` (XLA's remat told apart); compiled_recompute_ratio: as compiled.
      residuals: saved residuals by checkpoint tag, all layers. activation_bytes: their device
        bytes; offloaded_bytes: their host bytes.
      peak_buffers: the largest buffers live at XLA's peak. live_peak_bytes: all device bytes live
        at the busiest point of the schedule (below ``peak_bytes`` by what packing loses).
      memory_bytes: device memory; budget_bytes: the budget (default ``memory_bytes``); fits:
        ``peak_bytes <= budget_bytes`` (None if unknown).
      compile_s: seconds of XLA's compile, lowering excluded (for a cache hit: the original's).
      warnings: compiler messages worth reading.
      peak_bytes_without_offload: device peak of the same policy without offloading.
      timeline: :class:`~remat_kit.memory.timeline.Timeline`. policy_only: :class:`PolicyOnly`,
        None unless XLA's remat pass changed the program.
      step_time_s: estimated step time, seconds (:class:`~remat_kit.memory.roofline.StepTime`
        in ``step_time``); None without device figures.
      program_sha256: the compile engine's program key (equal keys, one compile).
      remat_impl: ``classic`` / ``remat3``. runs_as: what the policy ran as when not as named
        (``save-nothing``). compile_cached: read from the persistent compile cache.
    """

    name: str
    target: str
    platform: str
    backend: str
    policy: str | None
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    host_bytes: int
    arguments: dict[str, int]
    flops: float | None
    flops_no_remat: float | None
    recompute_ratio: float | None
    residuals: tuple[TagResiduals, ...]
    activation_bytes: int | None
    offloaded_bytes: int | None
    logits: LogitsLine | None
    peak_buffers: tuple[PeakBuffer, ...]
    live_peak_bytes: int | None
    memory_bytes: int | None
    budget_bytes: int | None
    fits: bool | None
    compile_s: float
    warnings: tuple[str, ...]
    model: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    peak_bytes_without_offload: int | None = None
    compiled_recompute_ratio: float | None = None
    timeline: Timeline | None = None
    policy_only: PolicyOnly | None = None
    program_sha256: str | None = None
    step_time_s: float | None = None
    step_time: StepTime | None = None
    remat_impl: str | None = None
    jax_version: str | None = None
    runs_as: str | None = None
    compile_cached: bool = False

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict())``."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """Inverse of :meth:`to_dict`.

        Raises:
          TypeError: missing or unknown fields.
        """
        data = dict(data)
        data["residuals"] = tuple(
            TagResiduals(**{**r, "shape": tuple(r["shape"])}) for r in data["residuals"]
        )
        data["peak_buffers"] = tuple(PeakBuffer(**b) for b in data["peak_buffers"])
        if data.get("logits") is not None:
            data["logits"] = LogitsLine(
                **{**data["logits"], "shape": tuple(data["logits"]["shape"])}
            )
        data["warnings"] = tuple(data["warnings"])
        if data.get("timeline") is not None:
            data["timeline"] = Timeline.from_dict(data["timeline"])
        if data.get("policy_only") is not None:
            data["policy_only"] = PolicyOnly(**data["policy_only"])
        if data.get("step_time") is not None:
            data["step_time"] = StepTime.from_dict(data["step_time"])
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> MemoryReport:
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """One line: target, policy, peak and host bytes, recompute ratio, step time, fits."""
        parts = [
            f"{self.name} on {self.target}",
            f"policy={self.policy}" if self.policy else "",
            f"peak {format_bytes(self.peak_bytes)}",
            f"host {format_bytes(self.host_bytes)}" if self.host_bytes else "",
            f"recompute x{self.recompute_ratio:.2f}" if self.recompute_ratio else "",
            f"est. step {format_seconds(self.step_time_s, 3)}" if self.step_time_s else "",
            "" if self.fits is None else ("fits" if self.fits else "does not fit"),
        ]
        return ", ".join(p for p in parts if p)


#: Prefix of :func:`same_program_lines`' warning.
SAME_PROGRAM = "the same program as policy "


def same_program_lines(
    labels: Sequence[str],
    reports: Sequence[MemoryReport | Any],
    expected: Sequence[Hashable],
    cause: str | None = None,
) -> list[tuple[str, ...]]:
    """Per report, the warning lines saying it compiled to the same program as an earlier one
    (:data:`SAME_PROGRAM`), or, when all did, that the policy changes nothing here (with
    ``cause``). Pairs with ``expected[i] == expected[j]`` are one program by construction: skipped.

    Args:
      labels: each report's policy label.
      reports: :class:`MemoryReport` or :class:`~remat_kit.memory.xla_compile.CompileError`
        (never matched), in compile order.
      cause: e.g. :meth:`remat_kit.reach.PolicyReach.after_gradient_cause`, or None.
    """
    same = same_program_as(reports)
    out: list[tuple[str, ...]] = [() for _ in reports]
    for i, j in enumerate(same):
        if j is not None and expected[i] != expected[j]:
            out[i] = (
                f"{SAME_PROGRAM}{labels[j]!r} (equal program_sha256): on this program it keeps "
                f"and recomputes what {labels[j]!r} does",
            )
    shown = [i for i, r in enumerate(reports) if getattr(r, "program_sha256", None)]
    if (
        len(shown) > 1
        and all(same[i] == shown[0] for i in shown[1:])
        and len({expected[i] for i in shown}) == len(shown)
    ):
        sha = reports[shown[0]].program_sha256[:12]
        line = (
            f"every policy ({', '.join(labels[i] for i in shown)}) compiled to the same program "
            f"(program_sha256 {sha}...): the policy changes nothing here"
        ) + (f": {cause}" if cause else "")
        for i in shown:
            out[i] = (line,)
    return out


def same_program_as(
    reports: Sequence[MemoryReport | Any], key: Callable[[Any], Hashable | None] | None = None
) -> list[int | None]:
    """Per report, the index of the first earlier one with equal
    :attr:`MemoryReport.program_sha256` (or ``key``; None never matches), else None."""
    key = key or (lambda r: getattr(r, "program_sha256", None))
    first: dict[Hashable, int] = {}
    out: list[int | None] = []
    for i, r in enumerate(reports):
        k = key(r)
        out.append(None if k is None else first.get(k))
        if k is not None:
            first.setdefault(k, i)
    return out
