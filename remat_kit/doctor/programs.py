"""The doctor on a user's :class:`~remat_kit.program.Program`: what each policy promises against
what the program's traced loss and compiled step do, as for the bundled models.

Without a policy list the doctor checks the default set ``analyze`` compiles on a program
(:func:`remat_kit.memory.programs.program_policies`): the kind-based policies (``save-nothing``,
``save-dots``...), the name-based ones whose names it emits, those naming some of them cut down
to those (labelled ``name (cut)``), and specs in its own names (each saved alone, all saved, all
offloaded where the target offloads); the rest, and offload policies on a target without host
offload, are one note each, not errors.
A policy the user names explicitly is checked as given: one ``unknown-tag`` error for the names
the program never emits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax

from remat_kit import residuals as R
from remat_kit import targets as T
from remat_kit.doctor.compare import Residuals, compare
from remat_kit.doctor.findings import Finding, dedupe, has_errors, sort_findings
from remat_kit.doctor.promise import Promise, effect_findings, resolve_policy
from remat_kit.doctor.tags import (
    TagFacts,
    matmul_tags,
    no_remat_segment,
    policy_not_passed,
    recompute_savers,
    unknown_tags,
)
from remat_kit.memory.programs import analyze_program, program_policies, program_tags
from remat_kit.policies import (
    PolicySpec,
    custom_spec,
    get_policy_spec,
    policy_label,
    policy_names,
)
from remat_kit.program import Program, policy_reach
from remat_kit.walker import tags_in_remat


@dataclasses.dataclass(frozen=True)
class PolicyCheck:
    """One policy checked on a program: ``label`` as printed (a registered policy cut down to
    the program's names reads ``save-qkv-out-proj -> out_proj=save``), the spec compiled, and
    its findings (errors first)."""

    label: str
    spec: PolicySpec
    findings: tuple[Finding, ...]


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """The doctor's answer for a program: the emitted checkpoint names, one
    :class:`PolicyCheck` per policy checked, and notes (policies not checked and why)."""

    program: str
    tags: frozenset[str]
    checks: tuple[PolicyCheck, ...]
    notes: tuple[str, ...]

    @property
    def has_errors(self) -> bool:
        """True when a finding is an error (``remat-kit doctor`` exits 1)."""
        return any(has_errors(c.findings) for c in self.checks)


def _kept(program: Program, spec: PolicySpec) -> Residuals:
    loss = program.loss(spec)
    return Residuals.of(R.saved_residuals(loss.fn, *loss.args))


def _facts(program: Program, tags: frozenset[str]) -> TagFacts:
    """The program's :class:`TagFacts`: where its names are applied (traced under
    ``save-nothing``), and, on demand, which of those inside a remat segment saving keeps."""
    loss = program.loss(get_policy_spec("save-nothing"))
    jaxpr = jax.make_jaxpr(loss.fn)(*loss.args).jaxpr
    inside, matmuls = tags_in_remat(jaxpr), matmul_tags(jaxpr)

    def saving(tag: str):
        saved = program.loss(custom_spec({tag: "save"}))
        return R.saved_residuals(saved.fn, *saved.args)

    savers = functools.cache(lambda: recompute_savers(saving, inside, matmuls))
    return TagFacts(tags, inside, user=True, savers=savers)


def check_program_policies(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    target: str | T.Target = "cpu",
) -> ProgramCheck:
    """Check policies on a user's program (its loss is needed: ``Program.from_loss``, or
    ``make_loss=`` in ``Program.from_step``).

    Compiles the program's step under each policy and under ``no-remat`` for ``target``, and
    reads what its loss keeps under each. Advice speaks of the user's code (``lax.scan``,
    ``nn.scan``, ``nnx.scan``) and its own checkpoint names, not of remat-kit's config fields
    or named policies.

    Args:
      policies: the policies to check as given (a name the program never emits is an
        ``unknown-tag`` error); None: the registered ones that act on its names (module
        docstring).

    Raises:
      ValueError: unknown policy or target; a program without a loss.
    """
    if program.make_loss is None:
        raise ValueError(
            f"program {program.name!r} has no loss: the doctor compares what the loss keeps; "
            "build it with Program.from_loss, or pass make_loss= and loss_args= to from_step"
        )
    tgt = T.get_target(target)
    tags = program_tags(program)
    if policies is None:
        chosen = program_policies(program, tgt)
        specs, labels, notes = list(chosen.specs), chosen.labels(), list(chosen.notes)
        if not specs:
            notes.append(f"no policy acts on program {program.name!r}: nothing to check")
    else:
        specs = [resolve_policy(p) for p in policies]
        labels, notes = [policy_label(s) for s in specs], []
    if not specs:
        return ProgramCheck(program.name, tags, (), tuple(notes))
    facts = _facts(program, tags)
    reach = policy_reach(program)  # the judgement analyze and recommend make too
    if reach.no_remat_note():
        notes.append(f"no-remat: {reach.no_remat_note()}")
    applied = [not spec.wrap or reach.passes for spec in specs]
    compiled = [s for s, ok in zip(specs, applied, strict=True) if ok]
    jobs = [*compiled, "no-remat"] if compiled else []  # nothing to compile when none applies
    reports = analyze_program(program, jobs, tgt, strict_tags=False) if jobs else []
    base = _kept(program, get_policy_spec("no-remat"))
    registered = set(policy_names())
    checks, each = [], iter(reports)
    for spec, label, ok in zip(specs, labels, applied, strict=True):
        if not ok:  # the factory ignores the policy: nothing else to say about it
            factory = f"the factory {program.name!r}"
            findings = [
                policy_not_passed(label, factory, reach.segments)
                if reach.segments
                else no_remat_segment(label, factory)
            ]
            checks.append(PolicyCheck(label, spec, tuple(findings)))
            continue
        promise = Promise.of(spec, registered=spec.name in registered)
        promise = dataclasses.replace(promise, name=label)
        findings = unknown_tags(promise, facts)
        findings += effect_findings(label, spec, promise)
        kept = _kept(program, spec)
        findings += compare(promise, next(each), reports[-1], kept, base, tgt, facts=facts)
        checks.append(PolicyCheck(label, spec, tuple(sort_findings(dedupe(findings)))))
    return ProgramCheck(program.name, tags, tuple(checks), tuple(notes))


def check_program(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]] | None = None,
    target: str | T.Target = "cpu",
) -> list[list[Finding]]:
    """:func:`check_program_policies`, the findings only: one list per policy checked, errors
    first.

    Raises:
      ValueError: as :func:`check_program_policies`.
    """
    return [list(c.findings) for c in check_program_policies(program, policies, target).checks]


__all__ = [
    "PolicyCheck",
    "ProgramCheck",
    "check_program",
    "check_program_policies",
]
