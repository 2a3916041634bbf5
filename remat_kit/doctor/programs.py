"""The doctor on a user's :class:`~remat_kit.program.Program`: what each policy promises against
what the program's traced loss and compiled step do, as for the bundled models.

Without a policy list the doctor checks the registered policies that can act on the program's
own checkpoint names (:func:`remat_kit.policies.policies_for_tags`, as ``recommend`` does): the
kind-based ones (``save-nothing``, ``save-dots``...), the name-based ones whose names it emits,
and those naming some of them cut down to those (labelled with the policy they came from); the
rest, and offload policies on a target without host offload, are one note each, not errors.
A policy the user names explicitly is checked as given: one ``unknown-tag`` error for the names
the program never emits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from remat_kit import residuals as R
from remat_kit import targets as T
from remat_kit.doctor.compare import Residuals, compare
from remat_kit.doctor.findings import Finding, dedupe, has_errors, sort_findings
from remat_kit.doctor.promise import Promise, remat3_findings, resolve_policy
from remat_kit.doctor.tags import TagFacts, tags_in_remat, unknown_tags
from remat_kit.memory.programs import analyze_program, program_tags
from remat_kit.policies import (
    PolicySpec,
    get_policy_spec,
    policies_for_tags,
    policy_label,
    policy_names,
)
from remat_kit.program import Program


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


def default_policies(
    tags: frozenset[str], target: T.Target, program: str
) -> tuple[list[PolicySpec], list[str], list[str]]:
    """``(specs, labels, notes)``: the registered policies worth checking on a program emitting
    ``tags`` for ``target`` (see the module docstring)."""
    fit = policies_for_tags(policy_names(), tags)
    cut_from: dict[PolicySpec, str] = {}
    for named, cut in fit.restricted:  # two named policies may cut down to one spec
        cut_from[cut] = f"{cut_from[cut]}, {named.name}" if cut in cut_from else named.name
    specs = [s for s in fit.specs if target.supports_host_offload or not s.offloads]
    notes = fit.notes(program)
    no_host = [cut_from.get(s, s.name) for s in fit.specs if s not in specs]
    if no_host:
        notes.append(
            f"not checked: {', '.join(no_host)} (they offload to host; target {target.name!r} "
            "does not)"
        )
    if not specs:
        notes.append(f"no registered policy acts on {program}: nothing to check")
    labels = [
        f"{cut_from[s]} -> {policy_label(s).removeprefix('custom: ')}" if s in cut_from
        else policy_label(s)
        for s in specs
    ]  # fmt: skip
    return specs, labels, notes


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
    what = f"program {program.name!r}"
    if policies is None:
        specs, labels, notes = default_policies(tags, tgt, what)
    else:
        specs = [resolve_policy(p) for p in policies]
        labels, notes = [policy_label(s) for s in specs], []
    if not specs:
        return ProgramCheck(program.name, tags, (), tuple(notes))
    loss = program.loss(get_policy_spec("save-nothing"))
    facts = TagFacts(tags, tags_in_remat(jax.make_jaxpr(loss.fn)(*loss.args).jaxpr), user=True)
    reports = analyze_program(program, [*specs, "no-remat"], tgt, strict_tags=False)
    base = _kept(program, get_policy_spec("no-remat"))
    registered = set(policy_names())
    checks = []
    for spec, label, report in zip(specs, labels, reports, strict=False):
        promise = Promise.of(spec, registered=spec.name in registered)
        promise = dataclasses.replace(promise, name=label)
        findings = unknown_tags(promise, facts)
        if spec.wrap:
            findings += remat3_findings(label, spec.to_jax(), promise)
        findings += compare(
            promise, report, reports[-1], _kept(program, spec), base, tgt, facts=facts
        )
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
    "default_policies",
]
