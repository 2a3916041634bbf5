"""Warnings for a policy whose recomputation the compiled step undid, with the cause told from
what is known: the target's platform and where the step's remat regions sit (inside a
``scan`` / ``while`` body or not, and their ``prevent_cse``;
:class:`~remat_kit.walker.RematPlacement`).

Two symptoms are checked: the compiled step recomputes fewer matmul FLOPs than the jaxpr
(:func:`recompute_undone`: XLA's CSE merged the recomputation back) and the compiled temp
memory does not drop though the jaxpr keeps fewer residuals than without remat
(:func:`memory_not_freed`, against the no-remat step of the same run).

Some XLA:CPU versions undo a remat outside a ``lax.scan`` whatever ``prevent_cse`` is; GPU
targets keep it unless ``prevent_cse=False``. Which the XLA in use does is read from a probe
compile (:func:`cpu_undoes_remat_outside_scan`), not assumed (docs/results/compiler.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from remat_kit.units import format_bytes
from remat_kit.walker import RematPlacement

#: How :func:`recompute_undone` says XLA's CSE merged all, or part, of the recomputation
#: back; :func:`cse_undone` reads it back (the doctor judges by the analyzer's own line).
CSE_UNDID_ALL = "XLA's CSE merged the recomputation back"
CSE_UNDID_PART = "XLA's CSE merged part of the recomputation back"
#: The jaxpr frees residuals but the compiled temp memory does not drop by this share of them.
_FREED_SHARE = 0.1
#: A policy's own recompute ratio above this: the compiled step recomputes (the remat stands).
_RECOMPUTES = 1.01


#: Why one remat segment outside every loop frees little (jax#19822: ``jax.checkpoint`` around
#: a whole function): the one home of the analyzer's and the doctor's words.
LONE_SEGMENT_CAUSE = (
    "the step has a single remat segment, outside every loop: the backward pass recomputes it "
    "in one piece before using any of its values, so they are all live again at once, as "
    "without remat (remat frees memory across segments: jax#19822)"
)
LONE_SEGMENT_FIX = (
    "checkpoint each layer instead of the whole function: jax.checkpoint(layer, policy=...) "
    "under lax.scan (linen: nn.scan over nn.remat(Layer); NNX: nnx.remat inside nnx.scan)"
)


#: The fix for remat regions wrapping a whole loop (:func:`around_loop_cause`).
AROUND_LOOP_FIX = (
    "checkpoint the loop's body instead: lax.scan(jax.checkpoint(body, policy=policy), ...) "
    "(linen: nn.scan over nn.remat(Layer); NNX: nnx.remat inside nnx.scan)"
)


#: What a buffer live at the peak is (``kind`` of :class:`remat_kit.memory.report.PeakBuffer`), in
#: words; a kind not listed is a checkpoint name (a residual of that name).
_KINDS = {
    "params": "the parameters",
    "opt_state": "the optimizer state",
    "batch": "the batch",
    "logits": "the logits",
    "logits_grad": "the logits' gradient",
    "attention": "attention values",
    "norm": "norm outputs",
    "loop_state": "a scan's carried or stacked values",
    "other": "untagged values",
}
#: Kinds no remat policy of the layers governs: a peak they set is outside the layers.
_OUTSIDE_LAYERS = frozenset({"params", "opt_state", "batch", "logits", "logits_grad"})


def peak_set_by(report: Any) -> str:
    """Where the compiled peak is set, from the buffers live at it (``report.peak_buffers``,
    largest first): the largest group by kind and phase with its bytes and an example, e.g.
    "the peak is set by untagged values of the forward pass: 6 of the 8 largest buffers live
    at it (3.00 MiB; gemm_fusion_dot.10 f32[8,128,128], jvp()/dot_general)". One home for the
    analyzer's warning and the doctor's ``remat-not-lowering-peak``; a step whose buffers were
    not read gets the usual places, said as a guess."""
    bufs = [b for b in getattr(report, "peak_buffers", ()) or () if b.memory == "device"]
    if not bufs:
        return (
            "the peak is probably set outside the rematerialised layers (the optimizer "
            "update, the logits, the parameters; the buffers live at it were not read)"
        )
    groups: dict[tuple[str, str], list[Any]] = {}
    for b in bufs:
        groups.setdefault((b.kind, b.phase), []).append(b)
    (kind, phase), top = max(groups.items(), key=lambda kv: sum(b.nbytes for b in kv[1]))
    what = _KINDS.get(kind, f"residuals named {kind}")
    if phase not in ("argument", ""):
        what += f" of the {phase.replace('xla_remat', 'XLA-rematerialised')} pass"
    first = top[0]
    example = f"{first.value} {first.shape}".strip()
    example += f", {first.op_name}" if first.op_name else ""
    outside = ", outside the rematerialised layers" if kind in _OUTSIDE_LAYERS else ""
    lead = f"the peak is set by {what}{outside}"
    return (
        f"{lead}: {len(top)} of the {len(bufs)} largest buffers live at it "
        f"({format_bytes(sum(b.nbytes for b in top))}; {example})"
    )


def around_loop_cause(regions: int) -> str:
    """Why remat regions wrapping a whole loop free no memory (one home: the analyzer's
    warning and the doctor's finding; :data:`AROUND_LOOP_FIX` is the fix)."""
    return (
        f"{regions} remat region(s) wrap a whole lax.scan / while loop, not its body: the "
        "backward pass re-runs the loop and stacks every iteration's residuals again, as no "
        "remat keeps them"
    )


@functools.cache
def _cpu_undoes(version: str) -> bool:
    import jax
    import jax.numpy as jnp

    from remat_kit.memory import hlo

    def layer(x, w):  # x [4, 16], w [16, 16]
        return jnp.sin(jnp.sin(x @ w) @ w)

    def grad_of(f):
        def loss(w, x):
            for _ in range(2):  # unrolled: no scan
                x = f(x, w)
            return x.sum()

        return jax.grad(loss)

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=cpu) for s in ((16, 16), (4, 16))]

    def flops(f) -> float:
        text = jax.jit(grad_of(f)).lower(*args).compile().as_text()
        return hlo.count_flops(hlo.parse_hlo_module(text)).flops

    return flops(jax.checkpoint(layer)) <= flops(layer)  # prevent_cse=True, the default


def cpu_undoes_remat_outside_scan(platform: str = "cpu") -> bool:
    """Whether ``platform`` is XLA:CPU and the XLA in use undoes a remat outside a scan whatever
    ``prevent_cse`` is (GPU targets keep it unless ``prevent_cse=False``). From a probe compile
    on the CPU, once per jax version: the gradient of two unrolled ``jax.checkpoint`` layers
    recomputes no matmul FLOPs when it is undone."""
    if platform != "cpu":
        return False
    import jax

    return _cpu_undoes(jax.__version__)


def undone_cause(platform: str, remat: RematPlacement | None) -> str:
    """Why XLA undid the recomputation, from the platform and the remat's placement (None:
    not known): only what those facts say."""
    if cpu_undoes_remat_outside_scan(platform):
        if remat is None:
            return "XLA:CPU honours remat only inside lax.scan / nn.scan / nnx.scan"
        if remat.outside:
            return (
                f"XLA:CPU honours remat only inside lax.scan / nn.scan / nnx.scan, and "
                f"{remat.outside} remat region(s) of this step are outside any scan; run the "
                "layers under a scan, or judge remat on a GPU target"
            )
        return (
            "every remat region is inside a scan, where XLA:CPU usually keeps it; what undid "
            "it here is not known to remat-kit (judge remat on a GPU target)"
        )
    if remat is None:
        return "a jax.checkpoint / nn.remat with prevent_cse=False outside a scan lets CSE do so"
    if remat.no_cse_outside:
        return (
            f"{remat.no_cse_outside} remat region(s) outside a scan have prevent_cse=False "
            "; keep prevent_cse=True, or scan the layers"
        )
    if remat.outside:
        return (
            f"not identified: the {remat.outside} remat region(s) outside a scan keep "
            "prevent_cse=True, which should stop CSE; run the layers under a scan to rule the "
            "placement out"
        )
    return "not identified: every remat region is inside a scan"


def recompute_undone(job: Any, reading: Any) -> str | None:
    """The warning when the traced step recomputes matmuls and the compiled one recomputes
    less than 90% of them (one device only): XLA's CSE merged part or all of it back.

    Args:
      job: a :class:`remat_kit.memory.runner.Job`; reading: its compile's ``DumpReading``.
    """
    base, traced = job.flops_no_remat, job.flops_traced
    if job.mesh_devices is not None or not base or traced is None or reading.flops is None:
        return None
    # What recomputes: the matmuls under JAX's remat scope, or the compiled work over no-remat
    # (the larger: the scope is not seen on every recomputed dot, e.g. in some scan bodies).
    done = max(reading.recomputed_flops or 0.0, reading.flops - base)
    wanted = traced - base
    if wanted <= base * 1e-3 or done >= 0.9 * wanted:
        return None
    # shown as the report's compiled ratio says it (a forward dot left under the remat scope
    # after CSE counts in ``done`` but adds no FLOPs)
    compiled = min(base + done, reading.flops) / base
    digits = 2 if f"{traced / base:.2f}" != f"{compiled:.2f}" else 4
    how = "none" if compiled - 1 <= 1e-3 else f"only {compiled:.{digits}f}x"
    return (
        f"policy {job.label or job.policy!r} recomputes {traced / base:.{digits}f}x the matmul "
        "FLOPs "
        f"in the jaxpr, but the compiled step recomputes {how}: "
        f"{CSE_UNDID_ALL if how == 'none' else CSE_UNDID_PART} into the forward pass, "
        "keeping what it merged as without remat. Cause: "
        f"{undone_cause(job.target.platform, job.remat)}"
    )


def working_bytes(report: Any, platform: str) -> int | None:
    """The compiled step's memory beside its arguments: XLA's temp bytes, or on a TPU its peak
    less the arguments (XLA:TPU's ``temp_size_in_bytes`` leaves out most temporaries, or counts
    what is never live at once: :func:`remat_kit.memory.reading.compiled_peak_bytes`)."""
    if platform != "tpu":
        return report.temp_bytes
    if report.peak_bytes is None or report.argument_bytes is None:
        return None
    return report.peak_bytes - report.argument_bytes


def memory_not_freed(job: Any, report: Any, base: Any) -> str | None:
    """The warning when ``job``'s policy keeps fewer residual bytes than the no-remat step
    (``base``, a report of the same run) in the jaxpr but its compiled memory beside the
    arguments (:func:`working_bytes`) drops by less than a tenth of the difference (the line
    says by how much it dropped, if at all); None otherwise or when a figure is unknown."""
    act, base_act = report.activation_bytes, base.activation_bytes
    platform = job.target.platform
    mine, theirs = working_bytes(report, platform), working_bytes(base, platform)
    if act is None or base_act is None or report.host_bytes or mine is None or theirs is None:
        return None
    what = "peak less its arguments" if platform == "tpu" else "temp memory"
    promised = base_act - act
    if promised <= 0 or theirs - mine >= _FREED_SHARE * promised:
        return None
    dropped = theirs - mine
    # the policy's own ratio (XLA's own remat told apart, which inflates no-remat's compiled
    # FLOPs as much as the policy's on a small device)
    ratio = getattr(report, "recompute_ratio", None)
    flops, base_flops = getattr(report, "flops", None), getattr(base, "flops", None)
    if ratio is None and flops and base_flops:  # no ratio reported: the compiled FLOPs tell
        ratio = flops / base_flops
    on_cpu = cpu_undoes_remat_outside_scan(platform)
    compiled = (
        f"drops by {format_bytes(dropped)} ({format_bytes(theirs)} -> {format_bytes(mine)})"
        if dropped > 0
        else f"rises by {format_bytes(-dropped)} ({format_bytes(theirs)} -> {format_bytes(mine)})"
        if dropped < 0
        else f"does not drop ({format_bytes(mine)} against {format_bytes(theirs)})"
    )
    if job.remat is not None and job.remat.around_loop:
        return (
            f"policy {job.label or job.policy!r} keeps {format_bytes(act)} of residuals in the "
            f"jaxpr against {format_bytes(base_act)} without remat, but the compiled step's "
            f"{what} {compiled}: {around_loop_cause(job.remat.around_loop)}; {AROUND_LOOP_FIX}"
        )
    recomputes = bool(ratio and ratio > _RECOMPUTES)
    if not on_cpu and recomputes:
        # it recomputes: the remat stands, the peak is set where it does not reach (the
        # doctor's remat-not-lowering-peak)
        return (
            f"policy {job.label or job.policy!r} keeps {format_bytes(act)} of residuals in the "
            f"jaxpr against {format_bytes(base_act)} without remat, but the compiled step's "
            f"{what} {compiled} though it recomputes "
            f"({ratio:.2f}x the matmul FLOPs): "
            + (
                f"{LONE_SEGMENT_CAUSE}; {LONE_SEGMENT_FIX}"
                if job.remat is not None and job.remat.lone
                else f"{peak_set_by(report)}; see the buffers live at the peak (--timeline)"
            )
        )
    if recomputes:  # on the CPU: it recomputes, and keeps the values as well
        verdict = (
            f"though it recomputes ({ratio:.2f}x the matmul FLOPs), XLA keeps the forward "
            "values alive anyway"
        )
    else:
        verdict = f"XLA undid {'most of ' if dropped > 0 else ''}the remat"
    return (
        f"policy {job.label or job.policy!r} keeps {format_bytes(act)} of residuals in the "
        f"jaxpr against {format_bytes(base_act)} without remat, {format_bytes(promised)} "
        f"fewer, but the compiled step's {what} {compiled}: {verdict}. Cause: "
        f"{undone_cause(platform, job.remat)}"
    )


def cse_undone(warnings: Sequence[str]) -> tuple[str, str] | None:
    """``("all" | "part", line)`` when a report's ``warnings`` hold the analyzer's warning that
    XLA's CSE merged the recomputation back (:func:`recompute_undone`), else None."""
    for line in warnings:
        if CSE_UNDID_ALL in line:
            return "all", line
        if CSE_UNDID_PART in line:
            return "part", line
    return None
