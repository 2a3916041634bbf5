"""The compile session of one :func:`~remat_kit.recommend.recommend` call: configurations
compiled through :func:`remat_kit.memory.analyze_policies`, memoised in a :class:`CompileCache`,
turned into :class:`~remat_kit.recommend.Candidate` rows, and XLA compiles counted."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import jax.monitoring

from remat_kit import targets as T
from remat_kit.memory import CompileError, analyze_policies
from remat_kit.memory.roofline import StepTime
from remat_kit.memory.runner import CompileEngine
from remat_kit.memory.xla_compile import out_of_memory
from remat_kit.models.config import PRESETS, ModelConfig
from remat_kit.policies import PolicySpec, get_policy_spec, policy_names
from remat_kit.program import Program
from remat_kit.recommend.types import Candidate, FoundBy, Structure

#: JAX's monitoring event for one XLA backend compile.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
#: JAX's name for the jitted train step (``step`` in :func:`remat_kit.training.make_train_step`).
STEP_FNS = ("jit(step)", "step")


def candidate_times(step: StepTime | None) -> tuple[float, float, float]:
    """``(compute_s, transfer_s, step_time_s)`` of a compiled candidate from its report's
    roofline (:class:`~remat_kit.memory.roofline.StepTime`): compute is everything but the
    exposed host transfers. ``inf`` where the report has no estimate (ranked last)."""
    if step is None:
        return float("inf"), 0.0, float("inf")
    return step.step_time_s - step.transfer_s, step.transfer_s, step.step_time_s


class CompileCounter:
    """Counts XLA compiles of the train step: ``jax.monitoring`` backend-compile events whose
    function is ``jit(step)`` (:func:`remat_kit.training.make_train_step`). Identical programs that
    the analyzer dedupes are compiled once, so they count once."""

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
    """A :class:`CompileCounter` (of compiles of ``fun_names``) listening to JAX's monitoring
    events inside the block."""
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
    """Compiled reports memoised by (program, target, variant, policy).

    Pass one to several :func:`recommend` calls (different budgets, say) to compile each
    configuration once; a report taken from it counts as ``reused``, not as a compile.
    """

    def __init__(self):
        self.reports: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.reports)


@dataclasses.dataclass
class Session:
    """What one :func:`recommend` call compiles against, and its compile accounting.

    ``program`` is the one compiled at the base configuration; the searches that vary it
    (batch, sequence, group size, structure: a preset's) compile its
    :meth:`~remat_kit.program.Program.variant`.
    """

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
    #: Custom specs among the policies compiled by default, each with the label every tool
    #: gives it (a registered policy cut down to the program's tags: ``minimal (cut)``).
    labels: Mapping[PolicySpec, str] = dataclasses.field(default_factory=dict)
    #: The specs registered policies were cut down to: found as the named policy.
    cut: frozenset[PolicySpec] = frozenset()
    #: The checkpoint names the program emits.
    tags: frozenset[str] = frozenset()
    #: Fraction of device memory the default budget keeps free.
    margin: float = 0.0
    #: The compile engine every round of the session compiles through (one GPU kernel cache
    #: filled once, compiles side by side); None: a private one per round.
    engine: CompileEngine | None = None

    @property
    def config(self) -> ModelConfig | None:
        """The model's config at the base group size (a preset's; None: a user's program)."""
        return self.program.model_config

    @property
    def seq_len(self) -> int | None:
        return self.program.seq_len

    @property
    def optimizer(self) -> str | None:
        return self.program.optimizer if isinstance(self.program.optimizer, str) else None

    @property
    def mesh(self) -> Any:
        return self.program.mesh

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
        self, group: int | None, batch: int | None, seq_len: int | None, structure: Structure
    ) -> dict[str, Any]:
        """The variant asked of the program: what differs from its own configuration."""
        program, config = self.program, self.config
        changes: dict[str, Any] = dict(structure)
        if group is not None and config is not None and group != config.remat_group_size:
            changes["remat_group_size"] = group
        if batch is not None and batch != program.batch_size:
            changes["batch_size"] = batch
        if seq_len is not None and seq_len != program.seq_len:
            changes["seq_len"] = seq_len
        return changes

    def evaluate(
        self,
        specs: Sequence[PolicySpec],
        group: int | None = None,
        batch: int | None = None,
        seq_len: int | None = None,
        structure: Structure = (),
    ) -> list[Any]:
        """Reports (or ``CompileError``) of ``specs`` on the program's variant at (group, batch,
        seq) with the structural overrides ``structure`` (None: the program's own), cached; the
        uncached ones compiled together by :func:`remat_kit.memory.analyze_policies`."""
        changes = self._changes(group, batch, seq_len, structure)
        base = self.program.request_key() or ("program", id(self.program))
        variant = tuple(sorted(changes.items()))
        keys = [(base, self.target, variant, spec_key(s)) for s in specs]
        todo = {k: s for k, s in zip(keys, specs, strict=True) if k not in self.cache.reports}
        self.reused += sum(1 for k in keys if k not in todo)
        if todo:
            program = self.program.variant(**changes) if changes else self.program
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
        structure: Structure = (),
    ) -> list[tuple[PolicySpec, Candidate, Any]]:
        """Compile (or reuse) and turn into candidates; compile failures become notes."""
        out = []
        reports = self.evaluate(specs, group, batch, seq_len, structure)
        for spec, report in zip(specs, reports, strict=True):
            c = self.candidate(report, spec, group, batch, found_by, seq_len, structure)
            if c is not None:
                out.append((spec, c, report))
        return out

    def candidate(
        self,
        report: Any,
        spec: PolicySpec,
        group: int | None,
        batch: int | None,
        found_by: FoundBy,
        seq: int | None = None,
        structure: Structure = (),
    ) -> Candidate | None:
        """:func:`to_candidate` at this session's target and budget, carrying the config's
        structural options (a preset's; a user's program has no group, batch or sequence)."""
        config = self.config
        if config is not None:
            group = group or config.remat_group_size
            batch, seq = batch or self.program.batch_size, seq or self.seq_len
        c = to_candidate(
            report,
            spec,
            self.target,
            self.budget,
            self.notes,
            found_by,
            group,
            batch,
            seq,
            options=", ".join(f"{k}={v}" for k, v in structure),
        )
        if c is None:
            return None
        if found_by == "named" and spec in self.labels:  # labelled as every tool labels it
            by = "named" if spec in self.cut else c.found_by
            c = dataclasses.replace(c, found_by=by, named_label=self.labels[spec])
        if config is None:
            return c
        config = config.replace(**dict(structure))
        return dataclasses.replace(
            c, model=preset_name(self.config), attention=config.attention,
            loss_chunk_size=config.loss_chunk_size, remat_layers=config.remat_layers,
            nested_groups=config.outer_groups,
        )  # fmt: skip


def preset_name(config: ModelConfig) -> str | None:
    """``config.name`` where ``config`` is that preset up to its remat fields (so
    ``get_config(name, ...)`` rebuilds it); None for a config of the user's own."""
    preset = PRESETS.get(config.name)
    if preset is None:
        return None
    remat = ("remat_policy", "remat_group_size", "scan_layers", "attention", "loss_chunk_size")
    same = config.replace(**{f: getattr(preset, f) for f in remat})
    return config.name if same == preset else None


def given_by(spec: PolicySpec) -> FoundBy:
    """What a policy given to recommend is: ``named`` (a registered policy as registered),
    ``per-tag`` (a per-tag spec: ``--policy q=save,k=offload`` or :func:`custom_spec`), or
    ``given`` (a user's own :class:`PolicySpec` under another name)."""
    if spec.name in policy_names() and get_policy_spec(spec.name) == spec:
        return "named"
    return "per-tag" if spec.name == "custom" else "given"


def to_candidate(
    report: Any,
    spec: PolicySpec,
    target: T.Target,
    budget: int,
    notes: list[str],
    found_by: FoundBy,
    group: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    options: str = "",
) -> Candidate | None:
    """A compiled report as a :class:`Candidate` timed by its roofline estimate
    (:func:`candidate_times`); None, with
    a note, for a :class:`CompileError`. ``group``, ``batch``, ``seq``: None for a user's
    program (it carries its own shapes; ``tokens_per_s`` is then None). ``found_by="named"``
    (the policies given) becomes :func:`given_by` of ``spec``. ``options``: the structural
    options compiled (``remat_layers=40``), named in the note of a failed compile."""
    actions = None
    if spec.name == "custom":
        actions = {t: "save" for t in spec.save} | {t: "offload" for t in spec.offload}
    if isinstance(report, CompileError):
        shape = [] if group is None else [f"group {group}", f"batch {batch}"]
        where = (
            f" ({', '.join([*shape, options] if options else shape)})" if shape or options else ""
        )
        # TPU: XLA refuses a step over HBM instead of compiling it: that is "does not fit".
        head = "does not fit, XLA refused it: " if out_of_memory(report) else ""
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
    )
