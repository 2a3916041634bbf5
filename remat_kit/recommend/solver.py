"""The per-tag solver of recommend (``solve=True``): an additive model of bytes and FLOPs per
checkpoint tag, every combination of actions enumerated, those that could beat the pick at the
model's observed error compiled (:func:`verify_choices`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from remat_kit import targets as T
from remat_kit.memory.calibrate import figures_for
from remat_kit.memory.flops import step_flops
from remat_kit.memory.roofline import DeviceFigures
from remat_kit.names import CHECKPOINT_NAMES
from remat_kit.policies import TAG_ACTIONS, PolicySpec, custom_spec, get_policy_spec
from remat_kit.program import Placement, Program
from remat_kit.recommend.session import Session
from remat_kit.recommend.types import Candidate, SolveSummary, TagCost
from remat_kit.remat_impl import can_offload
from remat_kit.residuals import bytes_by_tag
from remat_kit.units import format_bytes, format_seconds

#: Custom-policy candidates compiled per verification round of :func:`verify_choices`.
SOLVE_VERIFY = 3
#: Verification rounds of :func:`verify_choices` at most (a note names the choices left).
SOLVE_ROUNDS = 2


def flops_step_time(
    figures: DeviceFigures,
    flops: float,
    flops_no_remat: float,
    host_bytes: int,
) -> tuple[float, float]:
    """``(compute_s, transfer_s)`` of the additive model ``solve`` predicts choices with.

    ``compute_s = flops / peak`` (bf16 matmul peak); offloaded bytes cross the host link once
    each way, device -> host during the forward pass (a third of the no-remat FLOPs) and back
    during the backward pass; only what cannot hide behind that pass counts.

    Args:
      figures: the device's figures (:func:`figures_for`).
      flops: matmul FLOPs of the choice; flops_no_remat: of the step without remat.
      host_bytes: bytes offloaded to host memory.
    """
    peak = figures.matmul_peak("bf16")
    compute = flops / peak
    link_bw = figures.host_link_bytes_per_s
    if host_bytes <= 0 or not link_bw:
        return compute, 0.0
    fwd = min(compute, flops_no_remat / 3 / peak)
    link = host_bytes / link_bw
    return compute, max(0.0, link - fwd) + max(0.0, link - (compute - fwd))


def solve_tags_of(program: Program, tags: frozenset[str]) -> tuple[str, ...]:
    """The tags the solver chooses for, in a fixed order: remat-kit's (MaxText's) names in
    their order, then the program's own names alphabetically."""
    known = list(CHECKPOINT_NAMES)
    return tuple(sorted(tags, key=lambda t: (known.index(t) if t in known else len(known), t)))


def tag_costs(
    program: Program, tags: Sequence[str], placement: Placement
) -> tuple[list[TagCost], float]:
    """The solver's per-tag bytes and recompute FLOPs (see :class:`TagCost`), and the jaxpr
    matmul FLOPs of the step saving nothing. Traces only, nothing compiled.

    Bytes: the program's residual table (:meth:`~remat_kit.program.Program.residuals`, per
    device) under a policy that saves every tag, and under ``save-nothing`` for what is kept
    anyway. FLOPs: jaxpr matmul FLOPs of the whole train step saving nothing, minus those
    saving only the tag (one trace per tag, about 0.3 s each for llama3-8b). Additivity
    (keeping A and B saves ``flops_saved[A] + flops_saved[B]``) holds when a tag's producing
    matmul is recomputed only to produce that tag, as JAX's partial evaluation does for the
    bundled block: on llama3-8b, saving q, k, v and out_proj together saves 21.99 TFLOP, the
    sum of the four alone.
    """
    everything = custom_spec({t: "save" for t in tags})
    kept = bytes_by_tag(program.residuals(everything, placement) or (), memory=None)
    base = bytes_by_tag(program.residuals(get_policy_spec("save-nothing"), placement) or ())

    f0 = step_flops(program, custom_spec({}))
    costs = []
    for t in tags:
        nbytes, base_bytes = kept.get(t, 0), base.get(t, 0)
        saved = 0.0
        if nbytes > base_bytes:
            saved = max(0.0, f0 - step_flops(program, custom_spec({t: "save"})))
        costs.append(TagCost(tag=t, nbytes=nbytes, base_bytes=base_bytes, flops_saved=saved))
    return costs, f0


def _predict(costs: Sequence[TagCost], choice: Sequence[str], peak0: int) -> tuple[int, int, float]:
    """(device peak, host bytes, jaxpr FLOPs not recomputed) of a per-tag choice."""
    peak, host, saved = peak0, 0, 0.0
    for tc, action in zip(costs, choice, strict=True):
        if action == "save":
            peak += max(tc.nbytes, tc.base_bytes) - tc.base_bytes
            saved += tc.flops_saved
        elif action == "offload":
            peak -= tc.base_bytes
            host += tc.nbytes
            saved += tc.flops_saved
    return peak, host, saved


def solve_tags(
    session: Session,
    batch: int,
    save_nothing: Candidate,
    named: Sequence[tuple[PolicySpec, Candidate, Any]],
) -> SolveSummary:
    """The per-tag choice (recompute, save, offload) with the least predicted step time that
    fits, verified by compiling it.

    Model, additive over tags around the compiled ``save-nothing`` step of the same shape::

        peak(choice)  = peak(save-nothing) + sum over tags of the device bytes its action adds
                        (save: nbytes - base_bytes; offload: -base_bytes; recompute: 0)
        host(choice)  = sum of nbytes over offloaded tags
        flops(choice) = (jaxpr FLOPs(save-nothing) - sum of flops_saved over kept tags) * scale

    ``scale`` = compiled / jaxpr FLOPs of ``save-nothing`` (what XLA adds on its own). Every
    choice is enumerated (the search is exact under the model; 3^9 = 19,683 for a SwiGLU block,
    fewer once choices that cannot help are dropped: saving a tag that saves no FLOPs, such as
    ``mlpwo`` or the segment input at group size 1), ranked by predicted step time, then (on
    ties: transfers fully hidden) host bytes, then device peak; choices equal in all three are
    one candidate (``mlpwi_0`` and ``mlpwi_1`` swapped). Which are compiled:
    :func:`verify_choices` (the model's observed error decides). Only compiled candidates are
    returned.
    """
    program = session.program
    tags = solve_tags_of(program, session.tags)
    costs, fj0 = tag_costs(program, tags, program.place(session.target))
    actions = TAG_ACTIONS if can_offload(session.target) else ("save", "recompute")
    model = ChoiceModel.around(session.target, costs, actions, save_nothing, fj0)

    def compile_specs(specs: Sequence[PolicySpec]) -> list[Candidate | None]:
        found = {s: c for s, c, _ in session.candidates(specs, None, batch, "solve")}
        return [found.get(s) for s in specs]

    return verify_choices(model, named, session.budget, compile_specs, session.room, session.notes)


@dataclasses.dataclass(frozen=True)
class ChoiceModel:
    """The additive model of :func:`solve_tags` around a compiled ``save-nothing``: per-tag
    costs, the actions allowed, and every choice ranked (see :func:`_ranked_choices`).
    ``peak0``: save-nothing's compiled peak (bytes); ``fj0``: its jaxpr FLOPs; ``scale``:
    compiled / jaxpr FLOPs; ``combinations``: how many choices were enumerated."""

    target: T.Target
    costs: tuple[TagCost, ...]
    actions: tuple[str, ...]
    peak0: int
    fj0: float
    scale: float
    flops_no_remat: float
    ranked: tuple[tuple, ...]
    combinations: int
    figures: DeviceFigures | None = None
    #: Seconds added to the additive model to put it on the compiled roofline's scale.
    offset_s: float = 0.0

    @classmethod
    def around(
        cls, target: T.Target, costs: Sequence[TagCost], actions: Sequence[str],
        save_nothing: Candidate, fj0: float,
    ) -> ChoiceModel:  # fmt: skip
        """Enumerate and rank every choice around the compiled ``save_nothing``."""
        scale = (save_nothing.flops or fj0) / fj0 if fj0 else 1.0
        peak0, fnr = save_nothing.peak_bytes, save_nothing.flops_no_remat or 0.0
        figures = figures_for(target)
        # Anchor: save-nothing's compiled roofline time less the additive model's own figure
        # for it, so predictions and compiled times are on one scale.
        base = sum(flops_step_time(figures, fj0 * scale, fnr, 0))
        offset = save_nothing.step_time_s - base if save_nothing.step_time_s < math.inf else 0.0
        ranked, combos = _ranked_choices(
            figures, costs, _options(costs, actions), peak0, fj0, scale, fnr, math.inf, offset
        )
        return cls(
            target, tuple(costs), tuple(actions), peak0, fj0, scale, fnr, tuple(ranked), combos,
            figures, offset,
        )  # fmt: skip

    def predict(self, choice: Sequence[str]) -> tuple[float, int]:
        """(predicted step seconds, predicted device peak bytes) of ``choice``."""
        peak, host, saved = _predict(self.costs, choice, self.peak0)
        compute, transfer = flops_step_time(
            self.figures, (self.fj0 - saved) * self.scale, self.flops_no_remat, host
        )
        return self.offset_s + compute + transfer, peak

    def actions_of(self, choice: Sequence[str]) -> dict[str, str]:
        """The kept tags of ``choice`` and their actions (recomputed tags left out)."""
        pairs = zip(self.costs, choice, strict=True)
        return {tc.tag: a for tc, a in pairs if a != "recompute"}


#: A compiled choice: (choice, predicted s, predicted peak bytes, compiled s, compiled peak bytes).
_Point = tuple[tuple[str, ...], float, int, float, int]


def model_error(points: Sequence[_Point]) -> tuple[int | None, float]:
    """The model's observed error over compiled choices other than recompute-everything (the
    anchor, exact by construction): the largest |compiled - predicted| peak (bytes; None when
    no such choice was compiled: unmeasured), and the largest relative step-time error (0.0
    when unmeasured)."""
    informative = [p for p in points if any(a != "recompute" for a in p[0])]
    peak_err = max((abs(p[4] - p[2]) for p in informative), default=None)
    time_err = max((abs(p[3] - p[1]) / p[1] for p in informative if p[1] > 0), default=0.0)
    return peak_err, time_err


def _could_win(
    model: ChoiceModel, points: Sequence[_Point], budget: int, best_s: float | None
) -> list[tuple]:
    """The uncompiled choices, best predicted first, that could fit ``budget`` and beat the
    fastest fitting compiled step ``best_s`` (seconds) at the model's observed error. While the
    peak error is unmeasured, a choice's prediction may be off by all it adds to or takes from
    save-nothing's peak (so a choice adding bytes is ruled out only when save-nothing itself
    does not fit)."""
    peak_err, time_err = model_error(points)
    done = {p[0] for p in points}
    return [
        r for r in _distinct_choices(model.ranked)
        if r[4] not in done
        and r[2] - (abs(r[2] - model.peak0) if peak_err is None else peak_err) <= budget
        and (best_s is None or r[0] * (1.0 - time_err) < best_s)
    ]  # fmt: skip


def verify_choices(
    model: ChoiceModel,
    named: Sequence[tuple[PolicySpec, Candidate, Any]],
    budget: int,
    compile_specs: Callable[[Sequence[PolicySpec]], list[Candidate | None]],
    room: Callable[[], int],
    notes: list[str],
) -> SolveSummary:
    """Compile the per-tag choices that could beat the pick, calibrating the model as they come.

    The model's error (:func:`model_error`) is measured on every compiled choice it can
    express: the named policies selecting by tag, then each solve compile. Each round compiles
    the :data:`SOLVE_VERIFY` predicted-fastest uncompiled choices whose predicted peak is within
    that error of ``budget`` and whose predicted time, less that relative error, beats the
    fastest fitting compiled candidate (:func:`_could_win`); at most :data:`SOLVE_ROUNDS`
    rounds and ``room()`` compiles. It stops when no uncompiled choice could beat the pick;
    otherwise a note names those left and why. A choice a named policy already compiled is not
    compiled again. ``compile_specs``: candidates of the specs (None for a failed compile).
    """
    calibration, points = [], []
    for spec, c, _ in named:
        choice = _named_choice(model.costs, spec)
        if choice is not None:
            t_pred, p_pred = model.predict(choice)
            calibration.append((spec.name, p_pred, c.peak_bytes))
            points.append((choice, t_pred, p_pred, c.step_time_s, c.peak_bytes))
    fitting = [c.step_time_s for _, c, _ in named if c.fits]
    best_s = min(fitting) if fitting else None
    verified: list[Candidate] = []
    failed: set[tuple[str, ...]] = set()
    for _ in range(SOLVE_ROUNDS):
        todo = [r for r in _could_win(model, points, budget, best_s) if r[4] not in failed]
        todo = todo[: min(SOLVE_VERIFY, room())]
        if not todo:
            break
        specs = [custom_spec(model.actions_of(r[4])) for r in todo]
        for r, c in zip(todo, compile_specs(specs), strict=True):
            if c is None:
                failed.add(r[4])
                continue
            points.append((r[4], r[0], r[2], c.step_time_s, c.peak_bytes))
            verified.append(
                dataclasses.replace(c, predicted_peak_bytes=r[2], predicted_step_time_s=r[0])
            )
            if c.fits:
                best_s = c.step_time_s if best_s is None else min(best_s, c.step_time_s)
    left = [r for r in _could_win(model, points, budget, best_s) if r[4] not in failed]
    _note_left(model, left, room(), notes)
    if not verified and not left and not failed and best_s is not None:
        notes.append(
            "solve: no per-tag choice is predicted to beat the fastest fitting candidate "
            f"({format_seconds(best_s)} per step), even allowing for the prediction error seen "
            "so far; none compiled"
        )
    peak_err, _ = model_error(points)
    return SolveSummary(
        tags=model.costs, actions=model.actions, combinations=model.combinations,
        predicted_fit=sum(r[2] <= budget + (peak_err or 0) for r in model.ranked),
        peak_slack_bytes=peak_err, flops_scale=model.scale, verified=tuple(verified),
        calibration=tuple(calibration),
    )  # fmt: skip


def _note_left(model: ChoiceModel, left: Sequence[tuple], room: int, notes: list[str]) -> None:
    """A note naming the uncompiled choices that could still beat the pick, and why."""
    if not left:
        return
    why = "compile cap reached" if room <= 0 else f"{SOLVE_ROUNDS} rounds of {SOLVE_VERIFY} spent"

    def label(choice: Sequence[str]) -> str:
        acts = model.actions_of(choice)
        return "; ".join(f"{a} {t}" for t, a in acts.items()) or "recompute all"

    shown = "; ".join(
        f"[{label(r[4])}] predicted {format_bytes(r[2])}, {format_seconds(r[0])}" for r in left[:3]
    )
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    notes.append(
        f"solve: {len(left)} per-tag choice(s) that could still beat the pick (allowing for the "
        f"prediction error seen so far) were not compiled ({why}): {shown}{more}"
    )


def _named_choice(costs: Sequence[TagCost], spec: PolicySpec) -> tuple[str, ...] | None:
    """The per-tag choice a named policy makes, when the model can express it."""
    if spec.base == "names" and spec.wrap and spec.tags <= {tc.tag for tc in costs}:
        return tuple(spec.action(tc.tag) for tc in costs)
    return None


def _options(costs: Sequence[TagCost], actions: Sequence[str]) -> list[list[str]]:
    """Per tag, the actions worth trying: saving a tag that saves no FLOPs is dropped, and
    offloading one that neither saves FLOPs nor frees a segment input."""
    choices = []
    for tc in costs:
        opts = ["recompute"]
        if "save" in actions and tc.flops_saved > 0:
            opts.append("save")
        if "offload" in actions and (tc.flops_saved > 0 or tc.base_bytes > 0):
            opts.append("offload")
        choices.append(opts)
    return choices


def _ranked_choices(
    figures: DeviceFigures,
    costs: Sequence[TagCost],
    options: Sequence[Sequence[str]],
    peak0: int,
    jaxpr_flops0: float,
    scale: float,
    flops_no_remat: float,
    limit: float,
    offset_s: float = 0.0,
) -> tuple[list[tuple], int]:
    """Every per-tag choice enumerated; those predicted at or under ``limit`` bytes, as
    ``(step s, host bytes, peak bytes, tags kept, choice)`` sorted: least time, on a tie (transfers
    fully hidden) least host traffic, then least memory. Also returns how many were enumerated.
    ``jaxpr_flops0``: jaxpr FLOPs of ``save-nothing``; ``scale``: compiled / jaxpr FLOPs."""
    ranked = []
    combos = 0
    for choice in itertools.product(*options):
        combos += 1
        peak, host, saved = _predict(costs, choice, peak0)
        if peak > limit:
            continue
        compute, transfer = flops_step_time(
            figures, (jaxpr_flops0 - saved) * scale, flops_no_remat, host
        )
        kept = sum(a != "recompute" for a in choice)
        ranked.append((offset_s + compute + transfer, host, peak, kept, choice))
    ranked.sort(key=lambda r: r[:4])
    return ranked, combos


def _distinct_choices(ranked: Sequence[tuple]) -> list[tuple]:
    """Choices the model cannot tell apart (``mlpwi_0`` and ``mlpwi_1`` swapped) kept once."""
    distinct, seen = [], set()
    for r in ranked:
        if r[:3] not in seen:
            seen.add(r[:3])
            distinct.append(r)
    return distinct


def solve(
    session: Session, named: Sequence[tuple[PolicySpec, Candidate, Any]], batch: int
) -> SolveSummary | None:
    """:func:`solve_tags` around ``save-nothing`` (compiled here if not among ``named``); None,
    with a note, without the program's loss, without checkpoint tags, or when save-nothing
    does not compile."""
    if session.program.make_loss is None:
        session.notes.append("solve skipped: it needs the program's loss for residuals by tag")
        return None
    if not session.tags:
        session.notes.append("solve skipped: the program emits no checkpoint_name tags")
        return None
    sn = next((c for s, c, _ in named if s.name == "save-nothing"), None)
    if sn is None:
        found = session.candidates([get_policy_spec("save-nothing")], None, batch, "named")
        named = [*named, *found]
        sn = found[0][1] if found else None
    if sn is None:
        session.notes.append("solve skipped: save-nothing did not compile")
        return None
    return solve_tags(session, batch, sn, named)
