"""Analyze a user's :class:`~remat_kit.program.Program` under several policies.

The same report as for the bundled presets: compiled peak and host bytes, residuals by
checkpoint tag (from the loss's saved residuals, when the program gives its loss), recompute
ratio against the same step without remat, the on-device twin of an offload policy (whether
offloading lowered the peak is measured), buffers at the peak; policies compile concurrently and
identical programs once (:mod:`remat_kit.memory.runner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit.memory.flops import traced_flops
from remat_kit.memory.report import MemoryReport
from remat_kit.memory.runner import Job, add_offload_jobs, run_jobs
from remat_kit.memory.xla_compile import CompileError
from remat_kit.policies import PolicySpec, check_tags, get_policy_spec, policy_specs
from remat_kit.program import Program, argument_parts
from remat_kit.residuals import TagResiduals, group_by_tag, saved_residuals
from remat_kit.walker import emitted_tags, tags_in

DEFAULT_TOP_K = 10


@dataclasses.dataclass
class _ProgramSetup:
    """What does not depend on the policy: the target, the emitted tags, the baseline."""

    program: Program
    target: T.Target
    sharding: Any
    tags: frozenset[str]
    flops_no_remat: float | None = None


def program_tags(program: Program) -> frozenset[str]:
    """The ``checkpoint_name`` tags the program's step emits (under no remat; the tags do not
    depend on the policy), found by walking its jaxpr and every sub-jaxpr."""
    pure = program.step(get_policy_spec("no-remat"))
    tags = tags_in(jax.make_jaxpr(pure.fn)(*pure.args).jaxpr)
    loss = program.loss(get_policy_spec("no-remat"))
    if loss is not None:  # names applied only in a custom_vjp forward rule show up here
        tags |= emitted_tags(loss.fn, *loss.args)
    return frozenset(tags)


def _program_residuals(program: Program, spec: PolicySpec) -> tuple[TagResiduals, ...] | None:
    """Residuals the loss keeps under ``spec`` by tag (parameters excluded); None without a
    loss."""
    loss = program.loss(spec)
    if loss is None:
        return None
    rows = group_by_tag(saved_residuals(loss.fn, *loss.args))
    return tuple(rows)


def _program_job(setup: _ProgramSetup, spec: PolicySpec, visible: bool = True) -> Job:
    program = setup.program
    pure = program.step(spec)
    abstract = tuple(T.abstractify(a, setup.sharding) for a in pure.args)
    jitted = jax.jit(pure.fn, donate_argnums=program.donated(pure))
    residuals = _program_residuals(program, spec)
    notes: tuple[str, ...] = ()
    if residuals is None:
        notes = ("no residual table: give the program's loss (Program.from_loss, or make_loss= "
                 "in Program.from_step) for residuals by checkpoint tag",)  # fmt: skip
    return Job(
        name=program.name,
        what=f"policy {spec.name!r} of {program.name!r} on target {setup.target.name!r}",
        target=setup.target,
        lower=lambda: jitted.lower(*abstract),
        arguments=argument_parts(pure, program.args),
        policy=spec.name,
        flops_no_remat=setup.flops_no_remat,
        residuals=residuals or (),
        activation_bytes=None
        if residuals is None
        else sum(r.nbytes for r in residuals if r.memory == "device"),
        offloaded_bytes=None
        if residuals is None
        else sum(r.nbytes for r in residuals if r.memory == "host"),
        model=program.name,
        visible=visible,
        notes=notes,
        flops_traced=traced_flops(pure.fn, *pure.args) if spec.wrap else None,
        program_key=repr(
            (id(setup), spec.base, sorted(spec.save), sorted(spec.offload), spec.wrap)
        ),
    )


def _setup(program: Program, target: str | T.Target) -> _ProgramSetup:
    if not isinstance(program, Program):
        raise ValueError(
            f"expected a remat_kit.Program (Program.from_loss / Program.from_step), got "
            f"{type(program).__name__}"
        )
    tgt = T.get_target(target)
    setup = _ProgramSetup(program, tgt, T.abstract_sharding(tgt), program_tags(program))
    base = program.step(get_policy_spec("no-remat"))
    setup.flops_no_remat = traced_flops(base.fn, *base.args)
    return setup


def analyze_program(
    program: Program,
    policies: Sequence[str | PolicySpec | Mapping[str, str]],
    target: str | T.Target = "local",
    budget_bytes: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    fast_compile: bool = True,
    workers: int | None = None,
    raise_errors: bool = True,
    compare_offload: bool = True,
    strict_tags: bool = True,
) -> list[MemoryReport | CompileError]:
    """Compile a user's program under each policy for ``target`` and report its memory.

    Args:
      program: a :class:`~remat_kit.program.Program`.
      policies: names, :class:`PolicySpec` or per-tag mappings in the program's own tag names.
      target, budget_bytes, top_k, fast_compile: as :func:`remat_kit.analyze`.
      workers: concurrent compiles (default ``min(4, cpu_count - 1)``).
      raise_errors: False: a policy that fails to compile gives its :class:`CompileError`.
      compare_offload: also compile each offloading policy with its tags kept on device, where
        the target offloads, and report that peak (``peak_bytes_without_offload``).
      strict_tags: raise on a user spec naming a tag the program never emits (False: compile
        it anyway; the doctor reports it as a finding).

    Returns:
      One :class:`MemoryReport` per policy: peak, host bytes, residuals by tag (with a loss),
      recompute ratio (compiled matmul FLOPs over the traced no-remat step's), buffers at peak.

    Raises:
      ValueError: unknown policy or target; a policy naming a tag the program never emits
        (the message lists the emitted tags and the closest).
      CompileError: with ``raise_errors``, the first policy that failed to compile.
    """
    specs = [get_policy_spec(p) for p in policies]
    setup = _setup(program, target)
    registered = policy_specs()
    for spec in specs:
        if strict_tags and registered.get(spec.name) != spec:  # the user's own spec
            check_tags(spec, setup.tags, f"program {program.name!r}")
    jobs = [_program_job(setup, spec) for spec in specs]
    for job, spec in zip(jobs, specs, strict=True):
        if spec.base == "names" and spec.tags and not spec.tags & setup.tags:
            job.notes = (
                *job.notes,
                f"policy {spec.name!r} names {', '.join(sorted(spec.tags))}, none of which "
                f"{program.name!r} emits (it emits: {', '.join(sorted(setup.tags)) or 'none'}): "
                "it runs as save-nothing; tag the model (remat_kit.tag_linen / tag_nnx) or write "
                "a per-tag spec in its own names",
            )
    add_offload_jobs(
        jobs, specs, setup.target, compare_offload,
        lambda twin: _program_job(setup, twin, visible=False),
    )  # fmt: skip
    results = run_jobs(jobs, top_k, budget_bytes, fast_compile, workers, raise_errors)
    return results[: len(specs)]
