"""The per-tag solver of recommend (``solve=True``): an additive model of bytes and FLOPs per
checkpoint tag, every combination of actions enumerated, the best predicted few compiled."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from remat_kit import targets as T
from remat_kit.memory import model_residuals
from remat_kit.memory.flops import traced_flops
from remat_kit.models.config import ModelConfig
from remat_kit.policies import TAG_ACTIONS, PolicySpec, custom_spec, get_policy_spec
from remat_kit.recommend.session import Session
from remat_kit.recommend.timing import step_time
from remat_kit.recommend.types import Candidate, SolveSummary, TagCost
from remat_kit.residuals import bytes_by_tag
from remat_kit.training.step import (
    abstract_batch,
    abstract_train_state,
    make_optimizer,
    make_train_step,
)

#: Custom-policy candidates compiled per verification round of :func:`solve_tags`.
SOLVE_VERIFY = 3
#: Verification rounds of :func:`solve_tags` before it gives up.
SOLVE_ROUNDS = 2


def tag_costs(
    config: ModelConfig, batch_size: int, seq_len: int, optimizer: str = "adamw"
) -> tuple[list[TagCost], float]:
    """The solver's per-tag bytes and recompute FLOPs (see :class:`TagCost`), and the jaxpr
    matmul FLOPs of the step saving nothing. Traces only, nothing compiled.

    Bytes: the jaxpr residual table (:func:`remat_kit.memory.model_residuals`) of a policy that
    saves every tag, and of ``save-nothing`` for what is kept anyway. FLOPs: jaxpr matmul FLOPs
    of the whole train step saving nothing, minus those saving only the tag (one trace per tag,
    about 0.3 s each for llama3-8b). Additivity (keeping A and B saves ``flops_saved[A] +
    flops_saved[B]``) holds when a tag's producing matmul is recomputed only to produce that tag,
    as JAX's partial evaluation does for the bundled block: on llama3-8b, saving q, k, v and
    out_proj together saves 21.99 TFLOP, the sum of the four alone.
    """
    opt = make_optimizer(optimizer)
    tags = list(config.checkpoint_names)
    everything = config.replace(remat_policy=custom_spec({t: "save" for t in tags}))
    kept = bytes_by_tag(model_residuals(everything, batch_size, seq_len), memory=None)
    nothing = config.replace(remat_policy="save-nothing")
    base = bytes_by_tag(model_residuals(nothing, batch_size, seq_len))
    state = abstract_train_state(config, opt)
    batch = abstract_batch(batch_size, seq_len)

    def flops(spec: PolicySpec) -> float:
        step = make_train_step(config.replace(remat_policy=spec), opt, jit=False)
        return traced_flops(step, state, batch)

    f0 = flops(custom_spec({}))
    costs = []
    for t in tags:
        nbytes, base_bytes = kept.get(t, 0), base.get(t, 0)
        saved = max(0.0, f0 - flops(custom_spec({t: "save"}))) if nbytes > base_bytes else 0.0
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
    ``mlpwo`` or the segment input at group size 1). The choices predicted to fit within
    ``budget + slack`` are ranked by predicted step time, then (on ties: transfers fully hidden)
    host bytes, then device peak; choices equal in all three are one candidate (``mlpwi_0`` and
    ``mlpwi_1`` swapped). They are compiled in that order, :data:`SOLVE_VERIFY` per round, at
    most :data:`SOLVE_ROUNDS` rounds, stopping after the first round with a fit. ``slack`` is
    the model's largest overestimate of a compiled named policy it can express, so a choice the
    compiler would fit is not dropped for the model's pessimism; a choice it underestimates is
    caught by the compile. Only compiled candidates are returned.
    """
    costs, fj0 = tag_costs(session.config, batch, session.seq_len, session.optimizer)
    actions = TAG_ACTIONS if session.target.supports_host_offload else ("save", "recompute")
    peak0 = save_nothing.peak_bytes
    scale = (save_nothing.flops or fj0) / fj0 if fj0 else 1.0
    calibration = _calibration(costs, named, peak0)
    slack = max([0] + [p - c for _, p, c in calibration])
    ranked, combos = _ranked_choices(
        session.target, costs, _options(costs, actions), peak0, fj0, scale,
        save_nothing.flops_no_remat or 0.0, session.budget + slack,
    )  # fmt: skip
    return SolveSummary(
        tags=tuple(costs),
        actions=tuple(actions),
        combinations=combos,
        predicted_fit=len(ranked),
        peak_slack_bytes=int(slack),
        flops_scale=scale,
        verified=tuple(_verify(session, costs, _distinct_choices(ranked), batch)),
        calibration=tuple(calibration),
    )


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


def _calibration(
    costs: Sequence[TagCost], named: Sequence[tuple[PolicySpec, Candidate, Any]], peak0: int
) -> list[tuple[str, int, int]]:
    """(policy, predicted peak, compiled peak) of the named policies the model can express."""
    known = {tc.tag for tc in costs}
    calibration = []
    for spec, c, _ in named:
        if spec.base == "names" and spec.wrap and spec.tags <= known:
            predicted, _, _ = _predict(costs, [spec.action(tc.tag) for tc in costs], peak0)
            calibration.append((spec.name, predicted, c.peak_bytes))
    return calibration


def _ranked_choices(
    target: T.Target,
    costs: Sequence[TagCost],
    options: Sequence[Sequence[str]],
    peak0: int,
    jaxpr_flops0: float,
    scale: float,
    flops_no_remat: float,
    limit: float,
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
        compute, transfer = step_time(target, (jaxpr_flops0 - saved) * scale, flops_no_remat, host)
        kept = sum(a != "recompute" for a in choice)
        ranked.append((compute + transfer, host, peak, kept, choice))
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


def _verify(
    session: Session, costs: Sequence[TagCost], distinct: Sequence[tuple], batch: int
) -> list[Candidate]:
    """Compile the best predicted choices, :data:`SOLVE_VERIFY` per round, at most
    :data:`SOLVE_ROUNDS` rounds, stopping after the first round with a fit."""
    g0 = session.config.remat_group_size
    verified: list[Candidate] = []
    tried = 0
    for _ in range(SOLVE_ROUNDS):
        todo = distinct[tried : tried + min(SOLVE_VERIFY, session.room())]
        if not todo:
            if tried < len(distinct):
                session.notes.append("solve: compile cap reached before a verified fit")
            break
        tried += len(todo)
        specs = [
            custom_spec({tc.tag: a for tc, a in zip(costs, ch, strict=True) if a != "recompute"})
            for *_, ch in todo
        ]
        reports = session.evaluate(specs, g0, batch)
        for (t_pred, _, p_pred, _, _), spec, report in zip(todo, specs, reports, strict=True):
            c = session.candidate(report, spec, g0, batch, "solve", session.seq_len)
            if c is not None:
                verified.append(
                    dataclasses.replace(
                        c, predicted_peak_bytes=p_pred, predicted_step_time_s=t_pred
                    )
                )
        if any(c.fits for c in verified):
            break
    return verified


def solve(
    session: Session, named: Sequence[tuple[PolicySpec, Candidate, Any]], batch: int
) -> SolveSummary | None:
    """:func:`solve_tags` around ``save-nothing`` (compiled here if not among ``named``); None,
    with a note, when it does not compile."""
    sn = next((c for s, c, _ in named if s.name == "save-nothing"), None)
    if sn is None:
        found = session.candidates(
            [get_policy_spec("save-nothing")], session.config.remat_group_size, batch, "named"
        )
        sn = found[0][1] if found else None
    if sn is None:
        session.notes.append("solve skipped: save-nothing did not compile")
        return None
    return solve_tags(session, batch, sn, named)
