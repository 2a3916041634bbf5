"""The entry point :func:`recommend`, as named stages, for any :class:`~remat_kit.program.Program`.

Searches that vary the model (batch, group size, structure) need a
:attr:`~remat_kit.program.Program.family` (a preset's); a user's program gets the named policies
on its tags and the per-tag solver. Stages: :func:`resolve_request`, :func:`open_session`,
:func:`compile_named`, :func:`search_largest_batch` or :func:`search_fixed_batch`,
:func:`search_structure_options`, :func:`advise` (nothing fits), :func:`assemble`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from remat_kit import targets as T
from remat_kit.memory.calibration import figures_for
from remat_kit.memory.policy_set import policy_set
from remat_kit.memory.roofline import estimate_error, small_step_note, time_model_note
from remat_kit.memory.runner import CompileEngine
from remat_kit.memory.xla_compile import jax_backend_description
from remat_kit.policies import (
    PolicySpec,
    honoured,
    policy_label,
    policy_names,
)
from remat_kit.program import Program
from remat_kit.recommend.search import (
    BudgetTooSmall,
    Named,
    advice,
    distinct,
    fixed_program_advice,
    group_search,
    largest_batch,
    made_fit,
    search_partial_layers,
    search_structure,
    solve,
    structure_compiles,
    too_small,
)
from remat_kit.recommend.session import (
    Candidate,
    CompileCache,
    CompileCounter,
    Recommendation,
    Session,
    SolveSummary,
    close_call,
    counting,
    fastest_fitting,
    less_recompute_note,
    offload_passed_over,
    passed_over_note,
    pointless_offloads,
)
from remat_kit.trace import trace_program
from remat_kit.units import format_bytes, parse_bytes
from remat_kit.zoo import PresetLike, as_program

#: Device memory kept free by default for the CUDA context, workspaces and fragmentation, as
#: XLA:GPU's ``xla_gpu_memory_limit_slop_factor`` (95%); see docs/recommend.md.
DEFAULT_MARGIN = 0.05


def parse_budget(budget: int | float | str) -> int:
    """Bytes from an int, a float or a string (``"76GiB"``; :func:`remat_kit.units.parse_bytes`).

    Raises:
      ValueError: not a positive size (the message lists the units).
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be a size in bytes, got {budget!r}")
    if isinstance(budget, (int, float)):
        if not 0 < budget < math.inf:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        return int(budget)
    try:
        return parse_bytes(str(budget))
    except ValueError as err:
        raise ValueError(f"budget: {err}") from None


def resolve_budget(
    target: T.Target, budget: int | float | str | None, margin: float
) -> tuple[int, str]:
    """``(bytes per device, source)``: ``budget`` parsed, or the target's memory less ``margin``.

    Raises:
      ValueError: ``budget`` not a size; no ``budget`` and the target's memory unknown.
    """
    if budget is None:
        if target.memory_bytes is None:
            raise ValueError(
                f"target {target.name!r} has unknown memory: give a budget "
                "(budget='40GiB'; --budget on the command line)"
            )
        note = (
            f"{target.name} memory {format_bytes(target.memory_bytes)} less {margin:.0%} for the "
            "CUDA context, workspaces and fragmentation; run with "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={1 - margin:.2f}"
        )
        if target.platform == "tpu":  # the TPU compiler's usable HBM: no CUDA context there
            note = (
                f"{target.name} HBM per chip {format_bytes(target.memory_bytes)} (what the TPU "
                f"compiler lets a program use) less the {margin:.0%} margin"
            )
        return int(target.memory_bytes * (1 - margin)), note
    nbytes = parse_budget(budget)
    note = "given"
    if target.memory_bytes is not None and nbytes > target.memory_bytes:
        note += f", above the {format_bytes(target.memory_bytes)} of device memory of {target.name}"
    return nbytes, note


@dataclasses.dataclass(frozen=True)
class SearchScope:
    """What :func:`recommend` is asked to search, unchecked (fields as in :func:`recommend`)."""

    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None
    group_sizes: Sequence[int] | None = None
    auto: bool = False
    solve: bool = False
    structure: bool | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """What :func:`recommend` was asked, checked and resolved.

    Attributes:
      arguments: bytes of the step's arguments, per device.
      tags: the checkpoint names the program emits.
      labels: custom specs with their label in every tool (``minimal (cut)``).
      cut: the specs registered policies were cut down to.
      notes: what resolving dropped or cut down.
    """

    program: Program
    target: T.Target
    auto: bool
    solve: bool
    budget_bytes: int
    budget_note: str
    specs: tuple[PolicySpec, ...]
    groups: tuple[int, ...]
    arguments: dict[str, int]
    notes: tuple[str, ...]
    tags: frozenset[str] = frozenset()
    labels: Mapping[PolicySpec, str] = dataclasses.field(default_factory=dict)
    cut: frozenset[PolicySpec] = frozenset()
    structure: bool = False
    margin: float = DEFAULT_MARGIN
    #: Remat segments built for policy None (:class:`remat_kit.reach.PolicyReach`).
    remats_for_none: int = 0

    @property
    def batch(self) -> int | None:
        return self.program.known.batch_size


@dataclasses.dataclass
class Found:
    """What the search stages found: candidates, pick, largest batches, solver summary, advice."""

    candidates: list[Candidate]
    pick: Candidate | None
    largest: list[Candidate] = dataclasses.field(default_factory=list)
    summary: SolveSummary | None = None
    advice: list[str] = dataclasses.field(default_factory=list)
    made_fit: str | None = None


def recommend(
    model: PresetLike | Program,
    seq_len: int | None = None,
    target: str | T.Target = "h100-sxm",
    *,
    batch_size: int | Literal["auto"] | None = None,
    budget: int | float | str | None = None,
    solve: bool = False,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    group_sizes: Sequence[int] | None = None,
    optimizer: str | None = None,
    margin: float = DEFAULT_MARGIN,
    max_compiles: int | None = None,
    workers: int | None = None,
    cache: CompileCache | None = None,
    structure: bool | None = None,
    mesh: str | T.MeshSpec | None = None,
) -> Recommendation:
    """The configuration with the least estimated step time whose compiled peak fits the budget;
    on a GPU or TPU (datasheet figures), the one recomputing least among those estimated within
    the time model's error of the fastest (:func:`remat_kit.memory.roofline.estimate_error`).

    Args:
      model: a preset name (``"llama3-8b"``) or config (:data:`remat_kit.zoo.PresetLike`: its
        ``remat_group_size`` is the base group size), made a program by :func:`remat_kit.preset`;
        or any :class:`~remat_kit.Program` (a user's: by default the policies ``analyze``
        compiles on it, those that act on the tags it emits and specs in its own tag names, and
        with ``solve`` per-tag choices over them; ``seq_len``, ``batch_size``, ``group_sizes``,
        ``optimizer`` and ``mesh`` do not apply).
      seq_len: tokens per sequence (required for a preset).
      target: a GPU target name (``"h100-sxm"``, ``"h200"``, ``"a100-80gb"``, ``"a100-40gb"``,
        ``"l4"``) or a :class:`~remat_kit.targets.Target` with known peak FLOP/s.
      batch_size: sequences per step (default 1), or ``"auto"``: the largest batch that fits
        per policy, the pick being the one with the most tokens per second.
      budget: per-device bytes (int or float), or a size string (``"76GiB"``, ``"80GB"``,
        ``"8e10"``); default the target's memory less ``margin``.
      solve: also search per-tag choices (:func:`solve_tags`); not with ``"auto"``.
      policies: the policies to consider: registered names, :class:`~remat_kit.PolicySpec`
        objects or per-tag mappings (default: on a preset every registered policy, on a user's
        program the set ``analyze`` compiles on it; offloading ones are skipped on targets
        where offload is not real).
      group_sizes: ``remat_group_size`` values to consider (default every divisor of
        ``num_layers``; ignored with ``"auto"``, which keeps the base group size).
      optimizer: ``"adamw"`` (default), ``"sgd"`` or ``"adafactor"``.
      margin: fraction of device memory kept free by the default budget, in [0, 1) (default
        :data:`DEFAULT_MARGIN`).
      max_compiles: cap on compiles after the first stage, which always compiles every named
        policy (default 2x the named policies; 6x with ``"auto"``). A stage stopped by the cap
        says so in ``notes``.
      workers: concurrent compiles (see :func:`remat_kit.memory.analyze_policies`).
      cache: a :class:`CompileCache` shared between calls.
      structure: also search the model's structure at a fixed batch
        (:mod:`remat_kit.recommend.search`); default on when ``policies`` is None. Adds
        :func:`~remat_kit.recommend.search.structure_compiles` to the compile cap.
      mesh: compile every configuration on this (dp, fsdp, tp) mesh of the target's devices
        (``"fsdp=256"`` on a ``v6e-256`` slice; :func:`remat_kit.targets.parse_mesh`): the
        batch is split over dp*fsdp devices (default one sequence per such device; not with
        ``"auto"``), and budgets, peaks and step times are per device.

    Returns:
      A :class:`Recommendation`: the pick (None when nothing fits, with ``advice``), every
      candidate compiled, and the compiles spent.

    Raises:
      ValueError: unknown model, target, policy or optimizer; ``seq_len`` or ``batch_size`` not
        positive, or ``seq_len`` above the model's ``max_seq_len``; a group size that does not
        divide ``num_layers``; ``solve`` with ``"auto"``; a target without peak FLOP/s, or
        without memory and no ``budget``.
      BudgetTooSmall: (a ``ValueError``) a budget smaller than the parameters and optimizer
        state (the message gives the compiled peak of the usual least-memory policy: a
        budget that fits).
    """
    program = _program_of(model, seq_len, batch_size, optimizer, mesh, solve)
    return recommend_program(
        program, target, auto=batch_size == "auto", budget=budget, solve=solve, policies=policies,
        group_sizes=group_sizes, margin=margin, max_compiles=max_compiles, workers=workers,
        cache=cache, structure=structure,
    )  # fmt: skip


def _program_of(
    model: PresetLike | Program,
    seq_len: int | None,
    batch_size: int | Literal["auto"] | None,
    optimizer: str | None,
    mesh: str | T.MeshSpec | None,
    solve: bool,
) -> Program:
    """``model`` as the program :func:`recommend` searches, its arguments checked."""
    auto = batch_size == "auto"
    spec = T.parse_mesh(mesh) if mesh else None
    if spec is not None and auto:
        raise ValueError(f"batch_size='auto' is for one device; on mesh {spec} give a batch size")
    if solve and auto:
        raise ValueError("solve needs a fixed batch: give a batch size, not 'auto'")
    batch = None if auto else batch_size
    if batch is not None:
        _check_batch(batch)
    start = 1 if auto else (spec.dp * spec.fsdp if spec is not None else 1)
    return as_program(model, batch, seq_len, optimizer, spec, default_shape=(start, None))


def recommend_program(
    program: Program,
    target: str | T.Target = "h100-sxm",
    *,
    auto: bool = False,
    budget: int | float | str | None = None,
    solve: bool = False,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    group_sizes: Sequence[int] | None = None,
    margin: float = DEFAULT_MARGIN,
    max_compiles: int | None = None,
    workers: int | None = None,
    cache: CompileCache | None = None,
    structure: bool | None = None,
) -> Recommendation:
    """:func:`recommend` on a :class:`~remat_kit.program.Program`.

    Raises:
      ValueError: as :func:`recommend`; ``auto``, ``group_sizes`` or ``structure`` on a program
        that cannot vary (a user's: it carries its own shapes).
    """
    t_start = time.perf_counter()
    scope = SearchScope(
        policies=policies, group_sizes=group_sizes, auto=auto, solve=solve, structure=structure
    )
    request = resolve_request(program, target, scope, budget, margin)
    name = getattr(program.step(request.specs[0]).fn, "__name__", "step")
    with counting((name, f"jit({name})")) as counter, CompileEngine(workers) as engine:
        session = open_session(request, counter, cache, workers, max_compiles, engine)
        named = compile_named(session, request)
        if request.auto:
            found = search_largest_batch(session, named)
        else:
            found = search_fixed_batch(session, request, named)
            if request.structure:
                search_structure_options(session, request, named, found)
        if found.pick is None:
            advise(session, request, named, found)
        compiles = counter.count
    return assemble(request, session, found, compiles, time.perf_counter() - t_start)


def _check_batch(batch_size: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")


def _resolve_specs(
    tgt: T.Target,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None,
    program: Program,
    tags: frozenset[str],
) -> tuple[list[PolicySpec], list[str], dict[PolicySpec, str], frozenset[PolicySpec]]:
    """``(specs, notes, custom labels, cut specs)``: the policies worth compiling on ``program``.

    Fitted to ``tags`` by :func:`remat_kit.memory.policy_set.policy_set`; those the remat
    implementation does not apply as named are dropped with a note
    (:func:`remat_kit.policies.honoured`).

    Raises:
      ValueError: empty ``policies``; unknown policy; nothing left to compile.
    """
    if policies is None and program.known.default_policy is not None:
        policies = policy_names()  # a model configured with a policy: every registered one
    chosen = policy_set(program, tgt, policies, fit=True, tags=tags)
    specs, notes, restricted = list(chosen.specs), list(chosen.notes), chosen.restricted
    labels = dict(zip(specs, chosen.labels(), strict=True))
    specs, wrong = honoured(specs)
    if not specs:
        raise ValueError(f"no policy given runs as named here: {'; '.join(wrong)}")
    custom = {s: label for s, label in labels.items() if label != policy_label(s)}
    return specs, notes + wrong, custom, frozenset(cut for _, cut in restricted)


def _cannot_vary(program: Program, *changes: str) -> ValueError:
    """The error for a search asked of a program without a family (a user's)."""
    how = "its family does not take" if program.family is not None else "it has no family for"
    return ValueError(
        f"program {program.name!r} cannot be varied ({', '.join(sorted(changes))}): {how} that; "
        "change its factory and run again, or give it a remat_kit.family.Family that builds it "
        "(docs/own-model.md)"
    )


def _resolve_groups(program: Program, group_sizes: Sequence[int] | None) -> list[int]:
    """The group sizes to consider (default every divisor of ``num_layers``).

    Raises:
      ValueError: a group size that does not divide ``num_layers``; group sizes for a
        program that cannot vary (a user's).
    """
    if program.family is None or not program.family.takes("remat_group_size"):
        if group_sizes is not None:
            raise _cannot_vary(program, "remat_group_size")
        return []
    layers = program.family.structure.num_layers
    valid = [d for d in range(1, layers + 1) if layers % d == 0]
    groups = list(group_sizes) if group_sizes is not None else valid
    for g in groups:
        if g not in valid:
            raise ValueError(
                f"group size {g!r} does not divide num_layers={layers} of "
                f"{program.name!r}; valid: {valid}"
            )
    return groups


def resolve_request(
    program: Program,
    target: str | T.Target,
    scope: SearchScope,
    budget: int | float | str | None,
    margin: float,
) -> Request:
    """Stage 1: check and resolve every input of :func:`recommend`; traces once, compiles nothing.

    Raises:
      ValueError: see :func:`recommend`.
    """
    auto, policies, structure = scope.auto, scope.policies, scope.structure
    tgt = T.get_target(target)
    figures_for(tgt)  # raises, naming the targets that have them, when steps cannot be timed
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if auto and (program.family is None or not program.family.takes("batch_size")):
        raise _cannot_vary(program, "batch_size")
    if auto and program.known.batch_size != 1:  # the batch search starts from batch 1
        program = program.family.build(batch_size=1)
    groups = _resolve_groups(program, scope.group_sizes)
    budget_bytes, budget_note = resolve_budget(tgt, budget, margin)
    traced = trace_program(program, tgt)
    tags, reach = traced.tags, traced.reach
    specs, notes, labels, cut = _resolve_specs(tgt, policies, program, tags)
    # a factory that remats even when given None: its "no-remat" still remats
    remats_for_none = reach.without_policy
    if remats_for_none:
        notes.append(f"no-remat: {reach.no_remat_note()}")
    on = policies is None if structure is None else bool(structure)
    if structure and program.family is None:
        raise _cannot_vary(program, "structure")
    on = on and program.family is not None
    if on and auto:
        notes.append("structure search (attention, loss chunks, remat_layers) needs a fixed batch")
    return Request(
        program=program, target=tgt, auto=auto, solve=scope.solve, budget_bytes=budget_bytes,
        budget_note=budget_note, specs=tuple(specs), groups=tuple(groups),
        arguments=traced.arguments, notes=tuple(notes), tags=tags, labels=labels, cut=cut,
        structure=on and not auto, margin=margin, remats_for_none=remats_for_none,
    )  # fmt: skip


def _parameter_bytes(program: Program, arguments: Mapping[str, int]) -> int:
    """Bytes of the parameters per device: ``params``, or a ``from_loss`` program's
    differentiated arguments."""
    names = {"params"}
    if program.step_of_loss is not None:  # step(opt_state, *loss_args)
        names |= {program.argument_names[1 + i] for i in program.argnums}
    return sum(arguments.get(n, 0) for n in names)


def open_session(
    request: Request,
    counter: CompileCounter,
    cache: CompileCache | None,
    workers: int | None,
    max_compiles: int | None,
    engine: CompileEngine | None = None,
) -> Session:
    """Stage 2: the compile session; the cap defaults to 2x the named policies (6x ``auto``).

    Raises:
      BudgetTooSmall: the budget is below the parameters and optimizer state.
    """
    params = _parameter_bytes(request.program, request.arguments)
    opt_state = request.arguments.get("opt_state", 0)
    n = len(request.specs)
    layers = request.program.family.structure.num_layers if request.structure else 0
    extra = structure_compiles(layers) if request.structure else 0
    cap = max_compiles if max_compiles is not None else (6 if request.auto else 2) * n + extra
    session = Session(
        program=request.program, target=request.target, budget=request.budget_bytes,
        cache=cache if cache is not None else CompileCache(), counter=counter, workers=workers,
        max_compiles=max(cap, n), fixed_bytes=params + opt_state, opt_state_bytes=opt_state,
        notes=list(request.notes), labels=request.labels, cut=request.cut, tags=request.tags,
        margin=request.margin, engine=engine,
    )  # fmt: skip
    if params and request.budget_bytes < params + opt_state:  # named by a preset or from_loss
        raise BudgetTooSmall(
            too_small(session, request.budget_bytes, request.batch, params, opt_state)
        )
    return session


def compile_named(session: Session, request: Request) -> list[Named]:
    """Stage 3: every policy at the program's own configuration."""
    return session.candidates(list(request.specs), None, None, "named")


def search_largest_batch(session: Session, named: Sequence[Named]) -> Found:
    """Stage 4 with ``auto``: the largest batch per policy; pick the most tokens per second."""
    largest, probes = largest_batch(session, [(spec, c) for spec, c, _ in distinct(named)])
    skip = pointless_offloads(largest, auto=True)
    usable = [c for c in largest if not any(c is s for s in skip)]
    pick = max(usable, key=lambda c: (c.tokens_per_s, -c.peak_bytes), default=None)
    return Found([c for _, c, _ in named] + probes, pick, largest=largest)


def search_fixed_batch(session: Session, request: Request, named: Sequence[Named]) -> Found:
    """Stage 4 at a fixed batch: group sizes, then per-tag choices (``solve``); the pick by
    :func:`~.session.fastest_fitting`."""
    candidates = [c for _, c, _ in named]
    if request.groups:
        candidates += group_search(session, named, request.groups, request.batch)
    summary = None
    if request.solve:
        summary = solve(session, named, request.batch)
        if summary is not None:
            candidates += summary.verified
    return Found(
        candidates,
        fastest_fitting(candidates, estimate_error(session.target)),
        summary=summary,
    )


def search_structure_options(
    session: Session, request: Request, named: Sequence[Named], found: Found
) -> None:
    """Stage 5: structure options (:mod:`remat_kit.recommend.search`); the pick chosen again."""
    pool: list[Named] = list(named)
    if found.pick is None:
        extra = search_structure(session, named, request.batch, math.inf)
        pool += extra
        found.candidates += [c for _, c, _ in extra]
        found.pick = fastest_fitting(found.candidates, estimate_error(session.target))
    partial = search_partial_layers(session, pool, found.pick, request.batch)
    found.candidates += [c for _, c, _ in partial]
    found.pick = fastest_fitting(found.candidates, estimate_error(session.target))
    found.made_fit = made_fit(found.pick, found.candidates, session.structure.num_layers)


def advise(session: Session, request: Request, named: Sequence[Named], found: Found) -> None:
    """Stage 5, when nothing fits: what would, and the candidates compiled to find out."""
    if session.structure is None:
        found.advice = fixed_program_advice(session, found.candidates)
        return
    lines, extra = advice(session, named, request.batch)
    found.advice = lines
    found.candidates += extra


def assemble(
    request: Request, session: Session, found: Found, compiles: int, wall_s: float
) -> Recommendation:
    """Stage 6: the :class:`~remat_kit.recommend.Recommendation`."""
    tgt, program = request.target, request.program
    rivals = found.largest if request.auto else found.candidates
    close = close_call(found.pick, rivals, request.auto)
    margin = estimate_error(tgt)
    less = None if request.auto else less_recompute_note(found.pick, found.candidates, margin)
    over = None if request.auto else passed_over_note(found.pick, found.candidates, margin)
    passed = offload_passed_over(found.pick, rivals, request.auto)
    small = small_step_note((c.step_time_s for c in found.candidates), figures_for(tgt).measured)
    warned = [f"{found.pick.label}: {w}" for w in found.pick.warnings] if found.pick else []
    return Recommendation(
        model=program.name,
        target=tgt.name,
        seq_len=program.known.seq_len,
        batch_size=None if request.auto else request.batch,
        optimizer=session.optimizer,
        budget_bytes=request.budget_bytes,
        budget_note=request.budget_note,
        arguments=request.arguments,
        pick=found.pick,
        candidates=tuple(found.candidates),
        largest_batch=tuple(found.largest),
        compiles=compiles,
        reused=session.reused,
        from_compile_cache=session.from_compile_cache,
        wall_s=round(wall_s, 2),
        advice=tuple(found.advice),
        notes=(
            time_model_note(tgt),
            *session.notes,
            *warned,
            *(n for n in (less, over, close, passed, small) if n),
        ),  # fmt: skip
        solve=found.summary,
        peak_flops=tgt.peak_flops_bf16,
        host_link_bytes_per_s=tgt.host_link_bytes_per_s,
        host_link=T.host_link_source(tgt),
        made_fit=found.made_fit,
        tags=tuple(sorted(request.tags)),
        remats_for_none=request.remats_for_none,
        compiled_on=compiled_on(tgt),
    )


def compiled_on(tgt: T.Target) -> str:
    """The device and compiler the candidates were compiled for, e.g. ``"h100-sxm (NVIDIA H100
    SXM5 80 GB HBM3 (Hopper, sm_90a)); XLA GPU compiler (deviceless, jax 0.10.2)"``.

    Raises:
      ValueError: no device figures (:func:`~remat_kit.memory.calibration.figures_for`).
    """
    figures = figures_for(tgt)
    where = (
        f"{figures.name}, {os.cpu_count()} cores"
        if figures.measured and tgt.platform == "cpu"
        else tgt.description
    )
    return f"{tgt.name} ({where}); {jax_backend_description(tgt.platform, tgt.deviceless)}"
