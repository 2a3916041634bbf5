"""Structural search stages of recommend: cuDNN attention, chunked cross-entropy and nested
remat when the plain step does not fit, and partial-layer remat when a full-remat policy fits
with room.

Both stages change the model's ``ModelConfig`` (``attention``, ``loss_chunk_size``,
``nested_remat`` / ``nested_groups``, ``remat_layers``) rather than the policy, and compile every
candidate they return.

* :func:`search_structure`: the options in order of cost (cuDNN flash attention where
  :func:`~remat_kit.models.attention_support.attention_choices` allows it: fewer FLOPs and no
  [batch, heads, seq, seq] scores; then chunked cross-entropy: the LM head runs once more; then
  both; then nested remat, alone and with the others: every block's forward runs once more),
  each on the candidates that do not fit and are faster than the best fit: the least-memory
  one first (its compiled saving is the estimate for the others), then the fastest ones whose
  peak less that saving would fit, at most :data:`STRUCTURE_PROBES` per option. Nested remat
  (Chen et al. 2016, arXiv:1604.06174; :mod:`remat_kit.models.layer_remat`) keeps one outer
  segment's residuals at a time instead of every layer's, so its saving grows with the policy's
  residuals: the estimate for another policy adds ``(1 - 1/G)`` times the difference of their
  residual bytes (G outer groups). The first option that makes something fit ends the stage.
* :func:`search_partial_layers`: the pick under a full-remat policy (every layer recomputed, not
  nested); the first ``k`` of ``L`` layers under it, the rest not rematerialised, for the least
  ``k`` that fits (Megatron-LM's ``--recompute-method block --recompute-num-layers k``). Peak is
  close to affine in ``k`` (each layer taken out of remat keeps its activations): a secant
  between the bracketing compiled points (``k = L`` fits; ``k = 0`` is no-remat, compiled or
  unknown) for :data:`SECANT_PROBES` compiles, then bisection, until ``k`` fits and ``k - 1`` was
  compiled not to: at most :func:`partial_probes` ``(L) = SECANT_PROBES + ceil(log2 L)`` compiles
  per policy, or fewer where the session's compile cap stops it (said in the notes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from remat_kit.models.attention_support import attention_choices
from remat_kit.models.config import ModelConfig
from remat_kit.models.layer_remat import sqrt_groups
from remat_kit.policies import PolicySpec
from remat_kit.recommend.session import Session
from remat_kit.recommend.types import Candidate, Structure
from remat_kit.units import format_bytes as _g
from remat_kit.units import format_seconds

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

Triple = tuple[PolicySpec, Candidate, Any]


def loss_chunk(seq_len: int) -> int | None:
    """The chunk the search tries: :data:`LOSS_CHUNK` tokens where it divides ``seq_len`` into 2
    or more chunks, else ``seq_len // 8`` where that divides it; None (no chunking) otherwise."""
    if seq_len % LOSS_CHUNK == 0 and seq_len > LOSS_CHUNK:
        return LOSS_CHUNK
    if seq_len % 8 == 0 and seq_len >= 16:
        return seq_len // 8
    return None


def nested_groups(config: ModelConfig) -> int | None:
    """Nested remat's outer group count for the search (:func:`sqrt_groups`), or None where it
    does not apply: the config is nested already, not a per-layer scan at group size 1, has
    partial-layer remat, or has no divisor of ``num_layers`` strictly between 1 and L."""
    ok = config.scan_layers and config.remat_group_size == 1 and not config.layer_structure
    groups = sqrt_groups(config.num_layers)
    return groups if ok and 1 < groups < config.num_layers else None


def structural_options(session: Session) -> list[tuple[str, Structure]]:
    """``(label, overrides)`` in order of cost: cuDNN attention, chunked loss, both, nested remat,
    nested remat with the others (those the target, the config and the sequence allow, and the
    config does not already have)."""
    config = session.config
    cudnn = config.attention == "xla" and "cudnn" in attention_choices(session.target, config)
    chunk = loss_chunk(session.seq_len) if config.loss_chunk_size is None else None
    cheap: list[tuple[str, Structure]] = []
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
    groups = nested_groups(config)
    if groups is None:
        return cheap
    nested = (("nested_groups", groups), ("nested_remat", True))
    label = f"nested_remat=True, nested_groups={groups}"
    out = [*cheap, (label, nested)]
    if cheap:
        others, overrides = cheap[-1]
        out.append((f"{others} + {label}", tuple(sorted((*overrides, *nested)))))
    return out


def _distinct(triples: Sequence[Triple]) -> list[Triple]:
    seen: set[tuple] = set()
    out = []
    for t in triples:
        key = (t[1].peak_bytes, t[1].host_bytes, t[1].flops)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _residual_bytes(report: Any) -> int:
    """Device bytes of the saved residuals of every layer (the analyzer's jaxpr table)."""
    return sum(r.nbytes for r in report.residuals if r.memory == "device")


def _saving(structure: Structure, least: Triple, compiled: Triple, other: Triple) -> float:
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
    session: Session, named: Sequence[Triple], batch: int, best_time: float
) -> list[Triple]:
    """Structural options on the named candidates that do not fit and are faster than
    ``best_time`` (the best fit so far, ``inf`` if none); see the module docstring.

    Returns:
      Every candidate compiled, as (spec, candidate, report).
    """
    g0 = session.config.remat_group_size
    over = _distinct([t for t in named if not t[1].fits and t[1].step_time_s < best_time])
    out: list[Triple] = []
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


def structure_of(c: Candidate) -> Structure:
    """The candidate's structural overrides (the ``Structure`` it was compiled with)."""
    return tuple(sorted(c.options.items()))


def search_partial_layers(
    session: Session, pool: Sequence[Triple], pick: Candidate | None, batch: int
) -> list[Triple]:
    """Fewer rematerialised layers for the pick's policy (and the least-memory fitting full-remat
    policy with the same options); see the module docstring.

    Args:
      pool: every (spec, candidate, report) compiled so far at the batch asked.
      pick: the best fit so far; nothing is searched unless it is a full-remat policy at group
        size 1 with every layer rematerialised, not nested.

    Returns:
      Every candidate compiled, as (spec, candidate, report).
    """
    config = session.config
    if pick is None or pick.remat_layers is not None or pick.remat_group_size != 1:
        return []
    if pick.policy == "no-remat" or not config.scan_layers or config.layer_structure:
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
    out: list[Triple] = []
    for spec, full, _ in _distinct(mine + [least]):
        out += _bisect_layers(session, spec, full, none[0] if none else None, base, batch)
    return out


def _bisect_layers(
    session: Session,
    spec: PolicySpec,
    full: Candidate,
    none: Candidate | None,
    base: Structure,
    batch: int,
) -> list[Triple]:
    """The least ``remat_layers`` that fits for ``spec``: secant, then bisection, until the
    bracket closes (``k`` fits, ``k - 1`` compiled not to; ``k = 0`` is no-remat), within
    :func:`partial_probes` compiles and the session's cap (a note says when it did not close)."""
    layers = session.config.num_layers
    points = {layers: full.peak_bytes} | ({0: none.peak_bytes} if none is not None else {})
    fit, miss = layers, 0
    out: list[Triple] = []
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


def _without(c: Candidate, drop: Sequence[str]) -> Structure:
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
        f"; remat_layers={least.remat_layers} is the least that fits ({_g(least.peak_bytes)}, "
        f"est. {format_seconds(least.step_time_s)} from its compiled kernels, XLA's own "
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
            f": {pick.label} on every layer{other} peaks at {_g(plain.peak_bytes)} without it, "
            f"{_g(with_it.peak_bytes)} with it"
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
            gain = 1 - pick.step_time_s / full.step_time_s
            line += (
                f", est. step {format_seconds(pick.step_time_s)} vs "
                f"{format_seconds(full.step_time_s)} "
                f"with {pick.policy} on every layer ({gain:.1%} less), peak "
                f"{_g(pick.peak_bytes)} vs {_g(full.peak_bytes)} (compiled)"
            )
        parts.append(line + _least_layers(pick, candidates))
    return "; ".join(parts)
