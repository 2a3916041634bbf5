"""``recommend``: the fastest remat configuration that fits a memory budget, verified by compiling.

Every configuration considered is compiled for the target (deviceless for GPU models, see
:mod:`remat_kit.targets`) by :func:`remat_kit.memory.analyze_policies`; its peak is XLA's own
figure and its FLOPs the compiled program's. Nothing is recommended that was not compiled and
found to fit.

**Estimated step time** (seconds), per candidate::

    compute_s  = compiled matmul FLOPs / target.peak_flops_bf16            # FLOP / (FLOP/s)
    fwd_s      = (FLOPs of the step without remat / 3) / peak              # forward = 1/3 of 3F
    bwd_s      = compute_s - fwd_s                                         # backward + recompute
    link_s     = host_bytes / target.host_link_bytes_per_s                 # per direction
    transfer_s = max(0, link_s - fwd_s) + max(0, link_s - bwd_s)
    step_time_s = compute_s + transfer_s

Offloaded residuals go device -> host during the forward pass and come back during the backward
pass, each direction at the link's full rate and overlapped with that pass's compute; only what
cannot hide behind it counts. This is a lower bound on the real step (100% of peak on matmuls,
elementwise ops and HBM traffic ignored): it ranks configurations, it does not predict wall time.
Host-link figures: :func:`host_link_source`.

**Search** (:func:`recommend`):

1. The named policies (:func:`remat_kit.policy_names`) at the config's ``remat_group_size``,
   compiled together (programs the analyzer finds identical compile once).
2. Other group sizes k, bounded: grouping k blocks into one remat segment drops the saved inputs of
   the inner blocks and recomputes at least as much, so a policy is compiled at k only if it does
   not fit at the base group size, is faster there than the best fit so far, and
   ``peak - (1 - k0/k) * (segment-input bytes)`` would fit.
3. ``batch_size="auto"``: the largest batch that fits, per policy (peak is close to affine in the
   batch: extrapolate, compile, bracket, bisect), and the tokens per second each would give.
4. ``solve=True``: a per-tag choice (recompute, save, offload), found by enumerating every
   combination (3^9 = 19,683 for a SwiGLU block) under an additive model, then verified by
   compiling the best predicted few (see :func:`solve_tags`).
5. Nothing fits: a shorter sequence (compiled), a smaller batch (compiled) and more devices
   (estimated) that would.

The pick is the fitting candidate with the least estimated step time (ties, as when offload
transfers hide completely: no host traffic first, then less device memory); with ``"auto"``, the
one with the most tokens per second.

Example::

    from remat_kit.recommend import recommend

    rec = recommend("llama3-8b", seq_len=8192, target="h200", solve=True)
    print(rec.line())   # nn.remat(Block, policy=remat_kit.custom_policy({...}))  # batch 1, ...
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from remat_kit import names as N
from remat_kit import targets as T
from remat_kit.models.config import ModelConfig
from remat_kit.policies import (
    TAG_ACTIONS,
    PolicySpec,
    custom_spec,
    get_policy_spec,
    policy_names,
)

GIB = 2**30
#: Fraction of device memory kept free by default: XLA's peak leaves out the CUDA context,
#: cuBLAS/cuDNN workspaces and allocator fragmentation (about 1-3 GiB on an 80 GB GPU). It
#: matches XLA:GPU's own target (``xla_gpu_memory_limit_slop_factor`` = 95%). Run with
#: ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``: JAX preallocates 75% of the GPU by default.
DEFAULT_MARGIN = 0.05
#: Custom-policy candidates compiled per verification round of :func:`solve_tags`.
SOLVE_VERIFY = 3
#: Verification rounds of :func:`solve_tags` before it gives up.
SOLVE_ROUNDS = 2
#: Probes per policy in the batch search before it stops.
BATCH_PROBES = 6
#: Halvings of the sequence tried when nothing fits.
SEQ_HALVINGS = 3
#: Device counts tried for the "more devices" estimate.
DEVICE_COUNTS = (2, 4, 8, 16, 32, 64)

FoundBy = Literal["named", "group-size", "batch-search", "solve", "advice"]
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
#: JAX's name for the jitted train step (``step`` in :func:`remat_kit.train.make_train_step`).
_STEP_FNS = ("jit(step)", "step")


# -- Sources --------------------------------------------------------------------------------


def host_link_source(target: T.Target) -> str:
    """Where a target's host<->device bandwidth (``Target.host_link_bytes_per_s``) comes from.

    PCIe Gen5 x16 (H100 SXM, H200): 32 GT/s x 16 lanes, 128b/130b encoding = 63 GB/s per
    direction, written 64 GB/s (NVIDIA datasheets give 128 GB/s for both directions together).
    PCIe Gen4 x16 (A100, L4): half that, 32 GB/s per direction (datasheets: 64 GB/s). These
    are line rates: real copies get less, so the time model's transfers are optimistic.
    """
    bw = target.host_link_bytes_per_s
    if bw is None:
        return f"target {target.name!r}: host link unknown"
    gen = {64e9: "PCIe Gen5 x16", 32e9: "PCIe Gen4 x16"}.get(bw)
    what = f"{gen}, " if gen else ""
    return (
        f"{bw / 1e9:.0f} GB/s per direction ({what}PCI-SIG line rate x16 lanes, 128b/130b; "
        f"{target.description} datasheet: see Target.source)"
    )


# -- Results --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled configuration and its estimated step time.

    Attributes:
      policy: a registered policy name, or ``"custom"`` (then ``actions`` says what it does).
      actions: for a custom policy, ``{tag: "save" | "offload"}`` (tags not listed recomputed).
      remat_group_size: blocks per remat segment; batch_size, seq_len: the step's shape.
      peak_bytes: XLA's device peak (bytes, per device). host_bytes: bytes in host memory.
      flops: compiled matmul FLOPs of the step. flops_no_remat: the same step without remat,
        counted on its jaxpr (the time model's forward share is a third of it).
      compute_s, transfer_s, step_time_s: the time model's seconds (see the module doc).
      tokens_per_s: ``batch_size * seq_len / step_time_s``.
      fits: ``peak_bytes <= budget``.
      found_by: which stage compiled it (``named``, ``group-size``, ``batch-search``, ``solve``).
      predicted_peak_bytes, predicted_step_time_s: the solver's prediction (``solve`` only).
      warnings: compiler messages (XLA's own rematerialisation, ...).
    """

    policy: str
    actions: dict[str, str] | None
    remat_group_size: int
    batch_size: int
    seq_len: int
    peak_bytes: int
    host_bytes: int
    flops: float | None
    flops_no_remat: float | None
    compute_s: float
    transfer_s: float
    step_time_s: float
    tokens_per_s: float
    fits: bool
    found_by: FoundBy
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    warnings: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """Policy name, or the custom actions (``custom: save key_proj; offload query_proj``)."""
        if self.actions is None:
            return self.policy
        parts = [
            f"{what} " + ",".join(sorted(t for t, a in self.actions.items() if a == what))
            for what in ("save", "offload")
            if what in self.actions.values()
        ]
        return "custom: " + ("; ".join(parts) or "recompute all")

    def code(self) -> str:
        """The one line to paste: ``nn.remat(Block, policy=...)`` and, as a comment, the batch
        and remat group size to use."""
        if self.actions is None:
            policy = f'remat_kit.policy("{self.policy}")'
        else:
            body = ", ".join(f'"{t}": "{a}"' for t, a in sorted(self.actions.items()))
            policy = f"remat_kit.custom_policy({{{body}}})"
        shape = f"batch {self.batch_size}, seq {self.seq_len}"
        if self.policy == "no-remat":
            return f"Block  # no remat: do not wrap the block in nn.remat; {shape}"
        return (
            f"nn.remat(Block, policy={policy})  # {shape}, remat_group_size={self.remat_group_size}"
        )


@dataclasses.dataclass(frozen=True)
class TagCost:
    """One checkpoint tag in the solver's additive model (bytes and FLOPs over all layers).

    Attributes:
      tag: the checkpoint name.
      nbytes: device bytes of its residuals when kept (from the jaxpr residual table).
      base_bytes: bytes of it that ``save-nothing`` keeps anyway (the segment inputs).
      flops_saved: jaxpr matmul FLOPs not recomputed when it is kept (saved or offloaded):
        FLOPs of the step saving nothing minus those saving only this tag.
    """

    tag: str
    nbytes: int
    base_bytes: int
    flops_saved: float


@dataclasses.dataclass(frozen=True)
class SolveSummary:
    """What :func:`solve_tags` enumerated, predicted and verified.

    Attributes:
      tags: the model's per-tag costs.
      actions: the actions allowed per tag (offload only on targets where it is real).
      combinations: how many per-tag choices were enumerated (all of them: the search is exact
        under the model). predicted_fit: how many the model predicted to fit (within the slack).
      peak_slack_bytes: how far above the budget a prediction may be and still be compiled: the
        model's largest overestimate of a compiled named policy (0 if it never overestimated).
      flops_scale: compiled / jaxpr FLOPs of ``save-nothing``: predictions are scaled by it.
      verified: the custom candidates compiled, best predicted first.
      calibration: (policy, predicted peak, compiled peak) for the named policies the model can
        express.
    """

    tags: tuple[TagCost, ...]
    actions: tuple[str, ...]
    combinations: int
    predicted_fit: int
    peak_slack_bytes: int
    flops_scale: float
    verified: tuple[Candidate, ...]
    calibration: tuple[tuple[str, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The answer of :func:`recommend`. Integers are bytes, times seconds.

    Attributes:
      model, target, seq_len: what was asked. batch_size: the batch asked (None for ``auto``).
      budget_bytes: the per-device budget; budget_note: where it comes from.
      arguments: bytes of the step's arguments (``params``, ``opt_state``, ``batch`` at the
        batch asked, 1 for ``auto``).
      pick: the fastest candidate that fits (most tokens/s for ``auto``), or None.
      candidates: every candidate compiled, in the order found.
      largest_batch: with ``auto``, the largest batch that fits for each distinct policy.
      compiles: XLA compiles of the train step this call ran, counted from JAX's own
        backend-compile events (identical programs are compiled once; persistent-cache hits would
        count). reused: candidates taken from the ``cache`` (not compiled again).
      wall_s: seconds this call took.
      advice: when nothing fits: what would (each line says whether it was compiled).
      notes: the assumptions and limits of this answer (time model, search bounds, skipped).
      solve: the solver's summary, with ``solve=True``.
      peak_flops, host_link_bytes_per_s, host_link: the time model's figures and their source.
    """

    model: str
    target: str
    seq_len: int
    batch_size: int | None
    optimizer: str
    budget_bytes: int
    budget_note: str
    arguments: dict[str, int]
    pick: Candidate | None
    candidates: tuple[Candidate, ...]
    largest_batch: tuple[Candidate, ...]
    compiles: int
    reused: int
    wall_s: float
    advice: tuple[str, ...]
    notes: tuple[str, ...]
    solve: SolveSummary | None
    peak_flops: float
    host_link_bytes_per_s: float | None
    host_link: str

    def line(self) -> str:
        """The pick as one line of code, or what would fit when nothing does."""
        if self.pick is None:
            return "nothing fits: " + ("; ".join(self.advice) or "no candidate compiled")
        return self.pick.code()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``line``)."""
        return {**dataclasses.asdict(self), "line": self.line()}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


# -- The time model -------------------------------------------------------------------------


def step_time(
    target: T.Target, flops: float, flops_no_remat: float, host_bytes: int
) -> tuple[float, float]:
    """``(compute_s, transfer_s)`` of a step (see the module doc for the model).

    Args:
      target: gives ``peak_flops_bf16`` (FLOP/s) and ``host_link_bytes_per_s`` (bytes/s).
      flops: compiled matmul FLOPs; flops_no_remat: FLOPs of the step without remat.
      host_bytes: bytes offloaded to host memory (each crosses the link once each way).

    Raises:
      ValueError: the target's peak FLOP/s is unknown.
    """
    if not target.peak_flops_bf16:
        raise ValueError(f"target {target.name!r} has no peak FLOP/s; pick a GPU target")
    peak = target.peak_flops_bf16
    compute = flops / peak
    if host_bytes <= 0 or not target.host_link_bytes_per_s:
        return compute, 0.0
    fwd = min(compute, flops_no_remat / 3 / peak)
    link = host_bytes / target.host_link_bytes_per_s
    return compute, max(0.0, link - fwd) + max(0.0, link - (compute - fwd))


# -- Compiling candidates -------------------------------------------------------------------


class _CompileCounter:
    """Counts XLA compiles of the train step: ``jax.monitoring`` backend-compile events whose
    function is ``jit(step)`` (:func:`remat_kit.train.make_train_step`). Identical programs that
    the analyzer dedupes are compiled once, so they count once."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == _BACKEND_COMPILE_EVENT and kwargs.get("fun_name") in _STEP_FNS:
            with self._lock:
                self.count += 1


@contextmanager
def _counting() -> Iterator[_CompileCounter]:
    import jax.monitoring

    counter = _CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)


def _spec_key(spec: PolicySpec) -> tuple:
    return (spec.base, tuple(sorted(spec.save)), tuple(sorted(spec.offload)), spec.wrap)


class CompileCache:
    """Compiled reports memoised by (model, seq, target, optimizer, policy, group size, batch).

    Pass one to several :func:`recommend` calls (different budgets, say) to compile each
    configuration once; a report taken from it counts as ``reused``, not as a compile.
    """

    def __init__(self):
        self.reports: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.reports)


@dataclasses.dataclass
class _Session:
    """What one :func:`recommend` call compiles against, and its compile accounting."""

    config: ModelConfig  # at the base group size
    seq_len: int
    target: T.Target
    optimizer: str
    budget: int
    cache: CompileCache
    counter: _CompileCounter
    workers: int | None
    max_compiles: int
    fixed_bytes: int  # arguments that do not depend on the batch (params + opt_state)
    opt_state_bytes: int
    reused: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def compiles(self) -> int:
        return self.counter.count

    def room(self) -> int:
        """Compiles left under ``max_compiles``."""
        return max(0, self.max_compiles - self.compiles)

    def arguments(self, batch: int, seq_len: int | None = None) -> int:
        """Argument bytes of the step at ``batch`` (inputs and targets are int32)."""
        return self.fixed_bytes + 2 * batch * (seq_len or self.seq_len) * 4

    def evaluate(
        self, specs: Sequence[PolicySpec], group: int, batch: int, seq_len: int | None = None
    ) -> list[Any]:
        """Reports (or ``CompileError``) of ``specs`` at (group, batch, seq), cached; the
        uncached ones compiled together by :func:`remat_kit.memory.analyze_policies`."""
        from remat_kit.memory import analyze_policies

        seq = seq_len or self.seq_len
        keys = [
            (self.config, seq, self.target, self.optimizer, _spec_key(s), group, batch)
            for s in specs
        ]
        todo = {k: s for k, s in zip(keys, specs, strict=True) if k not in self.cache.reports}
        self.reused += sum(1 for k in keys if k not in todo)
        if todo:
            config = self.config.replace(remat_group_size=group)
            results = analyze_policies(
                config, batch, seq, list(todo.values()), target=self.target,
                optimizer=self.optimizer, budget_bytes=self.budget, top_k=0,
                workers=self.workers, raise_errors=False, compare_offload=False,
            )  # fmt: skip
            self.cache.reports.update(zip(todo, results, strict=True))
        return [self.cache.reports[k] for k in keys]

    def candidates(
        self,
        specs: Sequence[PolicySpec],
        group: int,
        batch: int,
        found_by: FoundBy,
        seq_len: int | None = None,
    ) -> list[tuple[PolicySpec, Candidate, Any]]:
        """Compile (or reuse) and turn into candidates; compile failures become notes."""
        out = []
        for spec, report in zip(specs, self.evaluate(specs, group, batch, seq_len), strict=True):
            c = self._candidate(report, spec, group, batch, found_by, seq_len or self.seq_len)
            if c is not None:
                out.append((spec, c, report))
        return out

    def _candidate(
        self, report: Any, spec: PolicySpec, group: int, batch: int, found_by: FoundBy, seq: int
    ) -> Candidate | None:
        from remat_kit.memory import CompileError

        actions = None
        if spec.name == "custom":
            actions = {t: "save" for t in spec.save} | {t: "offload" for t in spec.offload}
        if isinstance(report, CompileError):
            self.notes.append(f"{spec.name} (group {group}, batch {batch}): {report}")
            return None
        flops = report.flops
        if flops is None:
            self.notes.append(f"{spec.name}: no FLOPs in XLA's dump; ranked last")
            compute, transfer = math.inf, 0.0
        else:
            compute, transfer = step_time(
                self.target, flops, report.flops_no_remat or 0.0, report.host_bytes
            )
        total = compute + transfer
        return Candidate(
            policy="custom" if actions is not None else spec.name,
            actions=actions,
            remat_group_size=group,
            batch_size=batch,
            seq_len=seq,
            peak_bytes=report.peak_bytes,
            host_bytes=report.host_bytes,
            flops=flops,
            flops_no_remat=report.flops_no_remat,
            compute_s=compute,
            transfer_s=transfer,
            step_time_s=total,
            tokens_per_s=batch * seq / total if 0 < total < math.inf else 0.0,
            fits=report.peak_bytes <= self.budget,
            found_by=found_by,
            warnings=tuple(report.warnings),
        )


def _rank(c: Candidate) -> tuple:
    """Least estimated time; on a tie (offload transfers fully hidden), no host traffic over
    some (the overlap is the least certain part of the model), then least device memory."""
    return (c.step_time_s, c.host_bytes, c.peak_bytes)


# -- Budget ---------------------------------------------------------------------------------


def parse_budget(budget: int | float | str) -> int:
    """Bytes from an int, a float (``8e10``) or a string (``"76GiB"``, ``"80GB"``, ``"8e10"``;
    the units of :func:`remat_kit.units.parse_bytes`: kB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB
    powers of 1024).

    Raises:
      ValueError: not a positive size (the message lists the units).
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be a size in bytes, got {budget!r}")
    if isinstance(budget, (int, float)):
        if not 0 < budget < math.inf:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        return int(budget)
    from remat_kit.units import parse_bytes

    try:
        return parse_bytes(str(budget))
    except ValueError as err:
        raise ValueError(f"budget: {err}") from None


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


# -- Stage 2: group sizes -------------------------------------------------------------------


def _group_search(
    session: _Session,
    named: Sequence[tuple[PolicySpec, Candidate, Any]],
    group_sizes: Sequence[int],
    batch: int,
) -> list[Candidate]:
    """Other ``remat_group_size`` values, compiled only where the bound says one could fit and
    be faster (see the module doc). Group sizes in increasing order, one compile round each."""
    g0 = session.config.remat_group_size
    best = min((c.step_time_s for _, c, _ in named if c.fits), default=math.inf)
    open_: dict[str, tuple[PolicySpec, Candidate, int]] = {}
    for spec, c, report in named:
        if c.fits or not spec.wrap or N.DECODER_LAYER_INPUT in spec.tags:
            continue  # fits already (grouping only adds FLOPs); no remat; inner inputs kept
        inputs = sum(
            r.nbytes
            for r in report.residuals
            if r.tag == N.DECODER_LAYER_INPUT and r.memory == "device"
        )
        open_[spec.name] = (spec, c, inputs)
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
                open_.pop(spec.name, None)
    return out


# -- Stage 3: the largest batch -------------------------------------------------------------


@dataclasses.dataclass
class _Bracket:
    """The batch search of one policy: ``lo`` fits (compiled), ``hi`` does not (or None)."""

    spec: PolicySpec
    lo: Candidate | None
    hi: int | None
    points: dict[int, int]  # batch -> compiled peak bytes
    probes: int = 0

    def next_probe(self, budget: int, fixed: int) -> int | None:
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
        self.probes += 1
        if c is not None:
            self.points[batch] = c.peak_bytes
        if c is not None and c.fits:
            if batch > self.lo.batch_size:  # type: ignore[union-attr]
                self.lo = c
        else:
            self.hi = batch if self.hi is None else min(self.hi, batch)


def _largest_batch(
    session: _Session, first: Sequence[tuple[PolicySpec, Candidate]]
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
        _Bracket(spec, c if c.fits else None, None if c.fits else 1, {1: c.peak_bytes})
        for spec, c in first
    ]
    probes_all: list[Candidate] = []
    while True:
        wanted: dict[int, list[_Bracket]] = {}
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


# -- Stage 4: the per-tag solver ------------------------------------------------------------


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
    from remat_kit.memory import model_residuals
    from remat_kit.memory.flops import traced_flops
    from remat_kit.train import (
        abstract_batch,
        abstract_train_state,
        make_optimizer,
        make_train_step,
    )

    opt = make_optimizer(optimizer)
    tags = list(config.checkpoint_names)
    everything = config.replace(remat_policy=custom_spec({t: "save" for t in tags}))
    kept = {r.tag: r.nbytes for r in model_residuals(everything, batch_size, seq_len)}
    nothing = config.replace(remat_policy="save-nothing")
    base = {
        r.tag: r.nbytes
        for r in model_residuals(nothing, batch_size, seq_len)
        if r.memory == "device"
    }
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
    session: _Session,
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
    g0 = session.config.remat_group_size
    costs, fj0 = tag_costs(session.config, batch, session.seq_len, session.optimizer)
    actions = TAG_ACTIONS if session.target.supports_host_offload else ("save", "recompute")
    choices = []
    for tc in costs:
        opts = ["recompute"]
        if "save" in actions and tc.flops_saved > 0:
            opts.append("save")
        if "offload" in actions and (tc.flops_saved > 0 or tc.base_bytes > 0):
            opts.append("offload")
        choices.append(opts)
    peak0 = save_nothing.peak_bytes
    scale = (save_nothing.flops or fj0) / fj0 if fj0 else 1.0
    f_base = save_nothing.flops_no_remat or 0.0

    known = {tc.tag for tc in costs}
    calibration = []
    for spec, c, _ in named:
        if spec.base == "names" and spec.wrap and spec.tags <= known:
            predicted, _, _ = _predict(costs, [spec.action(tc.tag) for tc in costs], peak0)
            calibration.append((spec.name, predicted, c.peak_bytes))
    slack = max([0] + [p - c for _, p, c in calibration])

    ranked = []
    combos = 0
    for choice in itertools.product(*choices):
        combos += 1
        peak, host, saved = _predict(costs, choice, peak0)
        if peak > session.budget + slack:
            continue
        compute, transfer = step_time(session.target, (fj0 - saved) * scale, f_base, host)
        kept = sum(a != "recompute" for a in choice)
        ranked.append((compute + transfer, host, peak, kept, choice))
    # Least time; on a tie (transfers fully hidden), least host traffic, then least memory.
    ranked.sort(key=lambda r: r[:4])
    # Choices the model cannot tell apart (mlpwi_0 and mlpwi_1 swapped) are compiled once.
    distinct, seen = [], set()
    for r in ranked:
        if r[:3] not in seen:
            seen.add(r[:3])
            distinct.append(r)

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
            c = session._candidate(report, spec, g0, batch, "solve", session.seq_len)
            if c is not None:
                verified.append(
                    dataclasses.replace(
                        c, predicted_peak_bytes=p_pred, predicted_step_time_s=t_pred
                    )
                )
        if any(c.fits for c in verified):
            break
    return SolveSummary(
        tags=tuple(costs),
        actions=tuple(actions),
        combinations=combos,
        predicted_fit=len(ranked),
        peak_slack_bytes=int(slack),
        flops_scale=scale,
        verified=tuple(verified),
        calibration=tuple(calibration),
    )


# -- Stage 5: nothing fits ------------------------------------------------------------------


def _advice(
    session: _Session, named: Sequence[tuple[PolicySpec, Candidate, Any]], batch: int
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
            best, probes = _largest_batch(session, [(spec, first[0][1])])
            extra += [first[0][1], *probes]
            if best:
                lines.append(
                    f"smaller batch: batch {best[0].batch_size} fits with {spec.name} (peak "
                    f"{_gib(best[0].peak_bytes)}, compiled)"
                )
            else:
                lines.append(f"smaller batch: even batch 1 does not fit with {spec.name}")
    lines.append(_shorter_sequence(session, spec, least, batch, extra))
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


def _shorter_sequence(
    session: _Session, spec: PolicySpec, over: Candidate, batch: int, extra: list[Candidate]
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


def _too_small(session: _Session, budget: int, batch: int, params: int, opt_state: int) -> str:
    """The one-line message for a budget below the parameters and optimizer state, with the
    smallest compiled peak of the least-memory policies."""
    low = ["save-nothing"] + (["offload-layer-inputs"] if session.target.supports_host_offload
                              else [])  # fmt: skip
    found = session.candidates(
        [get_policy_spec(n) for n in low], session.config.remat_group_size, batch, "advice"
    )
    least = min(((c.peak_bytes, s.name) for s, c, _ in found), default=None)
    smallest = (
        f"{_gib(least[0])} ({least[1]} at batch {batch}, compiled)"
        if least
        else f"above {_gib(params + opt_state)}"
    )
    return (
        f"budget {_gib(budget)} is smaller than the parameters and optimizer state alone "
        f"({_gib(params + opt_state)}: params {_gib(params)} + {session.optimizer} state "
        f"{_gib(opt_state)}); the smallest budget that could work is {smallest}"
    )


# -- Entry point ----------------------------------------------------------------------------


def recommend(
    model: str | ModelConfig,
    seq_len: int,
    target: str | T.Target = "h100-sxm",
    *,
    batch_size: int | Literal["auto"] = 1,
    budget: int | float | str | None = None,
    solve: bool = False,
    policies: Sequence[str] | None = None,
    group_sizes: Sequence[int] | None = None,
    optimizer: str = "adamw",
    margin: float = DEFAULT_MARGIN,
    max_compiles: int | None = None,
    workers: int | None = None,
    cache: CompileCache | None = None,
) -> Recommendation:
    """The configuration with the least estimated step time whose compiled peak fits the budget.

    Args:
      model: a preset name (``"llama3-8b"``) or a :class:`~remat_kit.ModelConfig`; its
        ``remat_group_size`` is the base group size.
      seq_len: tokens per sequence.
      target: a GPU target name (``"h100-sxm"``, ``"h200"``, ``"a100-80gb"``, ``"a100-40gb"``,
        ``"l4"``) or a :class:`~remat_kit.targets.Target` with known peak FLOP/s.
      batch_size: sequences per step, or ``"auto"``: the largest batch that fits per policy,
        the pick being the one with the most tokens per second.
      budget: per-device bytes (int or float), or a size string (``"76GiB"``, ``"80GB"``,
        ``"8e10"``); default the target's memory less ``margin``.
      solve: also search per-tag choices (:func:`solve_tags`); not with ``"auto"``.
      policies: the named policies to consider (default all; offloading ones are skipped on
        targets where offload is not real).
      group_sizes: ``remat_group_size`` values to consider (default every divisor of
        ``num_layers``; ignored with ``"auto"``, which keeps the base group size).
      optimizer: ``"adamw"``, ``"sgd"`` or ``"adafactor"``.
      margin: fraction of device memory kept free by the default budget, in [0, 1) (default
        :data:`DEFAULT_MARGIN`).
      max_compiles: cap on compiles after the first stage, which always compiles every named
        policy (default 2x the named policies; 6x with ``"auto"``). A stage stopped by the cap
        says so in ``notes``.
      workers: concurrent compiles (see :func:`remat_kit.memory.analyze_policies`).
      cache: a :class:`CompileCache` shared between calls.

    Returns:
      A :class:`Recommendation`: the pick (None when nothing fits, with ``advice``), every
      candidate compiled, and the compiles spent.

    Raises:
      ValueError: unknown model, target, policy or optimizer; ``seq_len`` or ``batch_size`` not
        positive, or ``seq_len`` above the model's ``max_seq_len``; a group size that does not
        divide ``num_layers``; ``solve`` with ``"auto"``; a target without peak FLOP/s, or
        without memory and no ``budget``; a budget smaller than the parameters and optimizer
        state (the message gives the smallest budget that could work, compiled).
    """
    t_start = time.perf_counter()
    from remat_kit.memory.api import argument_parts
    from remat_kit.models.config import get_config
    from remat_kit.train import abstract_batch, abstract_train_state, make_optimizer

    config = get_config(model) if isinstance(model, str) else model
    if not isinstance(config, ModelConfig):
        raise ValueError(f"model must be a preset name or a ModelConfig, got {model!r}")
    tgt = T.get_target(target)
    opt = make_optimizer(optimizer)  # raises on an unknown name
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if seq_len > config.max_seq_len:
        raise ValueError(
            f"seq_len={seq_len} exceeds max_seq_len={config.max_seq_len} of {config.name!r}"
        )
    auto = batch_size == "auto"
    if not auto and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0
    ):
        raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
    if auto and solve:
        raise ValueError("solve needs a fixed batch: give a batch size, not 'auto'")
    batch = 1 if auto else int(batch_size)
    if not tgt.peak_flops_bf16:
        gpus = [n for n in T.target_names() if T.get_target(n).deviceless]
        raise ValueError(
            f"target {tgt.name!r} has no peak FLOP/s, so step time cannot be estimated; pick "
            f"one of {', '.join(gpus)}"
        )
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if budget is None:
        if tgt.memory_bytes is None:
            raise ValueError(f"target {tgt.name!r} has unknown memory: give a budget")
        budget_bytes = int(tgt.memory_bytes * (1 - margin))
        budget_note = (
            f"{tgt.name} memory {_gib(tgt.memory_bytes)} less {margin:.0%} for the CUDA context, "
            "workspaces and fragmentation; run with "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={1 - margin:.2f}"
        )
    else:
        budget_bytes = parse_budget(budget)
        budget_note = "given"
        if tgt.memory_bytes is not None and budget_bytes > tgt.memory_bytes:
            budget_note += f", above the {_gib(tgt.memory_bytes)} of device memory of {tgt.name}"
    names = list(policies) if policies is not None else policy_names()
    if not names:
        raise ValueError("policies is empty: give at least one policy name")
    specs = {n: get_policy_spec(n) for n in names}  # raises on an unknown name
    notes: list[str] = []
    if not tgt.supports_host_offload:
        dropped = [n for n, s in specs.items() if s.offloads]
        specs = {n: s for n, s in specs.items() if not s.offloads}
        if dropped:
            notes.append(f"offloading policies skipped on {tgt.name}: {', '.join(dropped)}")
        if not specs:
            raise ValueError(f"every policy given offloads, and {tgt.name!r} does not offload")
    valid_groups = [d for d in range(1, config.num_layers + 1) if config.num_layers % d == 0]
    groups = list(group_sizes) if group_sizes is not None else valid_groups
    for g in groups:
        if g not in valid_groups:
            raise ValueError(
                f"group size {g!r} does not divide num_layers={config.num_layers} of "
                f"{config.name!r}; valid: {valid_groups}"
            )
    arguments = argument_parts(
        [abstract_train_state(config, opt), abstract_batch(batch, seq_len)], ["state", "batch"]
    )
    params, opt_state = arguments.get("params", 0), arguments.get("opt_state", 0)
    cap = max_compiles if max_compiles is not None else (6 if auto else 2) * len(specs)
    with _counting() as counter:
        session = _Session(
            config=config, seq_len=seq_len, target=tgt, optimizer=optimizer,
            budget=budget_bytes, cache=cache if cache is not None else CompileCache(),
            counter=counter, workers=workers, max_compiles=max(cap, len(specs)),
            fixed_bytes=params + opt_state, opt_state_bytes=opt_state, notes=notes,
        )  # fmt: skip
        if budget_bytes < params + opt_state:
            raise ValueError(_too_small(session, budget_bytes, batch, params, opt_state))
        g0 = config.remat_group_size
        named = session.candidates(list(specs.values()), g0, batch, "named")
        candidates = [c for _, c, _ in named]
        largest: list[Candidate] = []
        summary = None
        if auto:
            largest, probes = _largest_batch(session, _distinct(named))
            candidates += probes
            pick = max(largest, key=lambda c: (c.tokens_per_s, -c.peak_bytes), default=None)
        else:
            candidates += _group_search(session, named, groups, batch)
            if solve:
                summary = _solve(session, named, batch)
                if summary is not None:
                    candidates += summary.verified
            pick = min((c for c in candidates if c.fits), key=_rank, default=None)
        advice: list[str] = []
        if pick is None:
            advice, extra = _advice(session, named, batch)
            candidates += extra
        compiles = counter.count
    return Recommendation(
        model=config.name,
        target=tgt.name,
        seq_len=seq_len,
        batch_size=None if auto else batch,
        optimizer=optimizer,
        budget_bytes=budget_bytes,
        budget_note=budget_note,
        arguments=arguments,
        pick=pick,
        candidates=tuple(candidates),
        largest_batch=tuple(largest),
        compiles=compiles,
        reused=session.reused,
        wall_s=round(time.perf_counter() - t_start, 2),
        advice=tuple(advice),
        notes=(_time_model_note(tgt), *session.notes),
        solve=summary,
        peak_flops=tgt.peak_flops_bf16,
        host_link_bytes_per_s=tgt.host_link_bytes_per_s,
        host_link=host_link_source(tgt),
    )


def _distinct(
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


def _solve(
    session: _Session, named: Sequence[tuple[PolicySpec, Candidate, Any]], batch: int
) -> SolveSummary | None:
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


def _time_model_note(target: T.Target) -> str:
    return (
        f"step time = compiled matmul FLOPs / {target.peak_flops_bf16 / 1e12:.1f} TFLOP/s (bf16 "
        "dense peak) + host transfers that cannot hide behind the forward (device->host) or "
        "backward (host->device) pass: a lower bound for ranking, not a measured time"
    )


# -- Command line ---------------------------------------------------------------------------


def _batch_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--batch takes a positive integer or 'auto', got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"--batch takes a positive integer or 'auto', got {text!r}"
        )
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``recommend`` on an argparse ``subparsers``; sets ``func=run``."""
    from remat_kit.cli import parse_bytes, positive_int

    p = subparsers.add_parser(
        "recommend",
        help="the fastest remat configuration that fits a memory budget, verified by compiling",
        description="Compile the training step per named policy (and other remat group sizes, "
        "larger batches, per-tag choices with --solve) for a target, and pick the one with the "
        "least estimated step time (compiled FLOPs / peak FLOP/s + host transfers that cannot "
        "hide) whose compiled peak fits the budget.",
    )
    p.add_argument("--model", required=True, help="model preset, e.g. llama3-8b")
    p.add_argument("--seq", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--target", default="h100-sxm", help="GPU target (see `remat-kit targets`)")
    p.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="per-device bytes (76GiB, 80GB, 8e10); default: target memory less --margin",
    )
    p.add_argument(
        "--batch", type=_batch_arg, default=1, help="sequences per step, or 'auto' (default 1)"
    )
    p.add_argument("--solve", action="store_true", help="also search per-tag choices")
    p.add_argument("--policy", action="append", default=None, help="limit to these policies")
    p.add_argument(
        "--group-size", type=positive_int, action="append", default=None, dest="group_sizes",
        help="remat_group_size values to consider (default: every divisor of num_layers)",
    )  # fmt: skip
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="memory fraction kept free")
    p.add_argument("--max-compiles", type=positive_int, default=None, help="cap on compiles")
    p.add_argument("--workers", type=positive_int, default=None, help="concurrent compiles")
    p.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit recommend``: 0 a pick, 1 nothing fits (what would is printed).

    Raises:
      ValueError: bad input (one line; the CLI exits 2).
    """
    rec = recommend(
        args.model,
        args.seq,
        args.target,
        batch_size=args.batch,
        budget=args.budget,
        solve=args.solve,
        policies=args.policy,
        group_sizes=args.group_sizes,
        optimizer=args.optimizer,
        margin=args.margin,
        max_compiles=args.max_compiles,
        workers=args.workers,
    )
    if args.json:
        print(rec.to_json(indent=1))
    else:
        print_recommendation(rec)
    return 0 if rec.pick is not None else 1


def _units(candidates: Sequence[Candidate]) -> tuple[tuple[str, int], tuple[str, float]]:
    """(bytes unit, scale), (time unit, scale): GiB and ms at real sizes, MiB and us below."""
    big = max((c.peak_bytes for c in candidates), default=0) >= GIB
    slow = max((c.step_time_s for c in candidates if c.step_time_s < math.inf), default=0) >= 1e-3
    return (("GiB", GIB) if big else ("MiB", 2**20)), (("ms", 1e3) if slow else ("us", 1e6))


def _rows(rec: Recommendation, candidates: Sequence[Candidate]) -> tuple[list[str], list[list]]:
    (bu, bs), (tu, ts) = _units(candidates)
    header = [
        "candidate", "group", "batch", f"peak {bu}", f"host {bu}", "fits", f"step {tu}",
        f"transfer {tu}", "tokens/s", "found by",
    ]  # fmt: skip
    rows = []
    for c in candidates:
        where = c.found_by + (f" (seq {c.seq_len})" if c.seq_len != rec.seq_len else "")
        rows.append(
            [
                ("* " if c is rec.pick else "") + c.label,
                str(c.remat_group_size),
                str(c.batch_size),
                f"{c.peak_bytes / bs:.2f}",
                f"{c.host_bytes / bs:.2f}",
                "yes" if c.fits else "no",
                f"{c.step_time_s * ts:.1f}",
                f"{c.transfer_s * ts:.1f}",
                f"{c.tokens_per_s:,.0f}",
                where,
            ]
        )
    return header, rows


def print_recommendation(rec: Recommendation) -> None:
    """Print the candidates (fits first, then by estimated step time; ``*`` marks the pick),
    the budget and its source, the compiles spent, and the pick as one line of code, or what
    would fit."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    batch = "auto" if rec.batch_size is None else rec.batch_size
    title = f"{rec.model}  seq={rec.seq_len} batch={batch}  on {rec.target} ({rec.optimizer})"
    tables = [(title, sorted(rec.candidates, key=lambda c: (not c.fits, c.step_time_s)))]
    if rec.largest_batch:
        best = sorted(rec.largest_batch, key=lambda c: -c.tokens_per_s)
        tables.insert(0, ("largest batch that fits, per policy", best))
    for name, cands in tables:
        table = Table(title=name, title_justify="left")
        header, rows = _rows(rec, cands)
        for col in header:
            left = col in ("candidate", "found by")
            table.add_column(col, justify="left" if left else "right", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    lines = [
        f"budget {_gib(rec.budget_bytes)} per device ({rec.budget_note})",
        "arguments: " + ", ".join(f"{k} {_gib(v)}" for k, v in rec.arguments.items()),
        f"host link: {rec.host_link}",
    ]
    if rec.solve is not None:
        s = rec.solve
        lines.append(
            f"solve: {s.combinations} per-tag choices enumerated, {s.predicted_fit} predicted to "
            f"fit (slack {_gib(s.peak_slack_bytes)}), {len(s.verified)} compiled"
        )
    lines.append(f"compiles: {rec.compiles} (+{rec.reused} reused), {rec.wall_s:.1f} s")
    lines += [f"note: {n}" for n in rec.notes]
    if rec.pick is None:
        lines.append("nothing fits the budget; what would:")
        lines += [f"  - {a}" for a in rec.advice]
    else:
        p = rec.pick
        lines.append(
            f"pick: {p.label} (group {p.remat_group_size}, batch {p.batch_size}): peak "
            f"{_gib(p.peak_bytes)} of {_gib(rec.budget_bytes)}, est. {p.step_time_s * 1e3:.1f} "
            f"ms/step, {p.tokens_per_s:,.0f} tokens/s"
        )
    for line in lines:
        console.print(line, highlight=False, markup=False)
    if rec.pick is not None:
        print(rec.line())
