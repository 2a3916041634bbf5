"""Search stages of recommend past the named policies: other remat group sizes, and the
largest batch that fits (``batch_size="auto"``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from remat_kit import names as N
from remat_kit.policies import PolicySpec
from remat_kit.recommend.session import Session
from remat_kit.recommend.types import Candidate

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
    g0 = session.config.remat_group_size
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
    g0 = session.config.remat_group_size
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


def distinct(
    named: Sequence[tuple[PolicySpec, Candidate, Any]],
) -> list[tuple[PolicySpec, Candidate]]:
    """Named candidates less those compiled to the same program as an earlier one (same peak,
    host bytes and FLOPs: at group size 1, save-layer-inputs is save-nothing)."""
    seen: set[tuple] = set()
    out = []
    for spec, c, _ in named:
        key = (c.peak_bytes, c.host_bytes, c.flops)
        if key not in seen:
            seen.add(key)
            out.append((spec, c))
    return out
