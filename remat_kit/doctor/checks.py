"""The doctor's entry points: :func:`check_policies` (a program's policies), :func:`check` (one
policy, a preset or a program) and :func:`check_function` (a user's loss function, a raw
``jax.checkpoint`` policy allowed).

Each policy's promise is compared against the traced loss and compiled step. Without a policy
list the default set of ``analyze`` is checked (:func:`remat_kit.memory.policy_set.policy_set`;
docs/doctor.md); a policy named explicitly is checked as given.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from remat_kit import targets as T
from remat_kit import trace
from remat_kit import walker as W
from remat_kit.doctor.compare import (
    PolicyEvidence,
    Residuals,
    check_remat_static_argnums,
    compare,
)
from remat_kit.doctor.findings import Finding, dedupe, has_errors, sort_findings
from remat_kit.doctor.promise import (
    Promise,
    describe_callable,
    effect_findings,
    excluded_unknown,
    promise_of_exclusions,
    remat3_findings,
    remat3_rule,
    resolve_policy,
)
from remat_kit.doctor.tags import (
    TagFacts,
    feeds,
    matmul_tags,
    no_remat_remats,
    no_remat_segment,
    policy_not_passed,
    recompute_savers,
    tag_facts,
    unknown_tags,
)
from remat_kit.memory import MemoryReport, analyze, hlo
from remat_kit.memory.api import analyze_policies
from remat_kit.memory.policy_set import policy_set
from remat_kit.policies import (
    PolicySpec,
    custom_spec,
    get_policy_spec,
    is_by_exclusion,
    policy_label,
    policy_names,
)
from remat_kit.program import Program, step_flops
from remat_kit.pure import filtered_factory
from remat_kit.reach import PolicyReach, factory_reach
from remat_kit.trace import program_tags
from remat_kit.walker import (
    dots_in_remat,
    has_remat,
    saved_residuals,
    tags_in,
    tags_in_remat,
    traced_flops,
)
from remat_kit.zoo import PresetLike, as_program


def recomputed_ops(fn: Callable[..., Any], args: Sequence[Any], target: T.Target) -> int:
    """Operations of ``fn``'s compiled program that recompute the forward pass
    (:func:`remat_kit.memory.hlo.count_recomputed_ops`); 0 when CSE merged them away."""
    sharding = T.abstract_sharding(target)
    abstract = [T.abstractify(a, sharding) for a in args]
    text = jax.jit(fn).lower(*abstract).compile().as_text()
    return hlo.count_recomputed_ops(hlo.parse_hlo_module(text))


@dataclasses.dataclass(frozen=True)
class PolicyCheck:
    """One policy checked: ``label`` as printed, the spec compiled, its findings (errors first)."""

    label: str
    spec: PolicySpec
    findings: tuple[Finding, ...]


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """The doctor's answer for a program: emitted names, a :class:`PolicyCheck` per policy,
    notes."""

    program: str
    tags: frozenset[str]
    checks: tuple[PolicyCheck, ...]
    notes: tuple[str, ...]

    @property
    def has_errors(self) -> bool:
        """True when a finding is an error (``remat-kit doctor`` exits 1)."""
        return any(has_errors(c.findings) for c in self.checks)

    def __len__(self) -> int:
        return len(self.checks)

    def summary(self) -> str:
        """The answer as text: the program and its tags, each policy's findings
        (:meth:`Finding.line`) under its label, then the notes."""
        tags = ", ".join(sorted(self.tags)) or "none"
        lines = [f"doctor on {self.program!r}: {len(self.checks)} policies; tags: {tags}"]
        for check in self.checks:
            lines.append(f"{check.label}:")
            lines += [f"  {f.line()}" for f in check.findings] or ["  no findings"]
        return "\n".join([*lines, *(f"note: {n}" for n in self.notes)])

    def __iter__(self) -> Iterator[list[Finding]]:
        """Each policy's findings, in order (errors first)."""
        return (list(c.findings) for c in self.checks)

    def __getitem__(self, i: int) -> list[Finding]:
        return list(self.checks[i].findings)


def _kept(program: Program, spec: PolicySpec) -> Residuals:
    return Residuals.of(trace.saved(program, spec))


def _facts(program: Program, tags: frozenset[str]) -> TagFacts:
    """The program's :class:`TagFacts` (its loss traced under ``save-nothing``)."""
    loss = program.loss(get_policy_spec("save-nothing"))
    jaxpr = jax.make_jaxpr(loss.fn)(*loss.args).jaxpr
    inside, matmuls = tags_in_remat(jaxpr), matmul_tags(jaxpr)
    in_rule = tags - tags_in(jaxpr)  # a custom_vjp forward rule's: kept where JAX sees them

    def saving(tag: str):
        return trace.saved(program, custom_spec({tag: "save"}))

    @functools.cache
    def keeping(names: frozenset[str]) -> float:
        return step_flops(program, custom_spec(dict.fromkeys(sorted(names), "save")))

    def flops(tag: str | None) -> float:
        return keeping(frozenset([tag] if tag else []))

    savers = functools.cache(lambda: recompute_savers(saving, inside | in_rule, matmuls, flops))
    user = program.known.scan_layers is None
    return TagFacts(
        tags, inside, user=user, savers=savers, feeds=feeds(jaxpr), flops_keeping=keeping,
        remat_dots=dots_in_remat(jaxpr), in_fwd_rule=in_rule,
    )  # fmt: skip


def check_policies(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    target: str | T.Target = "local",
) -> ProgramCheck:
    """Check policies on a program that has a loss (``from_loss``, ``make_loss=``, a preset).

    Compiles the step under each policy and ``no-remat`` for ``target`` (as ``analyze``) and
    reads what the loss keeps under each.

    Args:
      policies: checked as given; None: the default set (module docstring).

    Returns:
      A :class:`ProgramCheck`.

    Raises:
      ValueError: unknown policy or target; a program without a loss.
      CompileError: XLA could not compile a step (the message names the policy).
    """
    if program.make_loss is None:
        raise ValueError(
            f"program {program.name!r} has no loss: the doctor compares what the loss keeps; "
            "build it with Program.from_loss, or pass make_loss= and loss_args= to from_step"
        )
    tgt = T.get_target(target)
    # traced once per program (memoised beside it; analyze's trace_program reads them) and
    # before any placement on the target: a factory that drops the policy is told without it
    tags, reach = program_tags(program), program.reach()
    wraps = policies is None or any(resolve_policy(p, tags).wrap for p in policies)
    if not reach.passes and wraps:  # every policy compiles to one program: one error says it
        return _policy_never_passed(program, policies, tags, reach)
    specs, labels, notes = _policies_to_check(program, policies, tgt, tags)
    if not specs:
        return ProgramCheck(program.name, tags, (), tuple(notes))
    facts = _facts(program, tags)
    baseline, note = _baseline(reach)
    if note:
        notes.append(note)
    reports = analyze_policies(program, [*specs, baseline], tgt, strict_tags=False)
    judging = _Judging(
        program, tgt, tags, reach, facts, reports[-1], _kept(program, baseline),
        _kept(program, get_policy_spec("save-nothing")), frozenset(policy_names()),
    )  # fmt: skip
    checks, each = [], iter(reports)
    given = list(policies) if policies is not None else [None] * len(specs)
    for spec, label, raw in zip(specs, labels, given, strict=True):
        checks.append(_policy_check(judging, spec, label, raw, next(each)))
    return ProgramCheck(program.name, tags, tuple(checks), tuple(notes))


def _policy_never_passed(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None,
    tags: frozenset[str],
    reach: PolicyReach,
) -> ProgramCheck:
    """The one error when the factory passes no policy to its remat segments."""
    factory = f"the {reach.part} of {program.name!r}"
    finding = (
        policy_not_passed(None, factory, reach.segments)
        if reach.segments
        else no_remat_segment(None, factory)
    )
    first = resolve_policy(policies[0], tags) if policies else get_policy_spec("save-nothing")
    notes = [f"no-remat: {reach.no_remat_note()}"] if reach.no_remat_note() else []
    return ProgramCheck(
        program.name, tags, (PolicyCheck("every policy", first, (finding,)),), tuple(notes)
    )


def _policies_to_check(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None,
    tgt: T.Target,
    tags: frozenset[str],
) -> tuple[list[PolicySpec], list[str], list[str]]:
    """``(specs, labels, notes)``: the policies given, or the default set (:func:`policy_set`)."""
    if policies is None:
        chosen = policy_set(program, tgt, tags=tags)
        specs, labels, notes = list(chosen.specs), chosen.labels(), list(chosen.notes)
        if not specs:
            notes.append(f"no policy acts on program {program.name!r}: nothing to check")
    else:
        specs = [resolve_policy(p, tags) for p in policies]
        labels, notes = [policy_label(s) for s in specs], []
    return specs, labels, notes


def _baseline(reach: PolicyReach) -> tuple[PolicySpec, str | None]:
    """``(spec, note)`` of the baseline: ``no-remat``, or ``save-everything`` where the factory
    remats even without a policy."""
    if not reach.no_remat_note():
        return get_policy_spec("no-remat"), None
    # the factory remats for None: saving everything keeps what a step without remat keeps
    baseline = PolicySpec(
        "save-everything",
        "Every residual of the remat segments kept on device, none recomputed; the model "
        "is wrapped in remat.",
        base="everything",
        source="jax.checkpoint_policies.everything_saveable",
    )
    return baseline, (
        f"no-remat: {reach.no_remat_note()}; each policy is judged against save-everything "
        "(jax.checkpoint_policies.everything_saveable), which keeps what no remat keeps"
    )


@dataclasses.dataclass(frozen=True)
class _Judging:
    """What :func:`check_policies` judges every policy of a program against."""

    program: Program
    target: T.Target
    tags: frozenset[str]
    reach: PolicyReach
    facts: TagFacts
    baseline: MemoryReport
    kept_baseline: Residuals
    kept_nothing: Residuals
    registered: frozenset[str]


def _policy_check(
    judging: _Judging,
    spec: PolicySpec,
    label: str,
    raw: str | PolicySpec | Mapping[str, str] | None,
    report: MemoryReport,
) -> PolicyCheck:
    """One policy's promise (``raw`` as given; None: default set) against its compiled
    ``report``."""
    j, program, reach = judging, judging.program, judging.reach
    promise = Promise.of(spec, registered=spec.name in j.registered)
    # save_any_names_but_these: judged as the name set it amounts to, as check_function does
    promise = dataclasses.replace(promise, name=label, by_exclusion=is_by_exclusion(raw))
    findings = unknown_tags(promise, j.facts) + excluded_unknown(raw, j.tags)
    findings += effect_findings(label, spec, promise)
    if not spec.wrap and reach.without_policy:  # analyze's "not a no-remat baseline"
        # a from_loss step is remat-kit's around the user's make_loss: name theirs
        factory = "make_loss" if program.step_of_loss is not None else reach.part
        findings.append(no_remat_remats(label, factory, reach.without_policy))
    evidence = PolicyEvidence(
        report, j.baseline, _kept(program, spec), j.kept_baseline, kept_nothing=j.kept_nothing
    )
    findings += compare(
        promise, evidence, j.target, scan_layers=program.known.scan_layers, facts=j.facts,
        reach=reach,
    )  # fmt: skip
    if raw is None:  # the default set: a policy the user did not ask for is no defect of theirs
        findings = [_of_the_default_set(f) for f in findings]
    return PolicyCheck(label, spec, tuple(sort_findings(dedupe(findings))))


def _of_the_default_set(finding: Finding) -> Finding:
    """A default-set ``no-op-policy`` error as a warning: the user did not ask for it."""
    if finding.code != "no-op-policy" or finding.severity != "error":
        return finding
    return dataclasses.replace(
        finding, severity="warning", fix=f"{finding.fix} (a policy of the doctor's default set, "
        "not one you asked for: pick another, nothing in your code to fix)",
    )  # fmt: skip


#: (batch, seq) a preset is checked at by default: findings do not depend on the shape.
DEFAULT_SHAPE = (2, 64)


def check(
    model: Program | PresetLike,
    batch_size: int | None = None,
    seq_len: int | None = None,
    policy: str | PolicySpec | Mapping[str, str] | None = None,
    target: str | T.Target = "local",
    optimizer: str | optax.GradientTransformation | None = None,
) -> list[Finding]:
    """:func:`check_policies` of one policy: its findings.

    Args:
      model: a preset name or config (:data:`remat_kit.zoo.PresetLike`), or a
        :class:`~remat_kit.program.Program`.
      batch_size: a preset's sequences per step (default 2); not for a Program.
      seq_len: a preset's tokens per sequence (default 64); not for a Program.
      policy: name, spec or mapping; default a preset's ``remat_policy`` (a Program needs one).
      optimizer: a preset's optimizer (default ``adamw``).

    Returns:
      The findings, errors first; empty when the policy does what it promises.

    Raises:
      ValueError: unknown preset, policy or target; bad shapes; shapes given with a Program; no
        policy for a Program; the policy name ``"none"``.
    """
    program = as_program(model, batch_size, seq_len, optimizer, default_shape=DEFAULT_SHAPE)
    chosen = policy if policy is not None else program.known.default_policy
    if chosen is None:
        raise ValueError(
            f"check(program): give policy= to check on {program.name!r}, or use "
            "remat_kit.doctor.check_policies(program, target=...) for the policies that act on it"
        )
    return check_policies(program, [chosen], target)[0]


def check_function(
    make_loss: Callable[[Callable[..., Any] | None], Callable[..., Any]],
    *args: Any,
    policy: str | PolicySpec | Mapping[str, str] | Callable[..., Any] | None,
    target: str | T.Target = "local",
    remat_static_argnums: Sequence[int] | None = None,
    remat_call_args: Sequence[Any] = (),
    argnums: int | Sequence[int] | None = None,
) -> list[Finding]:
    """Check a policy on a user's own function.

    Args:
      make_loss: ``make_loss(jax_policy) -> loss(*args) -> scalar``.
      *args: the loss's arguments, as :class:`~remat_kit.Program` takes them.
      policy: a remat-kit policy (name, spec, mapping), a raw ``jax.checkpoint_policies``
        policy, or None (save nothing, as in ``jax.checkpoint``).
      remat_static_argnums: ``nn.remat``'s ``static_argnums``, checked by
        :func:`check_remat_static_argnums`.
      remat_call_args: one call's positional arguments (without ``self``), for that check.
      argnums: the arguments to differentiate (default: those whose arrays are all float).

    Returns:
      The findings, errors first.

    Raises:
      ValueError: unknown policy name or target.
      Exception: what tracing ``make_loss(policy)(*args)`` raises, unless a ``static_argnums``
        finding explains it (the findings are then returned).
    """
    tgt = T.get_target(target)
    # as a Program takes its arguments: an equinox.Module's non-array leaves static
    make_loss, args = filtered_factory(make_loss, args)
    promise, findings, jax_policy = _read_policy(policy)
    # before the trace: an off-by-one static_argnums makes it fail (flax#2452)
    static = (
        check_remat_static_argnums(remat_static_argnums, remat_call_args)
        if remat_static_argnums is not None
        else []
    )
    loss = make_loss(jax_policy)
    try:
        jaxpr = jax.make_jaxpr(loss)(*args).jaxpr
    except Exception as exc:  # noqa: BLE001 - re-raised unless the static_argnums explain it
        if not has_errors(static):
            raise
        failed = f" Tracing the loss fails with it ({type(exc).__name__})."
        return findings + [dataclasses.replace(f, what=f.what + failed) for f in static]
    label = f"policy {promise.name if promise else 'custom-callable'!r}"
    if not has_remat(jaxpr):  # the policy is never applied: nothing else to say about it
        return [no_remat_segment(label, "make_loss")]
    reach = factory_reach(make_loss, args, "make_loss")  # the judgement analyze makes
    if not reach.passes:  # remat segments of the model's own, none taking the policy
        return [policy_not_passed(label, "make_loss", reach.segments)]
    findings += static
    run = _analysed(make_loss, args, loss, jaxpr, tgt, argnums)
    promise, opaque, judged = _judged_promise(policy, promise, run.facts, jax_policy)
    findings += judged
    findings += _compared(promise, run, make_loss, args, reach, tgt)
    if opaque:
        findings = _opaque_findings(findings, make_loss, jax_policy, args)
    return sort_findings(dedupe(findings))


@dataclasses.dataclass(frozen=True)
class _Analysed:
    """A user's loss analysed under ``"policy"`` and ``"no-remat"``: losses, gradients,
    compiled reports, :class:`TagFacts`."""

    losses: dict[str, Callable[..., Any]]
    grads: dict[str, Callable[..., Any]]
    reports: dict[str, MemoryReport]
    facts: TagFacts


def _analysed(
    make_loss: Callable[[Callable[..., Any] | None], Callable[..., Any]],
    args: Sequence[Any],
    loss: Callable[..., Any],
    jaxpr: Any,
    tgt: T.Target,
    argnums: int | Sequence[int] | None,
) -> _Analysed:
    """Trace and compile ``loss`` and the loss without remat for ``tgt``."""
    loss_all = make_loss(jax.checkpoint_policies.everything_saveable)
    losses = {"policy": loss, "no-remat": loss_all}
    facts = tag_facts(losses["policy"], *args, emitted=W.emitted_tags(loss_all, *args))
    keeping = _flops_keeping(make_loss, args)
    inside = (facts.in_remat or frozenset()) | facts.in_fwd_rule
    facts = dataclasses.replace(
        facts,
        savers=_savers(make_loss, args, inside, matmul_tags(jaxpr), keeping),
        flops_keeping=keeping,
    )
    nums = _float_argnums(args) if argnums is None else argnums
    grads = {k: jax.value_and_grad(f, argnums=nums) for k, f in losses.items()}
    reports = {k: analyze(g, *args, target=tgt, name=k, policy=k) for k, g in grads.items()}
    return _Analysed(losses, grads, reports, facts)


def _judged_promise(
    policy: str | PolicySpec | Mapping[str, str] | Callable[..., Any] | None,
    promise: Promise | None,
    facts: TagFacts,
    jax_policy: Callable[..., Any],
) -> tuple[Promise, bool, list[Finding]]:
    """``(promise, opaque, findings)`` of the policy on the emitted names."""
    findings: list[Finding] = []
    if promise is None:  # save_any_names_but_these: the name set it amounts to here
        promise = promise_of_exclusions(policy, facts.emitted)
        findings += excluded_unknown(policy, facts.emitted)
    opaque = promise is None
    if opaque:  # an opaque callable: judge by what it does, against no-remat
        promise = Promise("custom-callable")
    else:
        findings += unknown_tags(promise, facts)
    if policy is None or (callable(policy) and not isinstance(policy, PolicySpec)):
        findings += remat3_findings(promise.name, jax_policy, promise)  # a raw JAX policy
    else:  # a remat-kit policy: what the implementation in use makes of it, from a probe
        findings += effect_findings(promise.name, resolve_policy(policy), promise)
    return promise, opaque, findings


def _compared(
    promise: Promise,
    run: _Analysed,
    make_loss: Callable[[Callable[..., Any] | None], Callable[..., Any]],
    args: Sequence[Any],
    reach: PolicyReach,
    tgt: T.Target,
) -> list[Finding]:
    """:func:`compare`'s findings on a user's function against no remat."""
    ops = None
    if not run.reports["no-remat"].flops:  # no counted FLOPs to tell recomputation by
        ops = recomputed_ops(run.grads["policy"], args, tgt)
    evidence = PolicyEvidence(
        run.reports["policy"], run.reports["no-remat"],
        Residuals.of(saved_residuals(run.losses["policy"], *args)),
        Residuals.of(saved_residuals(run.losses["no-remat"], *args)),
        kept_nothing=Residuals.of(
            saved_residuals(make_loss(jax.checkpoint_policies.nothing_saveable), *args)
        ),
        recomputed_ops=ops,
    )  # fmt: skip
    return compare(promise, evidence, tgt, facts=run.facts, reach=reach)


def _opaque_findings(
    findings: list[Finding],
    make_loss: Callable[[Callable[..., Any] | None], Callable[..., Any]],
    jax_policy: Callable[..., Any],
    args: Sequence[Any],
) -> list[Finding]:
    """``findings`` of an opaque callable restated (:func:`_opaque_full_remat`,
    :func:`_callable_no_op`)."""
    findings = [f for f in findings if f.code != "acts-as-full-remat"]
    findings += _opaque_full_remat(make_loss, jax_policy, args)
    # the no-op cause compare gave (layers outside remat) is not the callable's
    if any(f.code == "saves-everything" for f in findings):  # the same fact, its cause
        findings = [f for f in findings if f.code != "no-op-policy"]
    return [_callable_no_op(f) if f.code == "no-op-policy" else f for f in findings]


def _callable_no_op(finding: Finding) -> Finding:
    """``no-op-policy`` with the cause an opaque callable has: it saves what it is asked."""
    return dataclasses.replace(
        finding,
        cause="the callable marks every value the backward pass needs as saveable.",
        fix="name what to save: jax.checkpoint_policies.save_only_these_names(...) "
        "or remat_kit.custom_policy({...}).",
    )


def _read_policy(policy):
    """(promise or None for an opaque callable, findings about the callable, jax policy)."""
    if policy is None:  # as in jax.checkpoint: save nothing
        policy = jax.checkpoint_policies.nothing_saveable
    if callable(policy) and not isinstance(policy, PolicySpec):
        promise, findings = describe_callable(policy)
        return promise, findings, policy
    spec = resolve_policy(policy)
    return Promise.of(spec, registered=spec.name in policy_names()), [], spec.to_jax()


def _flops_keeping(make_loss, args: Sequence[Any]) -> Callable[[frozenset[str]], float]:
    """:attr:`TagFacts.flops_keeping` for a user's function (traced matmul FLOPs), cached."""

    @functools.cache
    def keeping(names: frozenset[str]) -> float:
        loss = make_loss(jax.checkpoint_policies.save_only_these_names(*sorted(names)))

        def forward_backward(*xs):
            out, back = jax.vjp(loss, *xs)
            return back(jnp.ones_like(out))

        return traced_flops(forward_backward, *args)

    return keeping


def _savers(
    make_loss,
    args: Sequence[Any],
    tags: frozenset[str],
    matmuls: frozenset[str],
    keeping: Callable[[frozenset[str]], float],
):
    """:attr:`TagFacts.savers` for a user's function: each name saved alone, on demand."""

    def saving(tag: str):
        policy = jax.checkpoint_policies.save_only_these_names(tag)
        return saved_residuals(make_loss(policy), *args)

    def flops(tag: str | None) -> float:
        return keeping(frozenset([tag] if tag else []))

    return functools.cache(lambda: recompute_savers(saving, tags, matmuls, flops))


def _float_argnums(args: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the arguments whose array leaves are all floating point.

    Raises:
      ValueError: none is.
    """
    nums = tuple(
        i
        for i, a in enumerate(args)
        if jax.tree.leaves(a)
        and all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(a))
    )
    if not nums:
        raise ValueError(
            "no floating-point argument to differentiate: pass the parameters (float arrays) "
            "among the loss's arguments, or argnums="
        )
    return nums


def _residuals_withremat3_findings(make_loss, policy, args, remat3: bool) -> Residuals:
    saved = jax.config.jax_remat3
    jax.config.update("jax_remat3", remat3)
    try:
        return Residuals.of(saved_residuals(make_loss(policy), *args))
    finally:
        jax.config.update("jax_remat3", saved)


def _opaque_full_remat(make_loss, policy, args) -> list[Finding]:
    """Whether the remat in use keeps less than classic remat under an opaque callable."""
    classic = _residuals_withremat3_findings(make_loss, policy, args, False)
    current = _residuals_withremat3_findings(make_loss, policy, args, jax.config.jax_remat3)
    nothing = _residuals_withremat3_findings(
        make_loss, jax.checkpoint_policies.nothing_saveable, args, False
    )
    kept = lambda r: r.device_bytes + r.host_bytes  # noqa: E731
    if kept(classic) > kept(nothing) and kept(current) <= kept(nothing):
        return [
            Finding(
                "acts-as-full-remat", "error",
                f"the policy keeps {kept(classic)} residual bytes under classic remat but "
                f"{kept(current)} under jax_remat3: it runs as full remat (save-nothing).",
                remat3_rule(),
                "build the policy from name sets: remat_kit.custom_policy({...}).",
            )
        ]  # fmt: skip
    return []
