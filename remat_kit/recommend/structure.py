"""Structural search stages of recommend: cuDNN attention and chunked cross-entropy when the
plain step does not fit, and partial-layer remat when a full-remat policy fits with room.

Both stages change the model's ``ModelConfig`` (``attention``, ``loss_chunk_size``,
``remat_layers``) rather than the policy, and compile every candidate they return.

* :func:`search_structure`: the options in order of cost (cuDNN flash attention where
  :func:`~remat_kit.models.attention_support.attention_choices` allows it: fewer FLOPs and no
  [batch, heads, seq, seq] scores; then chunked cross-entropy: the LM head runs once more; then
  both), each on the candidates that do not fit and are faster than the best fit: the least-memory
  one first (its compiled saving is the estimate for the others), then the fastest ones whose peak
  less that saving would fit, at most :data:`STRUCTURE_PROBES` per option. The first option that
  makes something fit ends the stage.
* :func:`search_partial_layers`: the pick under a full-remat policy (every layer recomputed); the
  first ``k`` of ``L`` layers under it, the rest not rematerialised, for the least ``k`` that fits
  (Megatron-LM's ``--recompute-method block --recompute-num-layers k``). Peak is close to affine in
  ``k`` (each layer taken out of remat keeps its activations): a secant between the bracketing
  compiled points (``k = L`` fits; ``k = 0`` is no-remat, compiled or unknown), then bisection, at
  most :data:`PARTIAL_PROBES` compiles per policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from remat_kit.models.attention_support import attention_choices
from remat_kit.policies import PolicySpec
from remat_kit.recommend.session import Session
from remat_kit.recommend.types import Candidate, Structure
from remat_kit.units import format_bytes as _g

#: Candidates compiled per structural option.
STRUCTURE_PROBES = 3
#: Compiles per policy in the partial-layer search.
PARTIAL_PROBES = 5
#: Compiles the structure stages may add to the default compile cap: every option's probes and
#: the partial-layer search of two policies.
STRUCTURE_COMPILES = 3 * STRUCTURE_PROBES + 2 * PARTIAL_PROBES
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


def structural_options(session: Session) -> list[tuple[str, Structure]]:
    """``(label, overrides)`` in order of cost: cuDNN attention, chunked loss, both (those the
    target, the config and the sequence allow, and the config does not already have)."""
    config = session.config
    cudnn = config.attention == "xla" and "cudnn" in attention_choices(session.target, config)
    chunk = loss_chunk(session.seq_len) if config.loss_chunk_size is None else None
    out: list[tuple[str, Structure]] = []
    if cudnn:
        out.append(("attention='cudnn'", (("attention", "cudnn"),)))
    if chunk:
        out.append((f"loss_chunk_size={chunk}", (("loss_chunk_size", chunk),)))
    if cudnn and chunk:
        out.append(
            (
                f"attention='cudnn' + loss_chunk_size={chunk}",
                (("attention", "cudnn"), ("loss_chunk_size", chunk)),
            )
        )
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
        saving = least[1].peak_bytes - first[0][1].peak_bytes
        rest = sorted(
            (t for t in over if t is not least and t[1].peak_bytes - saving <= session.budget),
            key=lambda t: t[1].step_time_s,
        )[: min(STRUCTURE_PROBES - 1, session.room())]
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
        size 1 with every layer rematerialised.

    Returns:
      Every candidate compiled, as (spec, candidate, report).
    """
    config = session.config
    if pick is None or pick.remat_layers is not None or pick.remat_group_size != 1:
        return []
    if pick.policy == "no-remat" or not config.scan_layers or config.nested_remat:
        return []
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
    """The least ``remat_layers`` that fits for ``spec`` (secant, then bisection)."""
    layers = session.config.num_layers
    points = {layers: full.peak_bytes} | ({0: none.peak_bytes} if none is not None else {})
    fit, miss = layers, 0
    out: list[Triple] = []
    for probe in range(PARTIAL_PROBES):
        if fit - miss <= 1 or session.room() <= 0:
            break
        if miss in points and probe < 2 and points[miss] > points[fit]:
            frac = (points[miss] - session.budget) / (points[miss] - points[fit])
            k = miss + math.ceil((fit - miss) * frac)
        else:
            k = (miss + fit) // 2
        k = min(max(k, miss + 1), fit - 1)
        structure = tuple(sorted((*base, ("remat_layers", k))))
        found = session.candidates([spec], 1, batch, "partial-layers", structure=structure)
        if not found:
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
            f"{spec.name}: partial-layer search stopped at remat_layers={fit} of {layers} "
            "(not shown to be the least that fits)"
        )
    return out


def made_fit(pick: Candidate | None, candidates: Sequence[Candidate], layers: int) -> str | None:
    """What the pick's structural options did, against the same policy compiled without them
    (at the same group size, batch and sequence); None for a plain pick."""
    if pick is None or not pick.options:
        return None

    def twin(drop: tuple[str, ...]) -> Candidate | None:
        want = tuple((k, v) for k, v in structure_of(pick) if k not in drop)
        return next(
            (
                c for c in candidates
                if c.policy == pick.policy and c.actions == pick.actions
                and c.batch_size == pick.batch_size and c.seq_len == pick.seq_len
                and c.remat_group_size == pick.remat_group_size and structure_of(c) == want
            ),
            None,
        )  # fmt: skip

    parts = []
    opts = pick.options
    swap = tuple(k for k in ("attention", "loss_chunk_size") if k in opts)
    if swap:
        names = " + ".join(f"{k}={opts[k]!r}" for k in swap)
        plain, with_it = twin((*swap, "remat_layers")), twin(("remat_layers",))
        what = "made it fit" if plain is not None and not plain.fits else "is faster"
        ref = ""
        if plain is not None and with_it is not None:
            ref = (
                f": {pick.label} on every layer peaks at {_g(plain.peak_bytes)} without it, "
                f"{_g(with_it.peak_bytes)} with it"
            )
        parts.append(f"{names} {what}{ref} (compiled)")
    if "remat_layers" in opts:
        k, full = opts["remat_layers"], twin(("remat_layers",))
        line = f"remat_layers={k}: {layers - k} of {layers} layers not rematerialised"
        if full is not None:
            gain = 1 - pick.step_time_s / full.step_time_s
            line += (
                f", est. step {pick.step_time_s * 1e3:.4g} ms vs {full.step_time_s * 1e3:.4g} ms "
                f"with {pick.policy} on every layer ({gain:.1%} less), peak "
                f"{_g(pick.peak_bytes)} vs {_g(full.peak_bytes)} (compiled)"
            )
        parts.append(line)
    return "; ".join(parts)
