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
      value: XLA's name for the value (instruction, plus tuple index: ``"while.24{3}"``).
      nbytes: size in bytes.
      shape: array shape as XLA prints it (``"bf16[32,1,8192,4096]"``), "" if unknown.
      kind: what it is: ``params`` / ``opt_state`` / ``batch`` / another argument name,
        ``logits`` / ``logits_grad``, a checkpoint name (``query_proj``), ``attention``,
        ``norm``, ``loop_state`` (a scan's carried or stacked values), or ``other``.
      phase: ``forward``, ``backward``, ``recompute`` (JAX remat), ``xla_remat`` (XLA's own
        rematerialisation pass) or ``argument``.
      op_name: the JAX ``op_name`` XLA kept for it (module path and primitive), "" if none.
      memory: ``device``, or ``host`` for a buffer XLA placed in host memory (offloaded).
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
      shape: ``(batch, seq, vocab)``.
      dtype: the compute dtype of the logits.
      logits_bytes: one logits tensor in the compute dtype.
      f32_bytes: the float32 copy the loss makes (``cross_entropy_loss`` upcasts).
      grad_bytes: the gradient of the logits, in the compute dtype.
      live_at_peak_bytes: bytes of compiled buffers with the logits' element count live at XLA's
        peak (logits, their float32 copies, softmax, gradient): the compiler's own figure.
    """

    shape: tuple[int, int, int]
    dtype: str
    logits_bytes: int
    f32_bytes: int
    grad_bytes: int
    live_at_peak_bytes: int


@dataclasses.dataclass(frozen=True)
class PolicyOnly:
    """The policy's own figures where XLA's own rematerialisation pass changed the program
    (:mod:`remat_kit.memory.policy_only`). The FLOPs come from the as-run compile, its clones told
    apart (:class:`~remat_kit.memory.hlo.FlopCount` ``xla_remat_flops``); the peak needs a second
    compile with the pass off, made only when asked (``analyze_policies(...,
    policy_alone_peak=True)``, ``remat-kit analyze --policy-alone-peak``).

    Attributes:
      xla_remat_instructions: instructions XLA's pass cloned to recompute (as run).
      flops: the policy's own matmul FLOPs; recompute_ratio: ``flops / flops_no_remat``.
      peak_bytes: the device peak of the policy alone (argument + output + temp - alias), None
        when the pass-off compile was not made.
      live_peak_bytes: the most device bytes live at one point of that schedule (or None).
      compile_s: seconds of the pass-off compile (or None).
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

    ``peak_bytes = argument_bytes + output_bytes + temp_bytes - alias_bytes``: XLA's
    ``compiled.memory_analysis()`` parts, per device (donated arguments alias their outputs, counted
    once). The framework's own overhead (CUDA context, fragmentation, JAX's preallocation: see
    ``Target.usable_bytes``) is not in it. On a TPU target ``peak_bytes`` is XLA's own
    ``peak_memory_in_bytes`` instead, its ``temp_bytes`` leaving out most temporaries
    (:func:`remat_kit.memory.reading.compiled_peak_bytes`).

    Attributes:
      name: what was analysed (function name, or ``"llama3-8b b=1 s=8192"``).
      target: the target name (``"h100-sxm"``, ``"cpu"``, ``"local"``): the numbers are this
        compiler's for this device, and the CPU backend's are not GPU numbers.
      platform: ``"cpu"``, ``"cuda"`` or ``"tpu"``; backend: compiler and jax version.
      policy: the remat policy name, a per-tag spec's label
        (:func:`remat_kit.policies.policy_label`), or None for an arbitrary function.
      peak_bytes: see above. argument_bytes, output_bytes, temp_bytes, alias_bytes: its parts.
      host_bytes: bytes in host memory (offloaded residuals; XLA's ``host_*`` figures, same
        formula); 0 on the CPU backend, where offloading is not real.
      arguments: argument bytes by part (``params``, ``opt_state``, ``batch``, ...).
      flops: matmul FLOPs of the compiled program (loops counted by trip count).
      flops_no_remat: matmul FLOPs of the same step without remat, from its jaxpr (on a mesh: per
        device, the compiled step's matmuls less those recomputed); None for an arbitrary
        function. recompute_ratio: the policy's own ``flops / flops_no_remat`` (XLA's own remat
        told apart: ``policy_only``); compiled_recompute_ratio: the same as compiled.
      residuals: saved residuals (from the jaxpr) by checkpoint tag, all layers: count, shape of
        one, dtype, total bytes, memory kind. activation_bytes: their device bytes;
        offloaded_bytes: their host bytes.
      logits: the logits line (models only).
      peak_buffers: the largest buffers live at XLA's peak, largest first.
      live_peak_bytes: device bytes of all buffers live at the busiest point of XLA's schedule,
        aliased values once (below ``peak_bytes`` by what buffer packing loses).
      memory_bytes: the target's device memory; budget_bytes: the budget judged against
        (``memory_bytes`` unless given); fits: ``peak_bytes <= budget_bytes`` (None if unknown).
      compile_s: wall seconds of XLA's compile (lowering excluded; for a cached compile, those
        of the compile that made the entry).
      warnings: compiler messages worth reading (XLA's remat pass giving up, unknown trip counts,
        dumps missing).
      model, batch_size, seq_len: the model preset (or config name) and shape, when a model.
      peak_bytes_without_offload: for an offloading policy where offload is real, the device
        peak of the same policy keeping those tensors on device (offloading helped only if
        ``peak_bytes`` is below it).
      timeline: live device bytes at each point of XLA's schedule, by category
        (:class:`~remat_kit.memory.timeline.Timeline`).
      policy_only: the step without XLA's own rematerialisation pass, when that pass changed the
        program (:class:`PolicyOnly`); None when it did not.
      step_time_s: the estimated step time in seconds (:mod:`remat_kit.memory.roofline`); None
        where the target has no device figures. step_time: its breakdown
        (:class:`~remat_kit.memory.roofline.StepTime`).
      program_sha256: the compile engine's key of the compiled program: equal keys, one compile
        (two policies that act the same); None when not known.
      remat_impl: the remat implementation traced under (``classic`` / ``remat3``); jax_version.
      runs_as: what the policy ran as where that implementation does not apply it as named
        (``save-nothing``: full remat); None when as named.
      compile_cached: the compile's artifacts were read from the persistent compile cache.
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
        """One line: target, policy, peak and host bytes (in the unit that fits them), recompute
        ratio, estimated step time (the roofline), fits."""
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


#: How a report compiled to the same program as an earlier policy's begins
#: (:func:`same_program_lines`); the command line's table says it in its own column instead.
SAME_PROGRAM = "the same program as policy "


def same_program_lines(
    labels: Sequence[str],
    reports: Sequence[MemoryReport | Any],
    expected: Sequence[Hashable],
    cause: str | None = None,
) -> list[tuple[str, ...]]:
    """The warning lines to add to each report (one tuple per report) where a policy compiled to
    the same program (equal :attr:`MemoryReport.program_sha256`) as an earlier one for no reason
    already given (``expected[i] == expected[j]``: one program by construction, noted elsewhere).
    A later report gets ``"the same program as policy 'X' ..."`` (:data:`SAME_PROGRAM`); when all of
    two or more reports are one program, each gets one line saying the policy changes nothing
    here, with ``cause`` (why, and the fix) where known.

    Args:
      labels: each report's policy as its row names it.
      reports: :class:`MemoryReport` or :class:`~remat_kit.memory.xla_compile.CompileError`
        (never matched), in the order compiled.
      expected: per report, what makes two reports one program by construction.
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
    """For each report, the index of the first earlier report of the same compiled program
    (equal :attr:`MemoryReport.program_sha256`), else None; entries that are not reports (a
    :class:`~remat_kit.memory.xla_compile.CompileError`) get None. ``key``: what identifies
    an entry's program instead (None: unknown, never matched), e.g. a sweep row's group and
    its report's ``program_sha256``."""
    key = key or (lambda r: getattr(r, "program_sha256", None))
    first: dict[Hashable, int] = {}
    out: list[int | None] = []
    for i, r in enumerate(reports):
        k = key(r)
        out.append(None if k is None else first.get(k))
        if k is not None:
            first.setdefault(k, i)
    return out
