"""When nothing fits: what would (a smaller batch and a shorter sequence, compiled; more
devices, estimated), and the message for a budget below the parameters and optimizer state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from remat_kit import targets as T
from remat_kit.policies import PolicySpec, get_policy_spec
from remat_kit.recommend.budget import format_gib as _gib
from remat_kit.recommend.search import largest_batch
from remat_kit.recommend.session import Session
from remat_kit.recommend.types import Candidate
from remat_kit.remat_impl import can_offload
from remat_kit.units import format_bytes

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
    g0 = session.config.remat_group_size
    lines = [
        f"the least-memory configuration, {spec.name} at batch {batch}, peaks at "
        f"{_gib(least.peak_bytes)}: {_gib(least.peak_bytes - session.budget)} over the budget"
    ]
    extra: list[Candidate] = []
    if batch > 1 and session.room() > 0:
        first = session.candidates([spec], g0, 1, "advice")
        if first:
            best, probes = largest_batch(session, [(spec, first[0][1])])
            extra += [first[0][1], *probes]
            if best:
                lines.append(
                    f"smaller batch: batch {best[0].batch_size} fits with {spec.name} (peak "
                    f"{_gib(best[0].peak_bytes)}, compiled)"
                )
            else:
                lines.append(f"smaller batch: even batch 1 does not fit with {spec.name}")
    lines.append(shorter_sequence(session, spec, least, batch, extra))
    state = 2 * session.fixed_bytes - session.opt_state_bytes  # params, grads, opt state
    for n in DEVICE_COUNTS:
        estimate = least.peak_bytes - (1 - 1 / n) * state
        if estimate <= session.budget:
            lines.append(
                f"more devices: {n} devices sharding parameters, gradients and optimizer state "
                f"(FSDP / ZeRO-3), each at batch {batch} (global batch {n * batch}), would bring "
                f"{spec.name} to about {_gib(estimate)} per device (estimate, not compiled: check "
                f"it with remat-kit analyze --devices {n} --mesh fsdp={n})"
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
    g0 = session.config.remat_group_size
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
        f"{_gib(fit.peak_bytes)}, compiled); run recommend at that length"
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
    config = session.config
    if config is None:
        low, group, at = ["save-nothing"], None, "at its own shapes"
    else:
        offload = ["offload-layer-inputs"] if can_offload(session.target) else []
        low, group, at = ["save-nothing", *offload], config.remat_group_size, f"at batch {batch}"
    found = session.candidates(
        [get_policy_spec(n) for n in low], group, batch if config else None, "advice"
    )
    least = min(((c.peak_bytes, s.name) for s, c, _ in found), default=None)
    fits = (
        f"; {least[1]} {at} peaks at {_gib(least[0])}: a budget of "
        f"{format_bytes(least[0], up=True)} fits it (compiled; another policy may need less)"
        if least
        else ""
    )
    optimizer = session.optimizer or "optimizer"  # a user's program names none
    return (
        f"budget {_gib(budget)} is smaller than the parameters and optimizer state alone "
        f"({_gib(params + opt_state)}: params {_gib(params)} + {optimizer} state "
        f"{_gib(opt_state)}): no policy fits it{fits}"
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
        f"the least-memory configuration, {least.label}, peaks at {_gib(least.peak_bytes)}: "
        f"{_gib(least.peak_bytes - session.budget)} over the budget; a budget of "
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
            f"{session.margin:.0%} margin holds {_gib(least.peak_bytes)}); run recommend again "
            f"with --target {bigger[0]} (it compiles there anew)"
        )
    lines.append(
        "more devices: shard parameters and optimizer state inside the program's own step "
        "(FSDP with jax.sharding); recommend and analyze compile a program on one device "
        "as given, so they cannot check that sharding for you"
    )
    return lines
