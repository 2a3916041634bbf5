"""Every search of recommend past the named policies, and what to say when nothing fits.

* Group sizes and the largest batch (``batch_size="auto"``): :func:`group_search`,
  :func:`largest_batch` (a :class:`BatchBracket` per policy).
* Structure: another member of the program's family (:class:`~remat_kit.family.Family`:
  ``attention``, ``loss_chunk_size``, ``nested_remat`` / ``nested_groups``, ``remat_layers``)
  rather than another policy; every candidate returned is compiled.

  - :func:`search_structure`: when nothing fits, cuDNN attention, chunked cross-entropy, both,
    then nested remat (alone and with the others), each on at most :data:`STRUCTURE_PROBES`
    candidates; the first option that makes something fit ends the stage.
  - :func:`search_partial_layers`: when a full-remat policy fits with room, the least ``k`` of
    ``L`` layers under it that fits, by secant then bisection (:func:`partial_probes` compiles).

* The per-tag solver (``solve=True``, :func:`solve`): bytes and recomputed FLOPs per checkpoint tag
  around a compiled ``save-nothing``, time on the roofline's scale, every combination of actions
  enumerated, those that could beat the pick at the model's observed error compiled
  (:func:`verify_choices`).
* When nothing fits (:func:`advice`): what would (a smaller batch and a shorter sequence,
  compiled; more devices, estimated), and the message for a budget below the parameters and
  optimizer state (:class:`BudgetTooSmall`).

Which candidates each option probes, and its estimates: docs/recommend.md ("How the search runs").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from remat_kit import names as N
from remat_kit import targets as T
from remat_kit import trace
from remat_kit.memory.calibration import figures_for
from remat_kit.placement import Placement
from remat_kit.policies import TAG_ACTIONS, PolicySpec, can_offload, custom_spec, get_policy_spec
from remat_kit.program import Program, step_flops
from remat_kit.recommend.session import Candidate, Overrides, Session, SolveSummary, TagCost
from remat_kit.units import format_bytes, format_seconds
from remat_kit.walker import bytes_by_tag

#: A compiled named policy: its spec, its candidate and the analyzer's report.
Named = tuple[PolicySpec, Candidate, Any]
#: Probes per policy in the batch search before it stops.
BATCH_PROBES = 6


def group_search(
    session: Session,
    named: Sequence[tuple[PolicySpec, Candidate, Any]],
    group_sizes: Sequence[int],
    batch: int,
) -> list[Candidate]:
    """Other ``remat_group_size`` values, compiled only where the bound says one could fit and
    be faster (see :mod:`remat_kit.recommend`). Group sizes in increasing order, one compile
    round each."""
    g0 = session.structure.remat_group_size
    best = min((c.step_time_s for _, c, _ in named if c.fits), default=math.inf)
    open_: dict[PolicySpec, tuple[PolicySpec, Candidate, int]] = {}
    for spec, c, report in named:
        if c.fits or not spec.wrap or N.DECODER_LAYER_INPUT in spec.tags:
            continue  # fits already (grouping only adds FLOPs); no remat; inner inputs kept
        inputs = sum(
            r.nbytes
            for r in report.residuals
            if r.tag == N.DECODER_LAYER_INPUT and r.memory == "device"
        )
        open_[spec] = (spec, c, inputs)
    out: list[Candidate] = []
    for k in sorted(g for g in set(group_sizes) if g != g0):
        eligible = [
            (c.step_time_s, spec)
            for spec, c, inputs in open_.values()
            if c.step_time_s < best and c.peak_bytes - inputs * (1 - g0 / k) <= session.budget
        ]
        eligible.sort(key=lambda x: x[0])
        room = session.room()
        if len(eligible) > room:
            session.notes.append(
                f"group size {k}: compile cap reached, {len(eligible) - room} candidate(s) skipped"
            )
            eligible = eligible[:room]
        if not eligible:
            continue
        for spec, c, _ in session.candidates([s for _, s in eligible], k, batch, "group-size"):
            out.append(c)
            if c.fits:
                best = min(best, c.step_time_s)
                open_.pop(spec, None)
    return out


@dataclasses.dataclass
class BatchBracket:
    """The batch search of one policy: ``lo`` fits (compiled), ``hi`` does not (or None).

    Attributes:
      spec: the policy searched.
      lo: the largest fitting candidate compiled so far (None: not even batch 1 fits).
      hi: the smallest batch compiled not to fit (None: none yet).
      points: batch -> compiled peak bytes, every probe so far.
      probes: probes recorded.
    """

    spec: PolicySpec
    lo: Candidate | None
    hi: int | None
    points: dict[int, int]  # batch -> compiled peak bytes
    probes: int = 0

    def next_probe(self, budget: int, fixed: int) -> int | None:
        """The next batch to compile, or None when the bracket is closed or out of probes.

        Args:
          budget: device bytes per device. fixed: argument bytes that do not scale with the
            batch (the first probe's slope is bounded by ``peak(1) - fixed``).
        """
        if self.lo is None:
            return None
        low = self.lo.batch_size
        if (self.hi is not None and self.hi <= low + 1) or self.probes >= BATCH_PROBES:
            return None
        peak = self.points[low]
        if len(self.points) == 1:
            slope = max(1.0, peak - fixed)  # an upper bound: the first guess is conservative
        else:
            (b1, p1), (b2, p2) = sorted(self.points.items(), key=lambda x: abs(x[0] - low))[:2]
            slope = (p2 - p1) / (b2 - b1)
        guess = low + int((budget - peak) // slope) if slope > 0 else 2 * low
        if self.hi is None:
            return max(guess, low + 1)
        if self.probes >= 3:  # interpolation is slow to converge: bisect
            return (low + self.hi) // 2
        return min(max(guess, low + 1), self.hi - 1)

    def record(self, c: Candidate | None, batch: int) -> None:
        """Record the compiled candidate at ``batch`` (None: it failed to compile)."""
        self.probes += 1
        if c is not None:
            self.points[batch] = c.peak_bytes
        if c is not None and c.fits:
            if batch > self.lo.batch_size:  # type: ignore[union-attr]
                self.lo = c
        else:
            self.hi = batch if self.hi is None else min(self.hi, batch)


def largest_batch(
    session: Session, first: Sequence[tuple[PolicySpec, Candidate]]
) -> tuple[list[Candidate], list[Candidate]]:
    """Per policy, the largest batch that fits (compiled), from its batch-1 candidate.

    Peak is close to affine in the batch (arguments fixed; activations, logits and their
    gradients proportional). The first probe extrapolates from batch 1 with the slope bounded
    above by ``peak(1) - arguments`` (what is not an argument at most scales with the batch);
    later probes interpolate through the two compiled points nearest the largest fit, clamped
    inside the bracket; after three probes, bisection. Largest means: fits at b, and compiled not
    to fit at b + 1 (or the search stopped, said in the notes). Policies probing the same batch
    compile together.

    Returns:
      (the largest fitting candidate of each policy that fits at batch 1, every probe).
    """
    g0 = session.structure.remat_group_size
    brackets = [
        BatchBracket(spec, c if c.fits else None, None if c.fits else 1, {1: c.peak_bytes})
        for spec, c in first
    ]
    probes_all: list[Candidate] = []
    while True:
        wanted: dict[int, list[BatchBracket]] = {}
        for br in brackets:
            b = br.next_probe(session.budget, session.arguments(1))
            if b is not None:
                wanted.setdefault(b, []).append(br)
        if not wanted:
            break
        if session.room() <= 0:
            session.notes.append("batch search stopped at the compile cap")
            break
        for b, group in sorted(wanted.items()):
            group = group[: session.room()]
            if not group:
                break
            found = {
                id(spec): c
                for spec, c, _ in session.candidates(
                    [br.spec for br in group], g0, b, "batch-search"
                )
            }
            for br in group:
                c = found.get(id(br.spec))
                br.record(c, b)
                if c is not None:
                    probes_all.append(c)
    for br in brackets:
        if (
            br.lo is not None
            and br.probes >= BATCH_PROBES
            and (br.hi is None or br.hi > br.lo.batch_size + 1)
        ):
            session.notes.append(
                f"{br.spec.name}: batch search stopped after {br.probes} probes at batch "
                f"{br.lo.batch_size} (not shown to be the largest)"
            )
    return [br.lo for br in brackets if br.lo is not None], probes_all


def distinct(named: Sequence[Named]) -> list[Named]:
    """``named`` less those compiled to the same program as an earlier one (same peak, host
    bytes and FLOPs: at group size 1, save-layer-inputs is save-nothing)."""
    seen: set[tuple] = set()
    out = []
    for t in named:
        key = (t[1].peak_bytes, t[1].host_bytes, t[1].flops)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


#: Candidates compiled per structural option.
STRUCTURE_PROBES = 3
#: Structural options at most (cuDNN, chunked loss, both, nested, nested with the others).
STRUCTURE_OPTIONS = 5
#: Secant probes of the partial-layer search before it bisects.
SECANT_PROBES = 2


def partial_probes(num_layers: int) -> int:
    """Compiles per policy that prove the least ``remat_layers`` that fits among ``1..L-1``:
    :data:`SECANT_PROBES` secant probes (each narrows the bracket by at least one), then
    bisection (``ceil(log2(L))`` halvings close any bracket of width below ``L``)."""
    return SECANT_PROBES + math.ceil(math.log2(max(num_layers, 2)))


def structure_compiles(num_layers: int) -> int:
    """Compiles the structure stages may add to the default compile cap: every option's probes
    and the partial-layer search of two policies (:func:`partial_probes`)."""
    return STRUCTURE_OPTIONS * STRUCTURE_PROBES + 2 * partial_probes(num_layers)


#: Tokens per chunk of the chunked cross-entropy (or seq / 8 where it does not divide the seq).
LOSS_CHUNK = 1024


def loss_chunk(seq_len: int) -> int | None:
    """The chunk the search tries: :data:`LOSS_CHUNK` tokens where it divides ``seq_len`` into 2
    or more chunks, else ``seq_len // 8`` where that divides it; None (no chunking) otherwise."""
    if seq_len % LOSS_CHUNK == 0 and seq_len > LOSS_CHUNK:
        return LOSS_CHUNK
    if seq_len % 8 == 0 and seq_len >= 16:
        return seq_len // 8
    return None


def structural_options(session: Session) -> list[tuple[str, Overrides]]:
    """``(label, overrides)`` in order of cost: cuDNN attention, chunked loss, both, nested remat,
    nested remat with the others (those the target, the family and the sequence allow, and the
    program does not already have)."""
    layers, family = session.structure, session.program.family
    cudnn = (
        family.takes("attention") and layers.attention == "xla"
        and "cudnn" in family.attention_options(session.target)
    )  # fmt: skip
    chunk = None
    if family.takes("loss_chunk_size") and layers.loss_chunk_size is None:
        chunk = loss_chunk(session.seq_len)
    cheap: list[tuple[str, Overrides]] = []
    if cudnn:
        cheap.append(("attention='cudnn'", (("attention", "cudnn"),)))
    if chunk:
        cheap.append((f"loss_chunk_size={chunk}", (("loss_chunk_size", chunk),)))
    if cudnn and chunk:
        cheap.append(
            (
                f"attention='cudnn' + loss_chunk_size={chunk}",
                (("attention", "cudnn"), ("loss_chunk_size", chunk)),
            )
        )
    groups = family.nested_groups if family.takes("nested_remat", "nested_groups") else None
    if groups is None:
        return cheap
    nested = (("nested_groups", groups), ("nested_remat", True))
    label = f"nested_remat=True, nested_groups={groups}"
    out = [*cheap, (label, nested)]
    if cheap:
        others, overrides = cheap[-1]
        out.append((f"{others} + {label}", tuple(sorted((*overrides, *nested)))))
    return out


def _residual_bytes(report: Any) -> int:
    """Device bytes of the saved residuals of every layer (the analyzer's jaxpr table)."""
    return sum(r.nbytes for r in report.residuals if r.memory == "device")


def _saving(structure: Overrides, least: Named, compiled: Named, other: Named) -> float:
    """Estimated peak saving of ``structure`` for ``other``: the compiled saving of ``least``;
    nested remat adds ``(1 - 1/G)`` of the difference in residual bytes (one segment of L/G
    layers holds its residuals at a time instead of all L layers)."""
    saving = least[1].peak_bytes - compiled[1].peak_bytes
    groups = dict(structure).get("nested_groups")
    if groups:
        diff = _residual_bytes(other[2]) - _residual_bytes(least[2])
        saving += (1 - 1 / groups) * diff
    return saving


def search_structure(
    session: Session, named: Sequence[Named], batch: int, best_time: float
) -> list[Named]:
    """Structural options on the named candidates that do not fit and are faster than
    ``best_time`` (the best fit so far, ``inf`` if none); see the module docstring.

    Returns:
      Every candidate compiled, as (spec, candidate, report).
    """
    g0 = session.structure.remat_group_size
    over = distinct([t for t in named if not t[1].fits and t[1].step_time_s < best_time])
    out: list[Named] = []
    for label, structure in structural_options(session) if over else []:
        if session.room() <= 0:
            session.notes.append(f"structure search stopped at the compile cap before {label}")
            break
        least = min(over, key=lambda t: (t[1].peak_bytes, t[1].step_time_s))
        first = session.candidates([least[0]], g0, batch, "structure", structure=structure)
        out += first
        if not first:
            continue
        rest = sorted(
            (
                t for t in over if t is not least
                and t[1].peak_bytes - _saving(structure, least, first[0], t) <= session.budget
            ),
            key=lambda t: t[1].step_time_s,
        )[: min(STRUCTURE_PROBES - 1, session.room())]  # fmt: skip
        if rest:
            specs = [t[0] for t in rest]
            out += session.candidates(specs, g0, batch, "structure", structure=structure)
        if any(c.fits for _, c, _ in out):
            break
    return out


def structure_of(c: Candidate) -> Overrides:
    """The candidate's structural overrides (the ``Overrides`` it was compiled with)."""
    return tuple(sorted(c.options.items()))


def search_partial_layers(
    session: Session, pool: Sequence[Named], pick: Candidate | None, batch: int
) -> list[Named]:
    """Fewer rematerialised layers for the pick's policy (and the least-memory fitting full-remat
    policy with the same options); see the module docstring.

    Args:
      pool: every (spec, candidate, report) compiled so far at the batch asked.
      pick: the best fit so far; nothing is searched unless it is a full-remat policy at group
        size 1 with every layer rematerialised, not nested.

    Returns:
      Every candidate compiled, as (spec, candidate, report).
    """
    layers = session.structure
    if not session.program.family.takes("remat_layers"):
        return []
    if pick is None or pick.remat_layers is not None or pick.remat_group_size != 1:
        return []
    if pick.policy == "no-remat" or not layers.scan_layers or layers.layer_structure:
        return []
    if pick.nested_groups is not None:
        return []  # remat_layers would count blocks per segment: not searched
    base = structure_of(pick)
    same = [
        t
        for t in pool
        if t[1].fits and t[1].remat_group_size == 1 and t[1].remat_layers is None
        and structure_of(t[1]) == base and t[0].wrap and t[1].policy != "no-remat"
    ]  # fmt: skip
    mine = [t for t in same if t[1] is pick]
    if not mine:
        return []
    least = min(same, key=lambda t: (t[1].peak_bytes, t[1].step_time_s))
    none = [t[1] for t in pool if t[1].policy == "no-remat" and structure_of(t[1]) == base]
    if any(c.fits for c in none):
        return []  # no remat at all fits, and is faster than any partial remat
    out: list[Named] = []
    for spec, full, _ in distinct(mine + [least]):
        out += _bisect_layers(session, spec, full, none[0] if none else None, base, batch)
    return out


def _bisect_layers(
    session: Session,
    spec: PolicySpec,
    full: Candidate,
    none: Candidate | None,
    base: Overrides,
    batch: int,
) -> list[Named]:
    """The least ``remat_layers`` that fits for ``spec``: secant, then bisection, until the
    bracket closes (``k`` fits, ``k - 1`` compiled not to; ``k = 0`` is no-remat), within
    :func:`partial_probes` compiles and the session's cap (a note says when it did not close)."""
    layers = session.structure.num_layers
    points = {layers: full.peak_bytes} | ({0: none.peak_bytes} if none is not None else {})
    fit, miss = layers, 0
    out: list[Named] = []
    stopped = "after its probes"
    for probe in range(partial_probes(layers)):
        if fit - miss <= 1:
            break
        if session.room() <= 0:
            stopped = "at the compile cap"
            break
        if miss in points and probe < SECANT_PROBES and points[miss] > points[fit]:
            frac = (points[miss] - session.budget) / (points[miss] - points[fit])
            k = miss + math.ceil((fit - miss) * frac)
        else:
            k = (miss + fit) // 2
        k = min(max(k, miss + 1), fit - 1)
        structure = tuple(sorted((*base, ("remat_layers", k))))
        found = session.candidates([spec], 1, batch, "partial-layers", structure=structure)
        if not found:
            stopped = f"at a failed compile (remat_layers={k})"
            break
        out += found
        c = found[0][1]
        points[k] = c.peak_bytes
        if c.fits:
            fit = k
        else:
            miss = k
    if fit - miss > 1 and out:
        session.notes.append(
            f"{spec.name}: partial-layer search stopped {stopped}: remat_layers={fit} of "
            f"{layers} fits, {fit - 1} not compiled (not shown to be the least that fits)"
        )
    return out


#: The options swapped in when nothing fits (``remat_layers`` is searched after, on a fit).
SWAPS = ("attention", "loss_chunk_size", "nested_remat", "nested_groups")
NESTED = ("nested_remat", "nested_groups")


def _without(c: Candidate, drop: Sequence[str]) -> Overrides:
    return tuple((k, v) for k, v in structure_of(c) if k not in drop)


def _same_step(a: Candidate, b: Candidate) -> bool:
    """Same policy, actions, batch, sequence and group size."""
    return (
        a.policy == b.policy and a.actions == b.actions and a.batch_size == b.batch_size
        and a.seq_len == b.seq_len and a.remat_group_size == b.remat_group_size
    )  # fmt: skip


def _twin(pick: Candidate, candidates: Sequence[Candidate], drop: Sequence[str]):
    """The candidate compiled like ``pick`` (policy, actions, batch, seq, group size) with the
    structural options ``drop`` left out; None if none was compiled."""
    want = _without(pick, drop)
    return next((c for c in candidates if _same_step(c, pick) and structure_of(c) == want), None)


def _least_layers(pick: Candidate, candidates: Sequence[Candidate]) -> str:
    """When a smaller ``remat_layers`` than the pick's was compiled to fit (the least that fits,
    slower by the time model): which, with its peak and estimated step; else ``""``."""
    base = _without(pick, ("remat_layers",))
    least = min(
        (
            c for c in candidates
            if c.fits and c.remat_layers is not None and _same_step(c, pick)
            and _without(c, ("remat_layers",)) == base
        ),
        key=lambda c: c.remat_layers,
    )  # fmt: skip
    if least.remat_layers >= pick.remat_layers:
        return ""
    return (
        f"; remat_layers={least.remat_layers} is the least that fits "
        f"({format_bytes(least.peak_bytes)}, est. {format_seconds(least.step_time_s)} from its "
        "compiled kernels, XLA's own "
        "rematerialisation included)"
    )


def _swap_line(pick: Candidate, candidates: Sequence[Candidate], swap: Sequence[str]) -> str:
    """What the options ``swap`` did, against ``pick`` compiled without them."""
    opts = pick.options
    names = " + ".join(f"{k}={opts[k]!r}" for k in swap)
    plain = _twin(pick, candidates, (*swap, "remat_layers"))
    with_it = _twin(pick, candidates, ("remat_layers",))
    what = "made it fit" if plain is not None and not plain.fits else "is faster"
    ref = ""
    if plain is not None and with_it is not None:
        kept = set(opts) - {*swap, "remat_layers"}
        other = f" (with {', '.join(sorted(kept))})" if kept else ""
        ref = (
            f": {pick.label} on every layer{other} peaks at {format_bytes(plain.peak_bytes)} "
            f"without it, {format_bytes(with_it.peak_bytes)} with it"
        )
    return f"{names} {what}{ref} (compiled)"


def made_fit(pick: Candidate | None, candidates: Sequence[Candidate], layers: int) -> str | None:
    """What the pick's structural options did, against the same policy compiled without them
    (at the same group size, batch and sequence): all the swapped options together, and, for a
    nested pick with other options, nested remat alone against the pick without it; None for a
    plain pick."""
    if pick is None or not pick.options:
        return None
    parts = []
    opts = pick.options
    swap = tuple(k for k in SWAPS if k in opts)
    if swap:
        parts.append(_swap_line(pick, candidates, swap))
    if "nested_groups" in opts and swap != NESTED and _twin(pick, candidates, NESTED):
        parts.append(_swap_line(pick, candidates, NESTED))
    if "remat_layers" in opts:
        k, full = opts["remat_layers"], _twin(pick, candidates, ("remat_layers",))
        line = f"remat_layers={k}: {layers - k} of {layers} layers not rematerialised"
        if full is not None:
            change = pick.step_time_s / full.step_time_s - 1
            how = f"{abs(change):.1%} {'slower' if change > 0 else 'faster'}"
            line += (
                f", est. step {format_seconds(pick.step_time_s)} vs "
                f"{format_seconds(full.step_time_s)} "
                f"with {pick.policy} on every layer ({how}), peak "
                f"{format_bytes(pick.peak_bytes)} vs {format_bytes(full.peak_bytes)} (compiled)"
            )
        parts.append(line + _least_layers(pick, candidates))
    return "; ".join(parts)


#: Custom-policy candidates compiled per verification round of :func:`verify_choices`.
SOLVE_VERIFY = 3
#: Verification rounds of :func:`verify_choices` at most (a note names the choices left).
SOLVE_ROUNDS = 2


def choice_time(
    anchor: Candidate, host_link_bytes_per_s: float | None, recompute_kept: float, host_bytes: int
) -> tuple[float, float]:
    """``(compute_s, transfer_s)`` of a per-tag choice on the roofline's scale: the compiled
    ``anchor`` (``save-nothing``) less the share of its recomputation the choice keeps, plus
    what of its host transfers cannot hide.

    ``compute_s = t - r * recompute_kept`` with ``t`` the anchor's estimated step time and ``r``
    its estimated recompute seconds (``StepTime.recompute_s`` of :mod:`remat_kit.memory.roofline`;
    without it, ``t`` times the anchor's share of recomputed FLOPs). Offloaded bytes cross the
    host link once each way, device -> host during the forward pass (a third of the step without
    recomputation) and back during the backward pass; only what cannot hide behind that pass
    counts.

    Args:
      anchor: the compiled save-nothing candidate.
      host_link_bytes_per_s: the target's host link (None: offload not timed).
      recompute_kept: the fraction in [0, 1] of the anchor's recomputed FLOPs the choice keeps.
      host_bytes: bytes offloaded to host memory.
    """
    total = anchor.step_time_s if anchor.step_time_s < math.inf else 0.0
    recompute = anchor.recompute_s
    if recompute is None:
        extra = (anchor.flops or 0.0) - (anchor.flops_no_remat or 0.0)
        recompute = total * extra / anchor.flops if anchor.flops else 0.0
    compute = max(0.0, total - recompute * recompute_kept)
    if host_bytes <= 0 or not host_link_bytes_per_s:
        return compute, 0.0
    fwd = min(compute, (total - recompute) / 3)
    link = host_bytes / host_link_bytes_per_s
    return compute, max(0.0, link - fwd) + max(0.0, link - (compute - fwd))


def solve_tags_of(program: Program, tags: frozenset[str]) -> tuple[str, ...]:
    """The tags the solver chooses for, in a fixed order: remat-kit's (MaxText's) names in
    their order, then the program's own names alphabetically."""
    known = list(N.CHECKPOINT_NAMES)
    return tuple(sorted(tags, key=lambda t: (known.index(t) if t in known else len(known), t)))


def tag_costs(
    program: Program, tags: Sequence[str], placement: Placement
) -> tuple[list[TagCost], float]:
    """The solver's per-tag bytes and recompute FLOPs (see :class:`TagCost`), and the jaxpr
    matmul FLOPs of the step saving nothing. Traces only, nothing compiled.

    Bytes: the program's residual table (:func:`~remat_kit.trace.residuals`, per
    device) under a policy that saves every tag, and under ``save-nothing`` for what is kept
    anyway. FLOPs: jaxpr matmul FLOPs of the whole train step saving nothing, minus those
    saving only the tag (one trace per tag, about 0.3 s each for llama3-8b). Additivity
    (keeping A and B saves ``flops_saved[A] + flops_saved[B]``) holds when a tag's producing
    matmul is recomputed only to produce that tag, as JAX's partial evaluation does for the
    bundled block: on llama3-8b, saving q, k, v and out_proj together saves 21.99 TFLOP, the
    sum of the four alone.
    """
    everything = custom_spec({t: "save" for t in tags})
    kept = bytes_by_tag(trace.residuals(program, everything, placement) or (), memory=None)
    base = bytes_by_tag(trace.residuals(program, get_policy_spec("save-nothing"), placement) or ())

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

    Model around the compiled ``save-nothing`` step of the same shape (the anchor)::

        peak(choice)  = peak(save-nothing) + sum over tags of the device bytes its action adds
                        (save: nbytes - base_bytes; offload: -base_bytes; recompute: 0)
        host(choice)  = sum of nbytes over offloaded tags
        time(choice)  = roofline time(save-nothing) - its recompute seconds * the share of its
                        recomputed FLOPs the kept tags save (sum of flops_saved * scale),
                        plus the host transfers that cannot hide (:func:`choice_time`)

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
    """The per-tag model of :func:`solve_tags` around a compiled ``save-nothing`` (``anchor``):
    per-tag costs, the actions allowed, and every choice ranked (see :func:`_ranked_choices`).
    Bytes are additive over tags; time is the anchor's roofline estimate less the recomputation
    a choice keeps (:func:`choice_time`): one time model, the roofline's.
    ``fj0``: save-nothing's jaxpr FLOPs; ``scale``: compiled / jaxpr FLOPs; ``combinations``:
    how many choices were enumerated."""

    target: T.Target
    costs: tuple[TagCost, ...]
    actions: tuple[str, ...]
    anchor: Candidate
    fj0: float
    scale: float
    ranked: tuple[tuple, ...]
    combinations: int
    host_link_bytes_per_s: float | None = None

    @property
    def peak0(self) -> int:
        return self.anchor.peak_bytes

    @classmethod
    def around(
        cls, target: T.Target, costs: Sequence[TagCost], actions: Sequence[str],
        save_nothing: Candidate, fj0: float,
    ) -> ChoiceModel:  # fmt: skip
        """Enumerate and rank every choice around the compiled ``save_nothing``."""
        scale = (save_nothing.flops or fj0) / fj0 if fj0 else 1.0
        link = figures_for(target).host_link_bytes_per_s
        model = cls(target, tuple(costs), tuple(actions), save_nothing, fj0, scale, (), 0, link)
        ranked, combos = _ranked_choices(model, _options(costs, actions), math.inf)
        return dataclasses.replace(model, ranked=tuple(ranked), combinations=combos)

    def time_of(self, saved_jaxpr_flops: float, host_bytes: int) -> float:
        """Predicted step seconds of a choice keeping ``saved_jaxpr_flops`` from recomputation
        and offloading ``host_bytes``."""
        sn = self.anchor
        recomputed = (sn.flops or 0.0) - (sn.flops_no_remat or 0.0)
        kept = min(1.0, saved_jaxpr_flops * self.scale / recomputed) if recomputed > 0 else 0.0
        return sum(choice_time(sn, self.host_link_bytes_per_s, kept, host_bytes))

    def predict(self, choice: Sequence[str]) -> tuple[float, int]:
        """(predicted step seconds, predicted device peak bytes) of ``choice``."""
        peak, host, saved = _predict(self.costs, choice, self.peak0)
        return self.time_of(saved, host), peak

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
    model: ChoiceModel, options: Sequence[Sequence[str]], limit: float
) -> tuple[list[tuple], int]:
    """Every per-tag choice enumerated; those predicted at or under ``limit`` bytes, as
    ``(step s, host bytes, peak bytes, tags kept, choice)`` sorted: least time, on a tie
    (transfers fully hidden) least host traffic, then least memory. Also returns how many were
    enumerated."""
    ranked = []
    combos = 0
    for choice in itertools.product(*options):
        combos += 1
        peak, host, saved = _predict(model.costs, choice, model.peak0)
        if peak > limit:
            continue
        kept = sum(a != "recompute" for a in choice)
        ranked.append((model.time_of(saved, host), host, peak, kept, choice))
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


#: Halvings of the sequence tried when nothing fits.
SEQ_HALVINGS = 3
#: Device counts tried for the "more devices" estimate.
DEVICE_COUNTS = (2, 4, 8, 16, 32, 64)


def advice(
    session: Session, named: Sequence[tuple[PolicySpec, Candidate, Any]], batch: int
) -> tuple[list[str], list[Candidate]]:
    """What would fit: a smaller batch and a shorter sequence (both compiled, with the
    least-memory named policy), more devices (estimated)."""
    if not named:
        return ["no candidate compiled (see the notes)"], []
    spec, least, _ = min(named, key=lambda x: (x[1].peak_bytes, x[1].step_time_s))
    g0 = session.structure.remat_group_size
    lines = [
        f"the least-memory configuration, {spec.name} at batch {batch}, peaks at "
        f"{format_bytes(least.peak_bytes)}: {format_bytes(least.peak_bytes - session.budget)} "
        "over the budget"
    ]
    extra: list[Candidate] = []
    family = session.program.family
    if batch > 1 and session.room() > 0 and family.takes("batch_size"):
        first = session.candidates([spec], g0, 1, "advice")
        if first:
            best, probes = largest_batch(session, [(spec, first[0][1])])
            extra += [first[0][1], *probes]
            if best:
                lines.append(
                    f"smaller batch: batch {best[0].batch_size} fits with {spec.name} (peak "
                    f"{format_bytes(best[0].peak_bytes)}, compiled)"
                )
            else:
                lines.append(f"smaller batch: even batch 1 does not fit with {spec.name}")
    if family.takes("seq_len"):
        lines.append(shorter_sequence(session, spec, least, batch, extra))
    state = 2 * session.fixed_bytes - session.opt_state_bytes  # params, grads, opt state
    for n in DEVICE_COUNTS:
        estimate = least.peak_bytes - (1 - 1 / n) * state
        if estimate <= session.budget:
            lines.append(
                f"more devices: {n} devices sharding parameters, gradients and optimizer state "
                f"(FSDP / ZeRO-3), each at batch {batch} (global batch {n * batch}), would bring "
                f"{spec.name} to about {format_bytes(estimate)} per device (estimate, not "
                f"compiled: check it with remat-kit analyze --devices {n} --mesh fsdp={n})"
            )
            break
    else:
        lines.append(f"more devices: not even {DEVICE_COUNTS[-1]} FSDP devices (estimate)")
    return lines, extra


def shorter_sequence(
    session: Session, spec: PolicySpec, over: Candidate, batch: int, extra: list[Candidate]
) -> str:
    """The longest sequence found to fit: halve until one fits (at most :data:`SEQ_HALVINGS`),
    then one compile at the length where the chord between the fitting and the failing length
    meets the budget (rounded down to a multiple of 256). Peak grows at least linearly in the
    sequence (attention scores quadratically), so the chord crosses the budget at or before
    the true curve: the probe is conservative."""
    g0 = session.structure.remat_group_size
    seq, fit, tried = session.seq_len, None, None
    for _ in range(SEQ_HALVINGS):
        if seq // 2 < 1 or session.room() <= 0:
            break
        tried = seq // 2
        found = session.candidates([spec], g0, batch, "advice", seq_len=tried)
        if not found:
            break
        c = found[0][1]
        extra.append(c)
        if c.fits:
            fit = c
            break
        seq, over = tried, c
    if fit is None:
        if tried is None:
            return "shorter sequence: not tried (compile cap reached)"
        return f"shorter sequence: {spec.name} is still over the budget at seq {tried}"
    step = 256  # sequence lengths are multiples of 256 in practice (and of the kernels' tiles)
    span = over.peak_bytes - fit.peak_bytes
    if span > 0 and session.room() > 0:
        chord = fit.seq_len + (session.budget - fit.peak_bytes) * (seq - fit.seq_len) / span
        guess = int(chord) // step * step
        if fit.seq_len < guess < seq:
            found = session.candidates([spec], g0, batch, "advice", seq_len=guess)
            if found:
                extra.append(found[0][1])
                if found[0][1].fits:
                    fit = found[0][1]
    return (
        f"shorter sequence: seq {fit.seq_len} fits with {spec.name} at batch {batch} (peak "
        f"{format_bytes(fit.peak_bytes)}, compiled); run recommend at that length"
    )


class BudgetTooSmall(ValueError):
    """The budget is below the parameters and optimizer state alone: nothing can fit it. The
    message gives the compiled peak of the usual least-memory policy, a budget that fits.
    ``remat-kit recommend`` exits 1 for it, as when nothing fits."""


def too_small(session: Session, budget: int, batch: int, params: int, opt_state: int) -> str:
    """The one-line message for a budget below the parameters and optimizer state, with the
    compiled peak of the policies that usually need the least memory (a user's program:
    ``save-nothing`` at its own shapes): a budget known to fit, not the least (a selective
    policy can peak lower, e.g. where recomputing a large intermediate holds two at once)."""
    layers = session.structure
    if layers is None:
        low, group, at = ["save-nothing"], None, "at its own shapes"
    else:
        offload = ["offload-layer-inputs"] if can_offload(session.target) else []
        low, group, at = ["save-nothing", *offload], layers.remat_group_size, f"at batch {batch}"
    found = session.candidates(
        [get_policy_spec(n) for n in low], group, batch if layers else None, "advice"
    )
    least = min(((c.peak_bytes, s.name) for s, c, _ in found), default=None)
    fits = (
        f"; {least[1]} {at} peaks at {format_bytes(least[0])}: a budget of "
        f"{format_bytes(least[0], up=True)} fits it (compiled; another policy may need less)"
        if least
        else ""
    )
    optimizer = session.optimizer or "optimizer"  # a user's program names none
    return (
        f"budget {format_bytes(budget)} is smaller than the parameters and optimizer state alone "
        f"({format_bytes(params + opt_state)}: params {format_bytes(params)} + {optimizer} state "
        f"{format_bytes(opt_state)}): no policy fits it{fits}"
    )


def fixed_program_advice(session: Session, candidates: Sequence[Candidate]) -> list[str]:
    """When nothing fits a program that cannot vary (a user's): the least-memory candidate
    and the budget it needs (compiled), then only what can be done for it (its factory's
    shapes, a device with more memory, sharding inside its own step); no command that takes
    presets only (``analyze --devices/--mesh``)."""
    if not candidates:
        return ["no candidate compiled (see the notes)"]
    least = min(candidates, key=lambda c: (c.peak_bytes, c.step_time_s))
    name, target = session.program.name, session.target
    lines = [
        f"the least-memory configuration, {least.label}, peaks at "
        f"{format_bytes(least.peak_bytes)}: {format_bytes(least.peak_bytes - session.budget)} over "
        "the budget; a budget of "
        f"{format_bytes(least.peak_bytes, up=True)} fits it (compiled)",
        f"smaller inputs (batch, sequence length, image size): change the argument shapes "
        f"{name!r} is built with (its factory) and run recommend again",
    ]
    bigger = [
        t.name for t in sorted(T.TARGETS.values(), key=lambda t: t.memory_bytes or 0)
        if t.memory_bytes and t.peak_flops_bf16 and t.name != target.name
        and t.memory_bytes * (1 - session.margin) >= least.peak_bytes
    ]  # fmt: skip
    usable = target.memory_bytes and target.memory_bytes * (1 - session.margin)
    if bigger and (not usable or usable < least.peak_bytes):
        lines.append(
            f"a device with more memory: {', '.join(bigger)} (memory less the "
            f"{session.margin:.0%} margin holds {format_bytes(least.peak_bytes)}); run recommend "
            f"again with --target {bigger[0]} (it compiles there anew)"
        )
    lines.append(
        "more devices: shard parameters and optimizer state inside the program's own step "
        "(FSDP with jax.sharding); recommend and analyze compile a program on one device "
        "as given, so they cannot check that sharding for you"
    )
    return lines
