"""The doctor on a user's :class:`~remat_kit.program.Program`: what each policy promises against
what the program's traced loss and compiled step do, as for the bundled models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from remat_kit import residuals as R
from remat_kit import targets as T
from remat_kit.doctor.compare import Residuals, compare, unknown_tags
from remat_kit.doctor.findings import Finding, dedupe, sort_findings
from remat_kit.doctor.promise import Promise, remat3_findings, resolve_policy
from remat_kit.memory.programs import analyze_program, program_tags
from remat_kit.policies import PolicySpec, get_policy_spec, policy_names
from remat_kit.program import Program


def _kept(program: Program, spec: PolicySpec) -> Residuals:
    loss = program.loss(spec)
    return Residuals.of(R.saved_residuals(loss.fn, *loss.args))


def check_program(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]],
    target: str | T.Target = "cpu",
) -> list[list[Finding]]:
    """Check policies on a user's program (its loss is needed: ``Program.from_loss``, or
    ``make_loss=`` in ``Program.from_step``).

    Compiles the program's step under each policy and under ``no-remat`` for ``target``, and
    reads what its loss keeps under each; a tag the program never emits is an ``unknown-tag``
    error naming the emitted ones. Advice speaks of the user's code (``lax.scan``, ``nn.scan``,
    ``nnx.scan``), not of remat-kit's config fields.

    Returns:
      One list of findings per policy, errors first.

    Raises:
      ValueError: unknown policy or target; a program without a loss.
    """
    if program.make_loss is None:
        raise ValueError(
            f"program {program.name!r} has no loss: the doctor compares what the loss keeps; "
            "build it with Program.from_loss, or pass make_loss= and loss_args= to from_step"
        )
    specs = [resolve_policy(p) for p in policies]
    tgt = T.get_target(target)
    tags = program_tags(program)
    reports = analyze_program(program, [*specs, "no-remat"], tgt, strict_tags=False)
    base = _kept(program, get_policy_spec("no-remat"))
    registered = set(policy_names())
    out = []
    for spec, report in zip(specs, reports, strict=False):
        promise = Promise.of(spec, registered=spec.name in registered)
        findings = unknown_tags(promise, tags)
        if spec.wrap:
            findings += remat3_findings(spec.name, spec.to_jax(), promise)
        findings += compare(promise, report, reports[-1], _kept(program, spec), base, tgt)
        out.append(sort_findings(dedupe(findings)))
    return out


__all__ = ["check_program", "Finding"]
