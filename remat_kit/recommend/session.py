"""The compile session of one :func:`~remat_kit.recommend.recommend` call and its answer.

Configurations compile through :func:`remat_kit.memory.analyze_policies`, memoised in a
:class:`CompileCache`, become :class:`Candidate` rows. Integers are bytes, times seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import jax.monitoring

from remat_kit import targets as T
from remat_kit.family import Structure
from remat_kit.memory import CompileError, analyze_policies
from remat_kit.memory.roofline import StepTime
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import PolicySpec, custom_spec, get_policy_spec, policy_label, policy_names
from remat_kit.program import Program
from remat_kit.units import format_bytes, format_seconds

#: Which stage of the search compiled a candidate.
FoundBy = Literal[
    "named",
    "per-tag",
    "given",
    "group-size",
    "batch-search",
    "solve",
    "advice",
    "structure",
    "partial-layers",
]
#: Structural changes (:class:`~remat_kit.family.Structure` fields) as sorted ``(field, value)``
#: pairs; ``()`` is the program as given.
Overrides = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Variant:
    """Where in the program's family a configuration was compiled (all None for a user's
    program)."""

    group: int | None = None
    batch: int | None = None
    seq_len: int | None = None
    structure: Overrides = ()

    @property
    def options(self) -> str:
        """The structural overrides as named in notes (``remat_layers=40``; empty: none)."""
        return ", ".join(f"{k}={v}" for k, v in self.structure)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled configuration and its estimated step time.

    Attributes:
      policy: a registered policy name, or ``"custom"`` (then ``actions`` says what it does).
      actions: for a custom policy, ``{tag: "save" | "offload"}`` (tags not listed recomputed).
      remat_group_size, batch_size, seq_len: the step's shape (None for a user's program).
      peak_bytes: XLA's device peak per device. host_bytes: bytes in host memory.
      flops: compiled matmul FLOPs. flops_no_remat: the same step without remat (jaxpr count).
      compute_s, transfer_s, step_time_s: the time model's seconds (:mod:`remat_kit.recommend`).
      tokens_per_s: ``batch_size * seq_len / step_time_s`` (None for a user's program).
      fits: ``peak_bytes <= budget``.
      found_by: the search stage that compiled it (:data:`FoundBy`).
      predicted_peak_bytes, predicted_step_time_s: the solver's prediction (``solve`` only).
      warnings: compiler messages (XLA's own rematerialisation, ...).
      attention, loss_chunk_size, remat_layers, nested_groups: the structural options
        (None: the plain step; :class:`~remat_kit.family.Structure`).
    """

    policy: str
    actions: dict[str, str] | None
    remat_group_size: int | None
    batch_size: int | None
    seq_len: int | None
    peak_bytes: int
    host_bytes: int
    flops: float | None
    flops_no_remat: float | None
    compute_s: float
    transfer_s: float
    step_time_s: float
    tokens_per_s: float | None
    fits: bool
    found_by: FoundBy
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    #: Estimated seconds of recomputing kernels (:class:`~remat_kit.memory.roofline.StepTime`).
    recompute_s: float | None = None
    warnings: tuple[str, ...] = ()
    model: str | None = None
    attention: str | None = None
    loss_chunk_size: int | None = None
    remat_layers: int | None = None
    nested_groups: int | None = None
    #: The label every tool gives this custom spec (``minimal (cut)``;
    #: :meth:`remat_kit.memory.policy_set.PolicySet.labels`), else None.
    named_label: str | None = None
    #: The compiled program's key (:attr:`remat_kit.memory.report.MemoryReport.program_sha256`):
    #: equal for two candidates that compiled to one program.
    program_sha256: str | None = None
    #: Built by the user's factory: the line to paste is the policy it receives.
    own_factory: bool = False

    @property
    def options(self) -> dict[str, Any]:
        """The structural options away from the plain step, as family changes."""
        out: dict[str, Any] = {}
        if self.attention not in (None, "xla"):
            out["attention"] = self.attention
        if self.loss_chunk_size is not None:
            out["loss_chunk_size"] = self.loss_chunk_size
        if self.nested_groups is not None:
            out["nested_remat"] = True
            out["nested_groups"] = self.nested_groups
        if self.remat_layers is not None:
            out["remat_layers"] = self.remat_layers
        return out

    @property
    def options_label(self) -> str:
        """``"cudnn, loss chunk 1024, nested 4 groups, remat 24 layers"``, or ``"-"``."""
        o = self.options
        parts = [o["attention"]] if "attention" in o else []
        if "loss_chunk_size" in o:
            parts.append(f"loss chunk {o['loss_chunk_size']}")
        if "nested_groups" in o:
            parts.append(f"nested {o['nested_groups']} groups")
        if "remat_layers" in o:
            parts.append(f"remat {o['remat_layers']} layers")
        return ", ".join(parts) or "-"

    @property
    def full_label(self) -> str:
        """:attr:`label` with its structural options (``offload-to-host [remat 1 layers]``)."""
        opts = self.options_label
        return self.label if opts == "-" else f"{self.label} [{opts}]"

    @property
    def label(self) -> str:
        """Policy name, or the label every tool gives (:func:`remat_kit.policies.policy_label`)."""
        if self.actions is None:
            return self.policy
        if self.named_label is not None:
            return self.named_label
        return policy_label(custom_spec(self.actions))

    def code(self, remats_for_none: int = 0) -> str:
        """The one line to paste, the batch and group size as a comment; for a user's program
        the policy its factory receives."""
        if self.actions is None:
            policy = f'remat_kit.policy("{self.policy}")'
        else:
            body = ", ".join(f'"{t}": "{a}"' for t, a in sorted(self.actions.items()))
            policy = f"remat_kit.custom_policy({{{body}}})"
        if self.batch_size is None or self.own_factory:
            return self._factory_code(policy, remats_for_none)
        shape = f"batch {self.batch_size}, seq {self.seq_len}"
        if self.options:
            return self._config_code(policy, shape)
        if self.policy == "no-remat":
            return f"Block  # no remat: do not wrap the block in nn.remat; {shape}"
        return (
            f"nn.remat(Block, policy={policy})  # {shape}, remat_group_size={self.remat_group_size}"
        )

    def _factory_code(self, policy: str, remats_for_none: int) -> str:
        """The policy a user's factory receives, and the shape its family built (if any)."""
        shape = "" if self.batch_size is None else f"; batch {self.batch_size}"
        shape += "" if self.seq_len is None else f", seq {self.seq_len}"
        if self.policy == "no-remat" and remats_for_none:
            return (
                f"policy = None  # your factory still builds {remats_for_none} remat "
                "segment(s) for None (jax.checkpoint's default policy: save nothing): this "
                f"is not a step without remat{shape}"
            )
        if self.policy == "no-remat":
            return (
                "policy = None  # no remat: your factory builds the step without "
                f"jax.checkpoint{shape}"
            )
        return (
            f"policy = {policy}  # give it to your factory (make_loss / make_step): "
            f"jax.checkpoint(..., policy=policy){shape}"
        )

    def _config_code(self, policy: str, shape: str) -> str:
        """The bundled model's config with the structural options (``get_config(...)``)."""
        value = f'"{self.policy}"' if self.actions is None else policy
        fields = [f"remat_policy={value}"]
        fields += [f"{k}={v!r}" if not isinstance(v, str) else f'{k}="{v}"'
                   for k, v in self.options.items()]  # fmt: skip
        if self.remat_group_size not in (None, 1):
            fields.append(f"remat_group_size={self.remat_group_size}")
        head = f'get_config("{self.model}", ' if self.model else "config.replace("
        return f"{head}{', '.join(fields)}, scan_layers=True)  # {shape}"


@dataclasses.dataclass(frozen=True)
class TagCost:
    """One checkpoint tag in the solver's additive model, summed over layers.

    Attributes:
      nbytes: device bytes of its residuals when kept (jaxpr residual table).
      base_bytes: bytes of it that ``save-nothing`` keeps anyway (the segment inputs).
      flops_saved: jaxpr matmul FLOPs not recomputed when it is kept.
    """

    tag: str
    nbytes: int
    base_bytes: int
    flops_saved: float


@dataclasses.dataclass(frozen=True)
class SolveSummary:
    """What :func:`solve_tags` enumerated, predicted and verified.

    Attributes:
      actions: the actions allowed per tag (offload only where it is real).
      combinations: per-tag choices enumerated (all: exact under the model).
      predicted_fit: how many were predicted to fit within ``peak_slack_bytes`` of the budget.
      peak_slack_bytes: the largest |compiled - predicted| peak over the compiled choices the
        model expresses (save-nothing aside); None when unmeasured.
      flops_scale: compiled / jaxpr FLOPs of ``save-nothing``, applied to predictions.
      verified: the custom candidates compiled, best predicted first.
      calibration: (policy, predicted peak, compiled peak) of the named policies it expresses.
    """

    tags: tuple[TagCost, ...]
    actions: tuple[str, ...]
    combinations: int
    predicted_fit: int
    peak_slack_bytes: int | None
    flops_scale: float
    verified: tuple[Candidate, ...]
    calibration: tuple[tuple[str, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The answer of :func:`recommend`. Integers are bytes, times seconds.

    Attributes:
      model, target, seq_len, batch_size, optimizer: what was asked (None: ``auto`` batch, or
        a user's program, which carries its own arguments).
      budget_bytes: the per-device budget; budget_note: where it comes from.
      arguments: bytes of the step's arguments (``params``, ``opt_state``, ``batch``).
      pick: the fastest candidate that fits (most tokens/s for ``auto``), or None.
      largest_batch: with ``auto``, the largest batch that fits per distinct policy.
      compiles: XLA compiles of the train step (JAX's backend-compile events). reused: taken
        from ``cache``. from_compile_cache: read from the persistent compile cache.
      advice: when nothing fits, what would. notes: the assumptions and limits of this answer.
      solve: the solver's summary, with ``solve=True``.
      peak_flops, host_link_bytes_per_s, host_link: the time model's figures and their source.
      tags: a user's program's ``checkpoint_name`` tags (None for a preset).
      remats_for_none: remat segments a user's factory builds for None (0: none).
      compiled_on: target, device and compiler (:func:`~remat_kit.recommend.api.compiled_on`).
      made_fit: the pick's structural options and what they did; None for a plain step.
    """

    model: str
    target: str
    seq_len: int | None
    batch_size: int | None
    optimizer: str | None
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
    tags: tuple[str, ...] | None = None
    made_fit: str | None = None
    remats_for_none: int = 0
    from_compile_cache: int = 0
    compiled_on: str = ""

    def line(self) -> str:
        """The pick as one line of code, commented with shape, target and budget, or what
        would fit when nothing does."""
        if self.pick is None:
            return "nothing fits: " + ("; ".join(self.advice) or "no candidate compiled")
        code = self.pick.code(self.remats_for_none)
        fit = (
            f"{self.target}: peak {format_bytes(self.pick.peak_bytes)} of the "
            f"{format_bytes(self.budget_bytes)} budget"
        )
        return f"{code}; {fit}" if "  # " in code else f"{code}  # {fit}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``line``)."""
        return {**dataclasses.asdict(self), "line": self.line()}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def rank(c: Candidate) -> tuple:
    """Least estimated time; on a tie, no host traffic, then least device memory."""
    return (c.step_time_s, c.host_bytes, c.peak_bytes)


#: Estimated step times closer than this fraction tie: the time model's errors against measured
#: steps reach 7-12% per policy (docs/time-model.md).
CLOSE_CALL = 0.05


def pointless_offloads(candidates: Sequence[Candidate], auto: bool = False) -> list[Candidate]:
    """Offloading candidates that an on-device one (:func:`on_device_peers`) makes pointless;
    never picked while that one fits."""

    return [c for c in candidates if c.host_bytes and on_device_peers(c, candidates, auto)]


def on_device_peers(c: Candidate, candidates: Sequence[Candidate], auto: bool) -> list[Candidate]:
    """Fitting candidates without host traffic, peak no higher than ``c``'s, speed within
    :data:`CLOSE_CALL`."""

    def slower(a: Candidate, b: Candidate) -> float:  # how much slower a is than b
        if auto:
            return b.tokens_per_s / a.tokens_per_s - 1 if a.tokens_per_s else math.inf
        return a.step_time_s / b.step_time_s - 1 if b.step_time_s > 0 else math.inf

    return [
        d for d in candidates
        if d.fits and not d.host_bytes and d.peak_bytes <= c.peak_bytes
        and slower(d, c) < CLOSE_CALL
    ]  # fmt: skip


def offload_passed_over(
    pick: Candidate | None, rivals: Sequence[Candidate], auto: bool
) -> str | None:
    """Why a faster :func:`pointless_offloads` estimate was not picked; None when none was."""
    if pick is None or pick.host_bytes:
        return None

    def ahead(c: Candidate) -> bool:
        if auto:
            return (c.tokens_per_s or 0.0) > (pick.tokens_per_s or 0.0)
        return c.step_time_s < pick.step_time_s

    pool = [pick, *rivals]
    passed = [c for c in pointless_offloads(pool, auto) if c.fits and ahead(c)]
    if not passed:
        return None
    parts, said = [], set()
    for c in passed:
        if c.label in said:
            continue
        said.add(c.label)
        peers = on_device_peers(c, pool, auto)  # said: the pick where it is one, else the least
        peer = pick if any(d is pick for d in peers) else min(peers, key=lambda d: d.peak_bytes)
        who = "the pick" if peer is pick else peer.label
        parts.append(
            f"{c.label} (device peak {format_bytes(c.peak_bytes)}): {who} keeps its tensors on "
            f"device at a peak no higher ({format_bytes(peer.peak_bytes)})"
        )
    return (
        f"not picked though estimated faster: {'; '.join(parts)}, without host transfers and "
        f"within {CLOSE_CALL:.0%} of the offload's estimate (a close call: nearer than the "
        "estimates tell apart)"
    )


def fastest_fitting(candidates: Sequence[Candidate], margin: float = 0.0) -> Candidate | None:
    """The fitting candidate first by :func:`rank`, bar :func:`pointless_offloads`; None if none
    fits. Among those within ``margin`` (:func:`remat_kit.memory.roofline.estimate_error`) of
    the fastest, the one that recomputes least (:func:`recomputes_less`; the fastest of those
    that tie): recomputation is certain work, the estimated lead is not."""
    skip = pointless_offloads(candidates)
    usable = [c for c in candidates if c.fits and not any(c is s for s in skip)]
    best = min(usable, key=rank, default=None)
    if best is None or margin <= 0:
        return best
    near = [c for c in usable if c.step_time_s <= best.step_time_s * (1 + margin)]
    least = [c for c in near if not any(recomputes_less(d, c) for d in near)]
    return min(least, key=rank)


#: Compiled matmul FLOPs (or recomputing kernels' seconds) closer than this fraction tie when
#: the pick goes to the candidate that recomputes less: nearer is bookkeeping, not work.
RECOMPUTE_TIE = 0.01


def recompute_key(c: Candidate) -> tuple[float, float]:
    """Compiled matmul FLOPs, then recomputing kernels' seconds; unknown last."""
    flops = c.flops if c.flops is not None else math.inf
    return flops, c.recompute_s if c.recompute_s is not None else math.inf


def recomputes_less(a: Candidate, b: Candidate) -> bool:
    """Whether ``a`` recomputes less than ``b``: fewer compiled matmul FLOPs by more than
    :data:`RECOMPUTE_TIE`, or as many (within it) and fewer recomputing kernels' seconds by
    more than it (:func:`recompute_key`; unknown is most)."""

    def tied(x: float, y: float) -> bool:
        return x == y or abs(x - y) <= RECOMPUTE_TIE * max(x, y)

    (fa, sa), (fb, sb) = recompute_key(a), recompute_key(b)
    if not tied(fa, fb):
        return fa < fb
    return not tied(sa, sb) and sa < sb


def _recomputed_less(pick: Candidate, best: Candidate) -> str:
    """`` (recomputes N% fewer)``: the recomputed matmul FLOPs (``flops - flops_no_remat``) of
    ``pick`` against ``best``'s; empty where either is unknown or ``best`` recomputes none."""
    if None in (pick.flops, pick.flops_no_remat, best.flops, best.flops_no_remat):
        return ""
    rp, rb = pick.flops - pick.flops_no_remat, best.flops - best.flops_no_remat
    return f" (recomputes {1 - max(rp, 0.0) / rb:.0%} fewer)" if rb > 0 else ""


def less_recompute_note(
    pick: Candidate | None, candidates: Sequence[Candidate], margin: float
) -> str | None:
    """The note for a pick preferred to a faster estimate for recomputing less; or None."""
    if pick is None or margin <= 0:
        return None
    skip = pointless_offloads(candidates)
    usable = [c for c in candidates if c.fits and not any(c is s for s in skip)]
    best = min(usable, key=rank, default=None)
    if best is None or best is pick or best.step_time_s >= pick.step_time_s:
        return None
    (fp, sp), (fb, sb) = recompute_key(pick), recompute_key(best)
    less = (
        f"runs {1 - fp / fb:.0%} fewer matmul FLOPs{_recomputed_less(pick, best)}"
        if math.isfinite(fb) and fp < fb * (1 - RECOMPUTE_TIE)
        else f"recomputes as many matmul FLOPs, {format_seconds(sb - sp)} less other recomputation"
        if math.isfinite(sb)
        else "recomputes less"
    )
    return (
        f"picked {pick.full_label} (est. {format_seconds(pick.step_time_s)}) over "
        f"{best.full_label} (est. {format_seconds(best.step_time_s)}, "
        f"{1 - best.step_time_s / pick.step_time_s:.0%} faster): the pick {less}, and "
        f"the estimates differ by less than the time model's error on this target "
        f"({margin:.0%}, docs/results/published.md); measure both to choose on speed"
    )


def passed_over_note(
    pick: Candidate | None, candidates: Sequence[Candidate], margin: float
) -> str | None:
    """The note for a candidate recomputing less than the pick but estimated slower by more
    than ``margin``; or None."""
    if pick is None or margin <= 0:
        return None
    skip = pointless_offloads(candidates)
    usable = [c for c in candidates if c.fits and not any(c is s for s in skip)]
    less = [c for c in usable if recomputes_less(c, pick)]
    if not less:
        return None
    best = min(usable, key=rank)
    other = min(less, key=recompute_key)
    return (
        f"not picked though it recomputes less: {other.full_label} (est. "
        f"{format_seconds(other.step_time_s)}, {other.step_time_s / best.step_time_s - 1:.0%} "
        f"above the fastest, beyond the time model's {margin:.0%} error): the estimate charges a "
        "scanned step that keeps its residuals the copies that stack them per layer and read "
        "them back, which recomputation avoids; no GPU measurement of remat-kit's confirms "
        "it yet (docs/time-model.md): time both if it fits"
    )


def close_call(pick: Candidate | None, rivals: Sequence[Candidate], auto: bool) -> str | None:
    """The note for a pick whose estimated lead over the next distinct program is under
    :data:`CLOSE_CALL` (tokens/s with ``auto``, else step time); or None."""
    if pick is None:
        return None

    def lead(c: Candidate) -> float:
        if auto:
            return (pick.tokens_per_s or 0.0) / c.tokens_per_s - 1 if c.tokens_per_s else math.inf
        return c.step_time_s / pick.step_time_s - 1 if pick.step_time_s > 0 else math.inf

    skip = pointless_offloads(rivals, auto)
    others = [
        c for c in rivals
        if c.fits and c is not pick and not any(c is s for s in skip)
        and (c.label, c.peak_bytes) != (pick.label, pick.peak_bytes)
        and (c.program_sha256 is None or c.program_sha256 != pick.program_sha256)
    ]  # fmt: skip
    near = min(others, key=lead, default=None)
    if near is None or not 0 <= lead(near) < CLOSE_CALL:
        return None
    what = "tokens per second" if auto else "step time"
    return (
        f"close call: the pick {pick.label} leads {near.label} by {lead(near):.1%} in estimated "
        f"{what}, under {CLOSE_CALL:.0%}: nearer than the estimates tell apart "
        "(docs/time-model.md); measure both before choosing on speed (the sweep times them: "
        "experiments/sweep.py)"
    )


#: JAX's monitoring event for one XLA backend compile.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
#: JAX's name for the jitted train step (``step`` in :func:`remat_kit.training.make_train_step`).
STEP_FNS = ("jit(step)", "step")


def candidate_times(step: StepTime | None) -> tuple[float, float, float]:
    """``(compute_s, transfer_s, step_time_s)`` from the report's roofline; ``inf`` when none."""
    if step is None:
        return float("inf"), 0.0, float("inf")
    return step.step_time_s - step.transfer_s, step.transfer_s, step.step_time_s


class CompileCounter:
    """Counts ``jax.monitoring`` backend-compile events of the train step (identical programs
    compile once)."""

    def __init__(self, fun_names: Sequence[str] = STEP_FNS):
        self.count = 0
        self.fun_names = tuple(fun_names)
        self._lock = threading.Lock()

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT and kwargs.get("fun_name") in self.fun_names:
            with self._lock:
                self.count += 1


@contextmanager
def counting(fun_names: Sequence[str] = STEP_FNS) -> Iterator[CompileCounter]:
    """A :class:`CompileCounter` of ``fun_names`` compiles inside the block."""
    counter = CompileCounter(fun_names)
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)


def spec_key(spec: PolicySpec) -> tuple:
    """What makes two specs compile the same program (the name does not)."""
    return (spec.base, tuple(sorted(spec.save)), tuple(sorted(spec.offload)), spec.wrap)


class CompileCache:
    """Compiled reports memoised by (program, target, variant, policy); share one between
    :func:`recommend` calls (hits count as ``reused``)."""

    def __init__(self):
        self.reports: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.reports)


@dataclasses.dataclass
class Session:
    """What one :func:`recommend` call compiles against, and its compile accounting (searches
    compile members of the program's :class:`~remat_kit.family.Family`)."""

    program: Program
    target: T.Target
    budget: int
    cache: CompileCache
    counter: CompileCounter
    workers: int | None
    max_compiles: int
    fixed_bytes: int  # arguments that do not depend on the batch (params + opt_state)
    opt_state_bytes: int
    reused: int = 0
    from_compile_cache: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    #: Custom specs compiled by default, with their label (``minimal (cut)``).
    labels: Mapping[PolicySpec, str] = dataclasses.field(default_factory=dict)
    #: The specs registered policies were cut down to.
    cut: frozenset[PolicySpec] = frozenset()
    #: The checkpoint names the program emits.
    tags: frozenset[str] = frozenset()
    #: Fraction of device memory the default budget keeps free.
    margin: float = 0.0
    #: The engine every round compiles through; None: a private one per round.
    engine: CompileEngine | None = None

    @property
    def structure(self) -> Structure | None:
        """The program's layer structure where its family says (None: it cannot vary)."""
        family = self.program.family
        return family.structure if family is not None else None

    @property
    def seq_len(self) -> int | None:
        return self.program.known.seq_len

    @property
    def optimizer(self) -> str | None:
        return self.program.known.optimizer

    @property
    def mesh(self) -> Any:
        return self.program.known.mesh

    @property
    def compiles(self) -> int:
        return self.counter.count

    def room(self) -> int:
        """Compiles left under ``max_compiles``."""
        return max(0, self.max_compiles - self.compiles)

    def arguments(self, batch: int, seq_len: int | None = None) -> int:
        """Argument bytes of the step at ``batch`` (inputs and targets are int32), per device."""
        split = self.mesh.dp * self.mesh.fsdp if self.mesh is not None else 1
        return self.fixed_bytes + 2 * batch * (seq_len or self.seq_len) * 4 // split

    def _changes(
        self, group: int | None, batch: int | None, seq_len: int | None, structure: Overrides
    ) -> dict[str, Any]:
        """The family member asked for: what differs from the program's own configuration."""
        known, layers = self.program.known, self.structure
        changes: dict[str, Any] = dict(structure)
        if group is not None and layers is not None and group != layers.remat_group_size:
            changes["remat_group_size"] = group
        if batch is not None and batch != known.batch_size:
            changes["batch_size"] = batch
        if seq_len is not None and seq_len != known.seq_len:
            changes["seq_len"] = seq_len
        return changes

    def evaluate(
        self,
        specs: Sequence[PolicySpec],
        group: int | None = None,
        batch: int | None = None,
        seq_len: int | None = None,
        structure: Overrides = (),
    ) -> list[Any]:
        """Reports (or ``CompileError``) of ``specs`` on a variant, cached; the rest compiled
        by :func:`remat_kit.memory.analyze_policies`."""
        changes = self._changes(group, batch, seq_len, structure)
        base = self.program.known.cache_key or ("program", id(self.program))
        variant = tuple(sorted(changes.items()))
        keys = [(base, self.target, variant, spec_key(s)) for s in specs]
        todo = {k: s for k, s in zip(keys, specs, strict=True) if k not in self.cache.reports}
        self.reused += sum(1 for k in keys if k not in todo)
        if todo:
            try:
                program = self.program.family.build(**changes) if changes else self.program
            except ValueError as err:  # a change the model refuses: a note, the search goes on
                what = ", ".join(f"{k}={v!r}" for k, v in sorted(changes.items()))
                refused = CompileError(
                    f"{self.program.name!r} with {what}", str(err), None, "build"
                )
                self.cache.reports.update(dict.fromkeys(todo, refused))
                return [self.cache.reports[k] for k in keys]
            results = analyze_policies(
                program, list(todo.values()), target=self.target, budget_bytes=self.budget,
                top_k=0, workers=self.workers, raise_errors=False, compare_offload=False,
                engine=self.engine, no_remat_baseline=False,
            )  # fmt: skip
            self.cache.reports.update(zip(todo, results, strict=True))
            self.from_compile_cache += sum(getattr(r, "compile_cached", False) for r in results)
        return [self.cache.reports[k] for k in keys]

    def candidates(
        self,
        specs: Sequence[PolicySpec],
        group: int | None,
        batch: int | None,
        found_by: FoundBy,
        seq_len: int | None = None,
        structure: Overrides = (),
    ) -> list[tuple[PolicySpec, Candidate, Any]]:
        """Compile (or reuse) and turn into candidates; compile failures become notes."""
        out = []
        reports = self.evaluate(specs, group, batch, seq_len, structure)
        variant = Variant(group, batch, seq_len, structure)
        for spec, report in zip(specs, reports, strict=True):
            c = self.candidate(report, spec, found_by, variant)
            if c is not None:
                out.append((spec, c, report))
        return out

    def candidate(
        self, report: Any, spec: PolicySpec, found_by: FoundBy, variant: Variant
    ) -> Candidate | None:
        """:func:`to_candidate` at this session's budget with the variant's options."""
        layers, structure = self.structure, variant.structure
        if layers is not None:
            variant = Variant(
                variant.group or layers.remat_group_size,
                variant.batch or self.program.known.batch_size,
                variant.seq_len or self.seq_len,
                structure,
            )
        c = to_candidate(report, spec, self.budget, self.notes, found_by, variant)
        if c is None:
            return None
        if found_by == "named" and spec in self.labels:  # labelled as every tool labels it
            by = "named" if spec in self.cut else c.found_by
            c = dataclasses.replace(c, found_by=by, named_label=self.labels[spec])
        if layers is None:
            return c
        if not self.program.known.takes_spec:
            c = dataclasses.replace(c, own_factory=True)
        now = layers.changed(structure)
        return dataclasses.replace(
            c, model=layers.name, attention=now.attention, loss_chunk_size=now.loss_chunk_size,
            remat_layers=now.remat_layers, nested_groups=now.nested_groups,
        )  # fmt: skip


def given_by(spec: PolicySpec) -> FoundBy:
    """``named``, ``per-tag`` (:func:`custom_spec`) or ``given`` (a user's own spec)."""
    if spec.name in policy_names() and get_policy_spec(spec.name) == spec:
        return "named"
    return "per-tag" if spec.name == "custom" else "given"


def to_candidate(
    report: Any,
    spec: PolicySpec,
    budget: int,
    notes: list[str],
    found_by: FoundBy,
    variant: Variant | None = None,
) -> Candidate | None:
    """A compiled report as a :class:`Candidate` timed by :func:`candidate_times`; None, with a
    note in ``notes``, for a :class:`CompileError`."""
    variant = variant or Variant()
    group, batch, seq, options = variant.group, variant.batch, variant.seq_len, variant.options
    actions = None
    if spec.name == "custom":
        actions = {t: "save" for t in spec.save} | {t: "offload" for t in spec.offload}
    if isinstance(report, CompileError):
        shape = [] if group is None else [f"group {group}", f"batch {batch}"]
        where = (
            f" ({', '.join([*shape, options] if options else shape)})" if shape or options else ""
        )
        # TPU: XLA refuses a step over HBM instead of compiling it: that is "does not fit".
        head = "does not fit, XLA refused it: " if report.out_of_memory else ""
        notes.append(f"{spec.name}{where}: {head}{report}")
        return None
    flops = report.flops
    if report.step_time is None:
        notes.append(f"{spec.name}: no step-time estimate (no XLA dump); ranked last")
    compute, transfer, total = candidate_times(report.step_time)
    tokens = None
    if batch is not None and seq is not None:
        tokens = batch * seq / total if 0 < total < math.inf else 0.0
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
        tokens_per_s=tokens,
        fits=report.peak_bytes <= budget,
        found_by=given_by(spec) if found_by == "named" else found_by,
        warnings=tuple(report.warnings),
        program_sha256=getattr(report, "program_sha256", None),
        recompute_s=report.step_time.recompute_s if report.step_time else None,
    )
