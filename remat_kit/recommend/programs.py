"""recommend for a user's :class:`~remat_kit.Program` (``recommend(program, target=...)``).

The same answer as for a preset, on the program's own arguments (no batch, sequence or group
size to vary: the program carries them):

1. The tags the program's step emits (:func:`remat_kit.memory.programs.program_tags`).
2. The named policies that can do something on it: the ones selecting by kind (``save-dots``,
   ``save-dots-no-batch``, ``save-everything``...), ``save-nothing``, ``no-remat``, and the
   name-based ones whose tags the program emits. One that names none of them is skipped (it
   would run as ``save-nothing``); one that names some it does not emit is compiled restricted to
   the emitted ones, as a custom policy, so no pick needs a tag the program never emits.
   All compiled together by :func:`remat_kit.memory.programs.analyze_program`.
3. ``solve=True`` (and the program gives its loss): the per-tag choices (save, offload,
   recompute) over the emitted tags, under the additive model of :func:`~.solver.solve_tags`
   fed with the program's residual bytes by tag and its traced FLOPs; the best predicted few
   are compiled.
4. The pick: the fitting compiled candidate with the least estimated step time
   (:func:`~.timing.rank`); when none fits, the least-memory one and the budget it needs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from remat_kit import targets as T
from remat_kit.memory.flops import traced_flops
from remat_kit.memory.programs import analyze_program, program_tags
from remat_kit.policies import (
    TAG_ACTIONS,
    PolicySpec,
    custom_spec,
    get_policy_spec,
    policies_for_tags,
    policy_names,
)
from remat_kit.program import Program
from remat_kit.recommend.budget import DEFAULT_MARGIN, resolve_budget
from remat_kit.recommend.session import counting, to_candidate
from remat_kit.recommend.solver import ChoiceModel, verify_choices
from remat_kit.recommend.timing import figures_for, host_link_source, rank, time_model_note
from remat_kit.recommend.types import Candidate, Recommendation, SolveSummary, TagCost
from remat_kit.remat_impl import can_offload, honoured
from remat_kit.residuals import bytes_by_tag, group_by_tag, saved_residuals
from remat_kit.units import format_bytes as _gib

#: A compiled policy: its spec, its candidate and the analyzer's report.
Named = tuple[PolicySpec, Candidate, Any]


@dataclasses.dataclass
class _Run:
    """One call's fixed inputs and its notes."""

    program: Program
    target: T.Target
    budget: int
    tags: frozenset[str]
    workers: int | None
    max_compiles: int
    notes: list[str]
    margin: float = DEFAULT_MARGIN
    #: Registered policies cut down to the emitted tags (compiled as custom specs).
    derived: frozenset[PolicySpec] = frozenset()


def program_specs(
    target: T.Target,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None,
    tags: frozenset[str],
    program: str,
) -> tuple[list[PolicySpec], list[str], frozenset[PolicySpec]]:
    """The policies worth compiling on a program emitting ``tags``, what was skipped or
    restricted (see the module docstring), and the custom specs registered policies were cut
    down to. A user's own spec is kept as given (the analyzer checks its tags against the
    emitted ones).

    Raises:
      ValueError: unknown policy; nothing left to compile.
    """
    given = list(policies) if policies is not None else policy_names()
    if not given:
        raise ValueError("policies is empty: give at least one policy name")
    fit = policies_for_tags(given, tags)
    specs = [s for s in fit.specs if target.supports_host_offload or not s.offloads]
    notes = fit.notes(program)
    no_host = [s.name for s in fit.specs if s not in specs]
    if no_host:
        notes.append(f"not compiled: {', '.join(no_host)} (offload; {target.name} does not)")
    specs, wrong = honoured(specs)  # never picked for what the other remat would do
    notes += wrong
    if not specs:
        raise ValueError(f"no policy given can act on {program} (emits: {', '.join(sorted(tags))})")
    return specs, notes, frozenset(cut for _, cut in fit.restricted)


def _compile(run: _Run, specs: Sequence[PolicySpec], found_by: str) -> list[Named]:
    """Compile ``specs`` on the program together; failures become notes."""
    reports = analyze_program(
        run.program, list(specs), run.target, budget_bytes=run.budget, top_k=0,
        workers=run.workers, raise_errors=False, compare_offload=False,
        separate_xla_remat=False,  # candidates use the compiled FLOPs: no pass-off compile
    )  # fmt: skip
    out = []
    for spec, report in zip(specs, reports, strict=True):
        c = to_candidate(report, spec, run.target, run.budget, run.notes, found_by)
        if c is not None and found_by == "named" and spec in run.derived:
            c = dataclasses.replace(c, found_by="named")  # a named policy, cut down
        if c is not None:
            out.append((spec, c, report))
    return out


def _kept_bytes(program: Program, spec: PolicySpec, tags: frozenset[str]) -> dict[str, int]:
    """Device bytes of the residuals the loss keeps under ``spec``, by emitted tag."""
    loss = program.loss(spec)
    rows = group_by_tag(saved_residuals(loss.fn, *loss.args))
    return {t: n for t, n in bytes_by_tag(rows).items() if t in tags}


def program_tag_costs(program: Program, tags: frozenset[str]) -> tuple[list[TagCost], float]:
    """The solver's :class:`TagCost` per emitted tag, from the program's loss (residual bytes
    saving every tag and saving nothing) and its step's jaxpr matmul FLOPs (saving nothing, and
    saving each tag alone); and the FLOPs saving nothing. Traces only."""
    kept = _kept_bytes(program, custom_spec({t: "save" for t in tags}), tags)
    base = _kept_bytes(program, get_policy_spec("save-nothing"), tags)

    def flops(spec: PolicySpec) -> float:
        pure = program.step(spec)
        return traced_flops(pure.fn, *pure.args)

    f0 = flops(custom_spec({}))
    costs = []
    for t in sorted(tags):
        nbytes, base_bytes = kept.get(t, 0), base.get(t, 0)
        saved = max(0.0, f0 - flops(custom_spec({t: "save"}))) if nbytes > base_bytes else 0.0
        costs.append(TagCost(tag=t, nbytes=nbytes, base_bytes=base_bytes, flops_saved=saved))
    return costs, f0


def solve_program(run: _Run, named: list[Named], compiles: Any) -> SolveSummary | None:
    """Per-tag choices over the emitted tags (see :func:`~.solver.solve_tags` for the model),
    those that could beat the pick compiled (:func:`~.solver.verify_choices`); None, with a
    note, without a loss or a compiled save-nothing."""
    if run.program.make_loss is None:
        run.notes.append("solve skipped: it needs the program's loss for residuals by tag")
        return None
    if not run.tags:
        run.notes.append("solve skipped: the program emits no checkpoint_name tags")
        return None
    sn = next((c for s, c, _ in named if s.name == "save-nothing"), None)
    if sn is None:
        found = _compile(run, [get_policy_spec("save-nothing")], "named")
        named += found
        sn = found[0][1] if found else None
    if sn is None:
        run.notes.append("solve skipped: save-nothing did not compile")
        return None
    costs, fj0 = program_tag_costs(run.program, run.tags)
    actions = TAG_ACTIONS if can_offload(run.target) else ("save", "recompute")
    model = ChoiceModel.around(run.target, costs, actions, sn, fj0)

    def compile_specs(specs: Sequence[PolicySpec]) -> list[Candidate | None]:
        found = {spec: c for spec, c, _ in _compile(run, specs, "solve")}
        return [found.get(spec) for spec in specs]

    def room() -> int:
        return max(0, run.max_compiles - compiles.count)

    return verify_choices(model, named, run.budget, compile_specs, room, run.notes)


def program_advice(run: _Run, candidates: Sequence[Candidate]) -> list[str]:
    """When nothing fits: the least-memory candidate and the budget it needs (compiled), then
    only what can be done for a program (its factory's shapes, a GPU with more memory, sharding
    inside its own step); no command that takes presets only (``analyze --devices/--mesh``)."""
    if not candidates:
        return ["no candidate compiled (see the notes)"]
    least = min(candidates, key=lambda c: (c.peak_bytes, c.step_time_s))
    lines = [
        f"the least-memory configuration, {least.label}, peaks at {_gib(least.peak_bytes)}: "
        f"{_gib(least.peak_bytes - run.budget)} over the budget; a budget of "
        f"{_gib(least.peak_bytes)} fits it (compiled)",
        f"smaller batch or shorter sequence: change the argument shapes {run.program.name!r} "
        "is built with (its factory) and run recommend again",
    ]
    usable = run.target.memory_bytes and run.target.memory_bytes * (1 - run.margin)
    if not usable or usable < least.peak_bytes:
        bigger = [
            t.name for t in sorted(T.TARGETS.values(), key=lambda t: t.memory_bytes or 0)
            if t.memory_bytes and t.peak_flops_bf16 and t.name != run.target.name
            and t.memory_bytes * (1 - run.margin) >= least.peak_bytes
        ]  # fmt: skip
        if bigger:
            lines.append(
                f"a GPU with more memory: {', '.join(bigger)} (memory less the "
                f"{run.margin:.0%} margin holds {_gib(least.peak_bytes)}); run recommend again "
                f"with --target {bigger[0]} (it compiles there anew)"
            )
    lines.append(
        "more devices: shard parameters and optimizer state inside the program's own step "
        "(FSDP with jax.sharding); recommend and analyze compile a program on one device "
        "as given, so they cannot check that sharding for you"
    )
    return lines


def recommend_program(
    program: Program,
    target: str | T.Target = "h100-sxm",
    *,
    budget: int | float | str | None = None,
    solve: bool = False,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    margin: float = DEFAULT_MARGIN,
    max_compiles: int | None = None,
    workers: int | None = None,
) -> Recommendation:
    """:func:`remat_kit.recommend.recommend` for a user's program (its arguments there).

    Raises:
      ValueError: unknown target or policy; a target without device figures, or without memory
        and no ``budget``; a bad ``budget`` or ``margin``; a user's spec naming a tag the
        program does not emit; no policy that can act on the program.
    """
    t_start = time.perf_counter()
    tgt = T.get_target(target)
    figures_for(tgt)  # raises, naming the targets that have them, when steps cannot be timed
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    budget_bytes, budget_note = resolve_budget(tgt, budget, margin)
    tags = program_tags(program)
    specs, notes, derived = program_specs(tgt, policies, tags, f"program {program.name!r}")
    cap = max_compiles if max_compiles is not None else 2 * len(specs)
    run = _Run(
        program, tgt, budget_bytes, tags, workers, max(cap, len(specs)), notes, margin, derived
    )
    fn = program.step(get_policy_spec("no-remat")).fn
    name = getattr(fn, "__name__", "step")
    summary = None
    with counting((name, f"jit({name})")) as counter:
        named = _compile(run, specs, "named")
        if solve:
            summary = solve_program(run, named, counter)
        compiles = counter.count
    candidates = [c for _, c, _ in named] + list(summary.verified if summary else ())
    pick = min((c for c in candidates if c.fits), key=rank, default=None)
    arguments = next((dict(r.arguments) for _, _, r in named), {})
    return Recommendation(
        model=program.name, target=tgt.name, seq_len=None, batch_size=None, optimizer=None,
        budget_bytes=budget_bytes, budget_note=budget_note, arguments=arguments, pick=pick,
        candidates=tuple(candidates), largest_batch=(), compiles=compiles, reused=0,
        wall_s=round(time.perf_counter() - t_start, 2),
        advice=() if pick is not None else tuple(program_advice(run, candidates)),
        notes=(time_model_note(tgt), *run.notes), solve=summary, peak_flops=tgt.peak_flops_bf16,
        host_link_bytes_per_s=tgt.host_link_bytes_per_s, host_link=host_link_source(tgt),
        tags=tuple(sorted(tags)),
    )  # fmt: skip
