"""The doctor's comparisons: a policy's promise against what the walk and the compile show."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from remat_kit import targets as T
from remat_kit import walker as W
from remat_kit.doctor.findings import SAME, Finding, nbytes
from remat_kit.doctor.promise import Promise
from remat_kit.doctor.tags import TagFacts, own_example
from remat_kit.memory import MemoryReport
from remat_kit.memory.runner import cse_undone
from remat_kit.memory.undone import (
    AROUND_LOOP_FIX,
    LONE_SEGMENT_CAUSE,
    LONE_SEGMENT_FIX,
    around_loop_cause,
    cpu_undoes_remat_outside_scan,
    peak_set_by,
    working_bytes,
)
from remat_kit.reach import PolicyReach

#: Residual sources a dots policy keeps (JAX's dots policies save convolutions too).
_DOT_SOURCES = ("dot_general", "conv_general_dilated")
#: A policy whose compiled temp bytes go down by less than this fraction of what its jaxpr
#: residuals promise (against no-remat) has not taken effect.
MIN_EFFECT = 0.1


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the jaxpr keeps: device and host bytes of new buffers (arguments excluded), the tags
    kept (arguments included: a remat segment's input is kept as an argument), and whether any
    untagged matmul or convolution output is kept."""

    device_bytes: int
    host_bytes: int
    tags: frozenset[str]
    dots: bool
    #: New device bytes (arguments excluded) kept per tag.
    tag_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: New host bytes (offloaded) per tag.
    host_tag_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, residuals: Sequence[W.Residual]) -> Residuals:
        new = [r for r in residuals if not r.is_argument]
        tag_bytes: dict[str, int] = {}
        host_tag_bytes: dict[str, int] = {}
        for r in new:
            if r.tag is not None:
                by = tag_bytes if r.memory == "device" else host_tag_bytes
                by[r.tag] = by.get(r.tag, 0) + r.nbytes
        return cls(
            device_bytes=sum(r.nbytes for r in new if r.memory == "device"),
            host_bytes=sum(r.nbytes for r in new if r.memory == "host"),
            tags=frozenset(r.tag for r in residuals if r.tag is not None),
            dots=any(r.source in _DOT_SOURCES for r in residuals),
            tag_bytes=tag_bytes,
            host_tag_bytes=host_tag_bytes,
        )


def _recomputes(report: MemoryReport, no_remat: MemoryReport, recomputed_ops: int | None):
    """Whether the compiled step recomputes: from the recomputed operations of its program
    where counted, else from its FLOPs (matmuls, convolutions, fused attention) against
    no-remat's; None when neither can tell (a program without counted FLOPs)."""
    if recomputed_ops is not None:
        return recomputed_ops > 0
    if report.flops is None or not no_remat.flops:
        return None
    return report.flops > no_remat.flops * (1 + SAME)


def _scan_fix(scan_layers: bool | None) -> str:
    """The fix for remat undone outside a loop, in the terms of the program's author: the
    bundled models' config field, or the scan of the user's own layer loop."""
    if scan_layers is None:  # a user's program: speak of their code
        return (
            "run the layer loop under jax.lax.scan (linen: nn.scan; NNX: nnx.scan) with the "
            "checkpointed layer as its body; judge remat on a GPU target."
        )
    return "scan the layers (scan_layers=True); judge remat on a GPU target."


def _versus(report: Any, no_remat: Any, platform: str) -> str:
    """``temp 1.2 MiB vs 3.4 MiB without remat`` (on a TPU, the peak less the arguments:
    :func:`~remat_kit.memory.undone.working_bytes`)."""
    what = "peak less arguments" if platform == "tpu" else "temp"
    mine, theirs = working_bytes(report, platform), working_bytes(no_remat, platform)
    return f"{what} {nbytes(mine or 0)} vs {nbytes(theirs or 0)} without remat"


def _achieved(report: Any, no_remat: Any, platform: str) -> int | None:
    """Bytes the policy's step frees against no-remat's beside the arguments (XLA's temp
    bytes; on a TPU, whose temp figure leaves out most temporaries, the peak less the
    arguments: :func:`~remat_kit.memory.undone.working_bytes`); None where either is unknown."""
    mine, theirs = working_bytes(report, platform), working_bytes(no_remat, platform)
    return theirs - mine if mine is not None and theirs is not None else None


def _freed(achieved: int, promised: int) -> str:
    """The doctor's words for ``achieved`` bytes of temp memory freed of ``promised``: "frees
    only A of the P its residuals promise", or, where temp memory went up, "adds A of temp memory
    where its residuals promise to free P"."""
    if achieved >= 0:
        return f"frees only {nbytes(achieved)} of the {nbytes(promised)} its residuals promise"
    return (
        f"adds {nbytes(-achieved)} of temp memory where its residuals promise to free "
        f"{nbytes(promised)}"
    )


def _not_effective(
    promise,
    report,
    no_remat,
    *,
    promised,
    achieved,
    target,
    scan_layers,
    ops,
    around_loop,
    lone=False,
):
    """The finding for a policy whose fewer residuals (``promised`` bytes) freed ``achieved``
    bytes of temp memory or less: remat around a loop, XLA's CSE, or the peak set elsewhere."""
    if around_loop:  # the segment holds the loop: re-run whole, it stacks what no remat keeps
        return Finding(
            "remat-around-loop", "error",
            f"policy {promise.name!r} {_freed(achieved, promised)} "
            f"({_versus(report, no_remat, target.platform)}).",
            around_loop_cause(around_loop) + ".",
            AROUND_LOOP_FIX + ".",
        )  # fmt: skip
    outside_scan = " outside lax.scan (scan_layers=False)" if scan_layers is False else ""
    on_cpu = cpu_undoes_remat_outside_scan(target.platform)
    recomputes = _recomputes(report, no_remat, ops)
    keeps_dots = promise.base == "dots" and ops is None  # recomputes elementwise ops only:
    if keeps_dots and recomputes is False:  # matmul FLOPs cannot show it either way
        recomputes = None
    if recomputes is False:
        return Finding(
            "cse-undid-remat", "error",
            f"policy {promise.name!r} recomputes in the jaxpr, but the compiled step has no "
            f"recomputation and {_freed(achieved, promised)}.",
            f"XLA's CSE merged the recomputation back into the forward pass{outside_scan}"
            + ("; XLA:CPU drops remat's optimisation barriers outside loops." if on_cpu else "."),
            "run the layers under lax.scan / nn.scan / nnx.scan, or judge remat on a GPU target "
            "(XLA:CPU undoes remat outside a scan whatever prevent_cse is)." if on_cpu
            else "keep prevent_cse=True (nn.remat / jax.checkpoint), or run the layers under "
            "lax.scan / nn.scan.",
        )  # fmt: skip
    if (recomputes is True or keeps_dots) and not on_cpu:
        # It does recompute on a real target: the peak is set elsewhere, not a no-op.
        what = "recomputes"
        if keeps_dots and recomputes is not True:  # the matmul ratio column says 1.00x
            what = "recomputes its elementwise work (its matmuls are saved)"
        return Finding(
            "remat-not-lowering-peak", "warning",
            f"policy {promise.name!r} {what}, but the compiled step {_freed(achieved, promised)}"
            f" ({_versus(report, no_remat, target.platform)}).",
            (LONE_SEGMENT_CAUSE if lone else peak_set_by(report)) + ".",
            LONE_SEGMENT_FIX + "." if lone else "look at the buffers live at the peak "
            "(remat-kit analyze --timeline); a cheaper policy may fit as well.",
        )  # fmt: skip
    return Finding(
        "no-op-policy", "error",
        f"policy {promise.name!r} recomputes but the compiled step {_freed(achieved, promised)}"
        f" ({_versus(report, no_remat, target.platform)}).",
        f"XLA keeps the forward values alive anyway{outside_scan} (XLA:CPU honours remat only "
        "inside lax.scan / nn.scan / nnx.scan)." if outside_scan or on_cpu
        else (LONE_SEGMENT_CAUSE if lone else peak_set_by(report)) + ".",
        _scan_fix(scan_layers) if on_cpu else LONE_SEGMENT_FIX + "." if lone else "look at the "
        "buffers live at the peak (remat-kit analyze).",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PolicyEvidence:
    """What the compile and the walk show of one policy on one step, beside the baseline it is
    judged against (``no-remat``; ``save-everything`` where the factory remats even without a
    policy): the input of :func:`compare`.

    Attributes:
      report: the policy's compiled step (bytes; FLOPs where counted).
      no_remat: the baseline's compiled step, for the same target.
      kept: what the policy's jaxpr keeps (:class:`Residuals`: bytes, tags).
      kept_no_remat: what the baseline's jaxpr keeps.
      kept_nothing: what ``save-nothing`` keeps (the remat segments' inputs), for
        ``saved-anyway``; None: not known.
      recomputed_ops: operations of the compiled policy step under JAX's remat scope
        (:func:`remat_kit.doctor.recomputed_ops`); None: not counted, the FLOPs decide.
    """

    report: MemoryReport
    no_remat: MemoryReport
    kept: Residuals
    kept_no_remat: Residuals
    kept_nothing: Residuals | None = None
    recomputed_ops: int | None = None

    @property
    def promised(self) -> int:
        """Device bytes of residuals the policy's jaxpr keeps fewer of than the baseline's
        (negative: it keeps more)."""
        return self.kept_no_remat.device_bytes - self.kept.device_bytes


def compare(
    spec: Promise | Any,
    evidence: PolicyEvidence,
    target: T.Target,
    *,
    scan_layers: bool | None = None,
    facts: TagFacts | None = None,
    reach: PolicyReach | None = None,
) -> list[Finding]:
    """Findings from what the compile and the walk show of a policy against ``no-remat`` for
    one step (:class:`PolicyEvidence`). None for an optional argument: not known.

    Args:
      spec: a :class:`Promise` or a :class:`~remat_kit.policies.PolicySpec`.
      evidence: the compiled reports of the policy and of the baseline, and what each (and
        ``save-nothing``) keeps in the jaxpr.
      target: the target both steps were compiled for.
      scan_layers: a bundled model's ``scan_layers`` (the fix names it); None: a user's
        program (the fix speaks of their layer loop).
      facts: the program's checkpoint names (:class:`~remat_kit.doctor.tags.TagFacts`), which
        tell why a name is kept nowhere (tags never emitted are ``unknown-tag``'s, not here).
      reach: where the program's remat segments sit (:class:`~remat_kit.reach.PolicyReach`):
        segments wrapping a whole loop (``around_loop``) for ``remat-around-loop``, or one
        segment outside every loop (``lone``), the cause of a policy freeing too little on a
        real target; None: neither.

    Returns:
      The findings, in the order found (nothing for ``no-remat``, which promises nothing).
    """
    promise = spec if isinstance(spec, Promise) else Promise.of(spec)
    out: list[Finding] = []
    if not promise.wrap:  # no-remat: nothing promised
        return out
    report, kept, kept_no_remat = evidence.report, evidence.kept, evidence.kept_no_remat
    promised = evidence.promised  # device bytes the policy frees
    achieved = _achieved(report, evidence.no_remat, target.platform)
    offload_real = promise.offloads and target.supports_host_offload
    if promised <= 0 and not (offload_real and report.host_bytes > 0):
        out.append(_no_op(promise, kept))
    elif (
        promised > 0
        and achieved is not None
        and achieved < MIN_EFFECT * promised
        and not offload_real
    ):
        # An offload on a real target is judged by its host bytes (below), not by recompute.
        out.append(
            _not_effective(
                promise,
                report,
                evidence.no_remat,
                promised=promised,
                achieved=achieved,
                target=target,
                scan_layers=scan_layers,
                ops=evidence.recomputed_ops,
                around_loop=reach.around_loop if reach is not None else 0,
                lone=reach is not None and reach.lone,
            )  # fmt: skip
        )
    cse = _cse_findings(promise, report, out)
    if cse:  # the measured cause, not the guess that the peak is outside the layers
        out = [f for f in out if f.code != "remat-not-lowering-peak"] + cse
    full = _full_remat(promise, kept, kept_no_remat, facts)
    out += full + _ragged_recomputed(promise, facts)
    nothing = evidence.kept_nothing
    anyway = nothing.tag_bytes if nothing is not None else {}
    if not full:
        out += _names_kept_nowhere(promise, kept, kept_no_remat, facts)
        out += _saved_anyway(promise, kept, anyway, facts)
        out += _saved_without_saving(promise, kept, facts, anyway)
        out += _saved_without_saving(promise, kept, facts, anyway, offloaded=True)
    if promise.offloads and not (full and kept.host_bytes == 0):  # else: the same cause
        out.extend(_offload_findings(promise, report, target, kept, kept_no_remat, facts))
    return out


#: Kind-based policies the no-op fix suggests (never the policy being checked).
_RECOMPUTE_MORE = ("save-dots-no-batch", "save-nothing")


def _no_op(promise: Promise, kept: Residuals) -> Finding:
    """``no-op-policy`` from the jaxpr: the policy keeps everything no-remat keeps."""
    what = (
        f"policy {promise.name!r} keeps everything no-remat keeps "
        f"({nbytes(kept.device_bytes)} of residuals): nothing is recomputed."
    )
    if promise.base == "names" and not promise.tags:  # save-nothing keeps only segment inputs
        return Finding(
            "no-op-policy", "error", what,
            "its remat segments hold none of the tensors the backward pass keeps (they are "
            "computed outside every jax.checkpoint / nn.remat / nnx.remat).",
            "put the layers (where the activations are) inside the checkpointed function.",
        )  # fmt: skip
    others = [p for p in _RECOMPUTE_MORE if p not in (promise.name, promise.base)]
    return Finding(
        "no-op-policy", "error", what,
        "it names only tensors the backward pass keeps anyway, or saves every value.",
        f"recompute more: save fewer tags, or use {' / '.join(others)}.",
    )  # fmt: skip


def _saved_anyway(
    promise: Promise, kept: Residuals, anyway: Mapping[str, int], facts: TagFacts | None
) -> list[Finding]:
    """``saved-anyway``: names the policy saves that save-nothing keeps as much of (a remat
    segment's input, which every policy keeps): naming them changes nothing; a warning when
    that is all the policy does (it compiles to save-nothing's program)."""
    if promise.base != "names" or promise.by_exclusion:  # names the policy did not name
        return []
    same = sorted(t for t in promise.save if 0 < kept.tag_bytes.get(t, 0) <= anyway.get(t, 0))
    if not same:
        return []
    alone = set(same) == set(promise.save) and not promise.offload
    one = len(same) == 1
    what = (
        f"policy {promise.name!r} saves {', '.join(same)}, which save-nothing keeps as well "
        f"({nbytes(sum(kept.tag_bytes[t] for t in same))}): naming "
        f"{'it' if one else 'them'} changes nothing"
        + ("; the policy compiles to save-nothing's program." if alone else ".")
    )
    outside = facts.outside_remat(same) if facts is not None else frozenset()
    if outside:
        cause = (
            f"{', '.join(sorted(outside))} {'is' if len(outside) == 1 else 'are'} applied "
            "outside every remat segment: stored or not regardless of the policy."
        )
    else:
        cause = (
            f"{'it is' if one else 'they are'} the input of a remat segment (a checkpointed "
            "layer's argument, a scan's carry), which the backward pass keeps under every "
            "policy to recompute the segment from."
        )
    return [
        Finding(
            "saved-anyway", "warning" if alone else "info", what, cause,
            f"leave {'it' if one else 'them'} out of the policy"
            + ("; to trade memory for speed, save a tag computed inside the layer."
               if alone else "."),
        )
    ]  # fmt: skip


def _saved_without_saving(
    promise: Promise,
    kept: Residuals,
    facts: TagFacts | None,
    anyway: Mapping[str, int],
    offloaded: bool = False,
) -> list[Finding]:
    """``save-removes-no-recompute``: tags the policy saves on device that are not among the
    program's :attr:`~remat_kit.doctor.tags.TagFacts.savers` (docs/doctor.md), judged as the
    solver's per-tag FLOPs and the doctor's fixes are; ``offloaded``:
    ``offload-removes-no-recompute``, tags it offloads to host so (host transfers for no matmul;
    a tag save-nothing keeps on device, such as a segment input, is worth offloading anyway)."""
    if facts is None or facts.savers is None or promise.base != "names":
        return []
    if promise.registered and not facts.user:  # remat-kit's policies on its own models save
        return []  # matmul outputs (the solver's savers): not worth one trace per tag
    if offloaded:  # offloading what save-nothing keeps on device frees device memory
        costly = {
            t: n for t, n in kept.host_tag_bytes.items()
            if t in promise.offload and not anyway.get(t, 0)
        }  # fmt: skip
    else:  # beyond what save-nothing keeps of them (``saved-anyway`` says those)
        costly = {
            t: n for t, n in kept.tag_bytes.items() if t in promise.save and n > anyway.get(t, 0)
        }
    if not costly:
        return []
    savers = facts.savers()
    idle = sorted(t for t in costly if t not in savers)
    if idle and facts.flops_keeping is not None:
        # within the policy: a name whose removal raises the FLOPs spares a matmul with the
        # others it keeps (K and V out of one einsum: neither alone, both together)
        keeping = frozenset(promise.tags & facts.emitted)
        full = facts.flops_keeping(keeping)
        idle = [t for t in idle if facts.flops_keeping(keeping - {t}) <= full]
    if not idle:
        return []
    it = "it" if len(idle) == 1 else "them"
    cause = _idle_cause(promise, facts, idle, savers)
    others = [t for t in savers if t not in promise.tags]
    leave = (
        "add {} to the names save_any_names_but_these leaves out"
        if promise.by_exclusion
        else "leave {} out of the policy"
    ).format(it)
    fix = f"recompute {it} ({leave})"
    if others:
        fix += (
            f"; to trade memory for speed, save a tag that removes recompute ({', '.join(others)})"
        )
    size = nbytes(sum(costly[t] for t in idle))
    what = (
        f"policy {promise.name!r} offloads {', '.join(idle)} ({size} to host memory), but "
        f"keeping {it} removes no matmul recompute: host transfers for elementwise work only."
        if offloaded
        else f"policy {promise.name!r} keeps {', '.join(idle)} ({size} of residuals), but "
        f"saving {it} removes no matmul recompute."
    )
    code = "offload-removes-no-recompute" if offloaded else "save-removes-no-recompute"
    return [Finding(code, "info", what, cause + ".", fix + ".")]


def _idle_cause(
    promise: Promise, facts: TagFacts, idle: Sequence[str], savers: Sequence[str]
) -> str:
    """Why keeping the ``idle`` names spares no matmul (:func:`_saved_without_saving`)."""
    it, they = ("it", "it") if len(idle) == 1 else ("them", "they")
    are = "is" if it == "it" else "are"
    # kept by this policy, saving FLOPs, and what an idle name is computed from (no matmul
    # between): then the idle name spares that elementwise work only
    fed = facts.feeds.fed if facts.feeds else {}
    bare = facts.feeds.no_matmul if facts.feeds else frozenset()
    also = [t for t in savers if t in promise.save and any(t in fed.get(i, ()) for i in idle)]
    if set(idle) <= bare:  # a norm of the layer's input, the input itself: no matmul to spare
        cause = (
            f"{they} {are} computed from the remat segment's input with "
            "no matmul between (the input itself, a norm, a cast): the backward pass recomputes "
            f"no matmul for {it}, so saving {it} spares only that elementwise work"
        )
    else:
        within = facts.flops_keeping is not None and len(promise.tags & facts.emitted) > len(idle)
        how = "saved alone or beside the other names this policy saves" if within else "saved alone"
        cause = (
            f"{how}, {they} spare{'s' if it == 'it' else ''} no matmul: the backward pass "
            f"recomputes the matmul that {they} {are} computed from "
            "for the activation's derivative unless that matmul's own output is kept"
        )
    if also:
        cause += (
            f"; this policy keeps {', '.join(also)}, which {they} {are} "
            f"computed from: saving {it} spares only the elementwise work between (the "
            "activation)"
        )
    return cause


def _cse_findings(promise: Promise, report: MemoryReport, found: list[Finding]) -> list[Finding]:
    """The analyzer's CSE warning (:func:`remat_kit.memory.runner.cse_undone`) as a finding:
    all of the recomputation merged back is an error (unless already said), part a warning."""
    undone = cse_undone(report.warnings)
    if undone is None or any(f.code == "cse-undid-remat" for f in found):
        return []
    how, line = undone
    figures, _, said = line.partition(": XLA's CSE")
    figures = figures[figures.index("recomputes") :] if "recomputes" in figures else figures
    merged, _, why = said.partition(". Cause: ")  # the analyzer's line says both
    if "XLA:CPU" in why:
        fix = "run the layers under lax.scan / nn.scan / nnx.scan, or judge remat on a GPU target."
    else:
        fix = ("keep prevent_cse=True (the default) where layers run outside lax.scan / nn.scan / "
               "nnx.scan, or run them under a scan.")  # fmt: skip
    return [
        Finding(
            "cse-undid-remat" if how == "all" else "cse-undid-part-of-remat",
            "error" if how == "all" else "warning",
            f"policy {promise.name!r} {figures}.",
            f"XLA's CSE{merged}" + (f"; {why}." if why else "."),
            fix,
        )
    ]  # fmt: skip


def _full_remat(
    promise: Promise, kept: Residuals, kept_no_remat: Residuals, facts: TagFacts | None
) -> list[Finding]:
    """``acts-as-full-remat`` when the policy promises tensors and keeps none, with the cause
    the walk tells (not for names the program never emits: ``unknown-tag`` says those)."""
    promises = bool(promise.tags) or promise.base in ("dots", "dots_no_batch")
    keeps = bool(kept.tags & promise.tags) or (promise.base != "names" and kept.dots)
    if not promises or keeps or promise.offloads_dots:
        return []
    named = promise.tags & facts.emitted if facts is not None else promise.tags
    if facts is not None and promise.base == "names" and not named:
        return []
    if not named and promise.base in ("dots", "dots_no_batch"):
        cause, fix = _why_no_dots(promise, facts)
    else:
        cause, fix = _why_not_kept(named, kept_no_remat, facts)
    return [
        Finding(
            "acts-as-full-remat", "error",
            f"policy {promise.name!r} promises to keep "
            f"{', '.join(sorted(named)) or 'matmul outputs'} but "
            f"{'does not keep it' if len(named) == 1 else 'keeps none of them'}: "
            "it runs as full remat (save-nothing).",
            cause, fix,
        )
    ]  # fmt: skip


def _why_no_dots(promise: Promise, facts: TagFacts | None) -> tuple[str, str]:
    """(cause, fix) for a dots policy that keeps no matmul output, from the matmuls the walk
    found inside remat segments (:attr:`TagFacts.remat_dots`)."""
    name_fix = "or name the values to keep with checkpoint_name and save those names."
    unbatched, batched, _ = facts.remat_dots if facts and facts.remat_dots else (None,) * 3
    if unbatched == 0 and batched == 0:
        return (
            "no matmul (dot_general) runs inside a remat segment: they are computed outside "
            "every jax.checkpoint / nn.remat / nnx.remat.",
            "put the layers' matmuls inside the checkpointed function, " + name_fix,
        )
    if promise.base == "dots_no_batch" and unbatched == 0:
        return (
            f"every matmul inside the remat segments ({batched} dot_general equations) has a "
            "batch dimension (a vmap over the layer, or batched einsums), and "
            "dots_with_no_batch_dims_saveable saves only matmuls without one.",
            "save-dots (dots_saveable) saves batched matmuls too; " + name_fix,
        )
    return (
        "the matmuls inside the remat segments are not residuals of the backward pass, or "
        "jax_remat3 runs the policy as full remat.",
        "name the values to keep with checkpoint_name and save those names.",
    )


def _ragged_recomputed(promise: Promise, facts: TagFacts | None) -> list[Finding]:
    """``ragged-dot-recomputed`` for a policy keeping matmuls by kind on a program with
    ``lax.ragged_dot`` inside its remat segments: JAX's dots policies match ``dot_general``
    only, so the experts' matmuls are recomputed whatever the policy's name says."""
    ragged = facts.remat_dots[2] if facts and facts.remat_dots else 0
    if promise.base not in ("dots", "dots_no_batch") or not ragged:
        return []
    return [
        Finding(
            "ragged-dot-recomputed", "warning",
            f"policy {promise.name!r} keeps matmul outputs, but not those of the {ragged} "
            "lax.ragged_dot equation(s) inside the remat segments (MoE experts grouped by "
            "expert): they are recomputed in the backward pass.",
            "JAX's dots policies (dots_saveable, dots_with_no_batch_dims_saveable) match "
            "dot_general only; ragged_dot_general is another primitive.",
            "name the experts' outputs with checkpoint_name and save those names (a per-tag "
            "policy, or jax.checkpoint_policies.save_from_both_policies with "
            "save_only_these_names); or accept the recompute.",
        )
    ]  # fmt: skip


def _names_kept_nowhere(
    promise: Promise, kept: Residuals, kept_no_remat: Residuals, facts: TagFacts | None
) -> list[Finding]:
    """``name-kept-nowhere`` for the emitted names of a policy that keeps others but not these,
    where the walk tells why (docs/doctor.md). Not for a policy keeping none of its names
    (``acts-as-full-remat``), a registered policy's list (MaxText's, for every model), or the
    names ``save_any_names_but_these`` saves."""
    if facts is None or promise.base != "names" or promise.registered or promise.by_exclusion:
        return []
    named = promise.tags & facts.emitted
    idle = named - kept.tags
    if not idle or idle == named:
        return []
    outside = facts.outside_remat(idle)
    if outside | (idle - outside - kept_no_remat.tags) != idle:
        return []  # the walk does not tell why: not said
    cause, _ = _why_not_kept(idle, kept_no_remat, facts)
    one, names = len(idle) == 1, ", ".join(sorted(idle))
    fix = f"leave {names} out of the policy" + (
        " (or apply its checkpoint_name inside the checkpointed function)." if outside else "."
    )
    return [
        Finding(
            "name-kept-nowhere", "warning",
            f"policy {promise.name!r} names {names} but "
            f"{'does not keep it' if one else 'keeps none of them'}, on device or host: that "
            "part of the policy does nothing.",
            cause, fix,
        )
    ]  # fmt: skip


def _why_not_kept(
    named: frozenset[str], kept_no_remat: Residuals, facts: TagFacts | None, outcome: str = ""
) -> tuple[str, str]:
    """(cause, fix) for emitted names the policy keeps none of, from the walk: applied only
    outside every remat segment (``outcome`` appended: what that means for this policy), only
    inside a ``custom_vjp`` forward rule, or not residuals even without remat (the backward
    pass does not need them)."""
    outside = facts.outside_remat(named) if facts is not None else frozenset()
    unneeded = named - outside - kept_no_remat.tags if facts is not None else frozenset()
    in_rule = named & facts.in_fwd_rule - unneeded if facts is not None else frozenset()
    if named and outside | unneeded | in_rule == named:
        parts = []
        if outside:
            one = len(outside) == 1
            parts.append(
                f"{', '.join(sorted(outside))} {'is' if one else 'are'} applied outside every "
                f"remat segment: {'it is' if one else 'they are'} stored or not regardless of "
                f"the policy{outcome}"
            )
        if in_rule:
            parts.append(
                f"{', '.join(sorted(in_rule))} {'is' if len(in_rule) == 1 else 'are'} applied "
                "only inside a custom_vjp forward rule, whose checkpoint_name JAX's remat does "
                "not see under jax_remat3 without jax_custom_vjp3 (classic remat does)"
            )
        if unneeded:
            parts.append(
                f"the backward pass does not need {', '.join(sorted(unneeded))}: even without "
                "remat none is a residual (a value that only feeds additions or the output)"
            )
        where = ", and apply checkpoint_name inside the checkpointed function" if outside else ""
        if in_rule:
            where += "; or name the custom_vjp's output outside its rules (or jax_custom_vjp3)"
        return "; ".join(parts) + ".", _save_instead(named, facts) + where + "."
    return (
        "its tags are not emitted inside the remat segment, or jax_remat3 runs the policy as "
        "full remat.",
        "check the tag names (remat-kit doctor lists them) and build the policy from name sets.",
    )


def _save_instead(named: frozenset[str], facts: TagFacts | None) -> str:
    """What to save instead: the program's names whose saving removes recompute (matmul
    outputs first), else how to find them."""
    savers = [t for t in facts.savers() if t not in named] if facts and facts.savers else []
    if savers:
        return (
            f"save (or offload) the tags whose saving removes recompute ({', '.join(savers)}; "
            "matmul outputs first)"
        )
    return (
        "save (or offload) tags applied inside the checkpointed function whose saving removes "
        "recompute "
        "(remat-kit analyze lists each own tag saved alone with its FLOPs)"
    )


def _offload_findings(
    promise: Promise,
    report: MemoryReport,
    target: T.Target,
    kept: Residuals,
    kept_no_remat: Residuals,
    facts: TagFacts | None,
) -> list[Finding]:
    host_res = kept.host_bytes
    if not target.supports_host_offload:
        return [
            Finding(
                "offload-ignored", "info",
                f"target {target.name!r} ignores host offload: the {nbytes(host_res)} that "
                f"policy {promise.name!r} offloads are counted as device memory.",
                "XLA:CPU compiles offloads as plain copies (host memory is device memory).",
                "analyze offload policies on a GPU target (e.g. --target h100-sxm).",
            )
        ]  # fmt: skip
    if facts is not None and promise.offload and not promise.offload & facts.emitted:
        return []  # offloads only names the program never emits: unknown-tag says it
    if report.host_bytes == 0:
        return [_no_host_bytes(promise, target, kept, kept_no_remat, facts)]
    without = report.peak_bytes_without_offload
    if without is not None and report.peak_bytes >= without:
        return [_no_device_saving(promise, report, without)]
    return []


def _no_device_saving(promise: Promise, report: MemoryReport, without: int) -> Finding:
    """``offload-no-device-saving``: the fix follows the measured comparison of the device
    peak with and without the offload."""
    peak, figures = report.peak_bytes, f"{nbytes(without)} vs {nbytes(report.peak_bytes)}"
    if peak > without * (1 + SAME):
        cause = (
            "the copies to and from host are live at the peak, or the peak is elsewhere "
            "(the optimizer update, the output head)."
        )
        fix = (
            f"keep those tensors on device: a lower peak ({figures} with the offload) and no "
            "transfer."
        )
    else:
        cause = "the peak is elsewhere (the optimizer update, the output head)."
        fix = (
            f"keep those tensors on device (the same peak, {figures} with the offload, and no "
            "transfer), or offload more."
        )
    return Finding(
        "offload-no-device-saving", "warning",
        f"policy {promise.name!r} moves {nbytes(report.host_bytes)} to host but the device peak "
        f"({nbytes(peak)}) is not below keeping them on device ({nbytes(without)}).",
        cause, fix,
    )  # fmt: skip


def _no_host_bytes(
    promise: Promise,
    target: T.Target,
    kept: Residuals,
    kept_no_remat: Residuals,
    facts: TagFacts | None,
) -> Finding:
    """``offload-no-host-bytes``; a fix in the program's own names for a user's program."""
    offload = promise.offload & (facts.emitted if facts else promise.offload)
    nothing = kept.host_bytes == 0 and bool(promise.offload)  # already nothing in the jaxpr
    if nothing:
        cause, _ = _why_not_kept(offload, kept_no_remat, facts, ", so no policy can offload it")
        what = (
            f"policy {promise.name!r} offloads nothing: 0 B to host in the jaxpr, and none in "
            f"the compiled step on {target.name!r}."
        )
    else:
        cause = (
            "XLA dropped the offload (the tensor is also needed on device, or the offloaded "
            "tags are not residuals here), or jax_remat3 ran the policy as full remat."
        )
        what = (
            f"policy {promise.name!r} offloads {nbytes(kept.host_bytes)} in the jaxpr, but the "
            f"compiled step on {target.name!r} has no host memory."
        )
    fix = "offload other tags (offload-layer-inputs / offload-to-host) and check again."
    if facts is not None and facts.user:
        needed = kept_no_remat.tags & (facts.in_remat or facts.emitted) - promise.offload
        example = own_example(facts, "offload", needed) if needed else ""
        fix = (
            f"offload a tag the backward pass keeps, e.g. {example}, and check again."
            if example
            else "offload a tensor the backward pass keeps (tag it with checkpoint_name)."
        )
    return Finding("offload-no-host-bytes", "error", what, cause, fix)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or hasattr(x, "shape") and hasattr(x, "dtype")


def check_remat_static_argnums(
    static_argnums: Sequence[int], call_args: Sequence[Any]
) -> list[Finding]:
    """Check ``nn.remat(Module, static_argnums=...)`` against a call's positional arguments.

    flax.linen counts ``self`` as argument 0, so ``static_argnums=(1,)`` marks the first argument
    after ``self``. An index pointing at ``self``, at an array (``jax.Array``, numpy array,
    ``jax.ShapeDtypeStruct``) or past the arguments is almost always the off-by-one of counting
    from the first argument instead.

    Args:
      static_argnums: the indices passed to ``nn.remat``.
      call_args: the positional arguments of one ``module(...)`` call, without ``self``.
    """
    out = []
    n = len(call_args)
    for i in static_argnums:
        j = i - 1  # position in call_args
        if 0 <= j < n and not _is_array(call_args[j]):
            continue
        what = "self" if j < 0 else ("past the arguments" if j >= n else "an array")
        # The argument the user most likely meant: the one at call position i, if not an array.
        meant = i if i < n and not _is_array(call_args[i]) else None
        fix = (
            f"use index {i + 1} for the argument at call position {i} (self is 0)."
            if meant is not None
            else f"static_argnums index k marks call argument k-1 (self is 0); valid indices "
            f"here are 1..{n}."
        )
        out.append(
            Finding(
                "static-argnums-self", "error",
                f"static_argnums={tuple(static_argnums)}: index {i} points at {what}.",
                "nn.remat counts self as argument 0 (flax.linen.remat docstring).",
                fix,
            )
        )  # fmt: skip
    return out
