"""The trace stage: a program on a target traced once (:func:`trace_program`: what every
policy shares) and under each policy (:func:`trace_policy`: the step's jaxpr, what the loss
keeps by checkpoint name, its FLOPs), nothing compiled; the compile stage
(:mod:`remat_kit.memory.runner`) lowers what this stage traced.

Each function answers from the program's builder where it knows better
(:class:`~remat_kit.family.Known`: one remat segment of a bundled model, per chip for MaxText)
and from the loss's one trace (:meth:`~remat_kit.program.Program.loss`) otherwise. What is
traced once per program (its tags, its no-remat FLOPs, its reach) is memoised beside it
(:func:`remat_kit.program.memo`), not in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from remat_kit import targets as T
from remat_kit.loss_step import diff_part
from remat_kit.placement import BufferNames, Placement
from remat_kit.policies import PolicySpec, get_policy_spec
from remat_kit.program import Program, memo
from remat_kit.pure import Pure, argument_parts, is_float_array
from remat_kit.reach import PolicyReach
from remat_kit.walker import (
    RematPlacement,
    Residual,
    TagResiduals,
    emitted_tags,
    group_by_tag,
    held_on_device,
    jaxpr_flops,
    remat_placement,
    saved_residuals,
    tags_in,
    traced_flops,
)


def program_tags(program: Program) -> frozenset[str]:
    """The ``checkpoint_name`` tags the program's step emits (under no remat; the tags do not
    depend on the policy), found by walking its jaxpr and every sub-jaxpr (and its loss's,
    where it gives one: a name applied only in a ``custom_vjp`` forward rule shows up there).
    What :func:`remat_kit.get_policy_spec` reads ``save_any_names_but_these`` against.

    Traced once per program (step and loss); compiles nothing. Raises what the program's
    factory raises while tracing."""

    def walk() -> frozenset[str]:
        pure = program.step(get_policy_spec("no-remat"))
        tags = tags_in(jax.make_jaxpr(pure.fn)(*pure.args).jaxpr)
        loss = program.loss(get_policy_spec("no-remat"))
        if loss is not None:  # names applied only in a custom_vjp forward rule show up here
            tags |= emitted_tags(loss.fn, *loss.args)
        return frozenset(tags)

    return memo(program, "tags", walk)


@dataclasses.dataclass(frozen=True)
class ProgramTrace:
    """A program on a target as every policy shares it (:func:`trace_program`).

    Attributes:
      program: the program.
      target: where it is compiled.
      placement: its arguments on the target's devices.
      tags: the ``checkpoint_name`` tags its step emits (:func:`program_tags`).
      reach: whether its factories pass the policy on (:meth:`Program.reach`).
      arguments: bytes per device of its step's arguments, by kind (``params``,
        ``opt_state``, ...: :func:`remat_kit.pure.argument_parts`).
      flops_no_remat: matmul FLOPs per device of its step without remat, the recompute
        ratio's denominator (on a mesh the traced global step's even share); None where the
        no-remat step is itself rematerialised.
    """

    program: Program
    target: T.Target
    placement: Placement
    tags: frozenset[str]
    reach: PolicyReach
    arguments: dict[str, int]
    flops_no_remat: float | None


def trace_program(program: Program, target: str | T.Target) -> ProgramTrace:
    """``program`` on ``target``, traced without remat; nothing compiled.

    Raises:
      ValueError: unknown target.
      Exception: whatever tracing the program's factories raises.
    """
    tgt = T.get_target(target)
    placement = program.place(tgt)
    reach = program.reach()
    pure = program.step(get_policy_spec("no-remat"))
    placed = placement.place(pure.args)
    arguments = argument_parts(dataclasses.replace(pure, args=tuple(placed)), program.args)
    flops = None
    if not reach.without_policy:  # a no-remat step that remats gives no ratio
        tpu = counts_as_tpu(tgt)

        def count() -> float:
            base = program.baseline_step()
            return traced_flops(base.fn, *base.args, tpu=tpu)

        flops = memo(program, ("flops_no_remat", tpu), count) / placement.devices
    return ProgramTrace(program, tgt, placement, program_tags(program), reach, arguments, flops)


def counts_as_tpu(target: T.Target) -> bool:
    """Whether the jaxpr's FLOPs count the kernels as a TPU runs them (``tpu`` of
    :func:`remat_kit.walker.eqn_flops`): a ``lax.ragged_dot`` over its routed rows only, a
    Pallas kernel at its cost estimate, as the compiled Mosaic calls are counted."""
    return target.platform == "tpu"


def trace_step(program: Program, spec: PolicySpec, placement: Placement) -> tuple[Pure, Any]:
    """The program's step under ``spec`` (:meth:`Program.step`), jitted and traced on its
    placed arguments: the ``jax.stages.Traced`` that analysis and measured runs both lower.

    Raises:
      Exception: whatever tracing the program's step raises.
    """
    pure = program.step(spec)
    fixed = {} if placement.out_shardings is None else {"out_shardings": placement.out_shardings}
    jitted = jax.jit(pure.fn, donate_argnums=program.donated(pure), **fixed)
    with T.activation_sharding(placement.mesh):  # the model traced under the mesh
        return pure, jitted.trace(*placement.place(pure.args))


@dataclasses.dataclass(frozen=True)
class Traced:
    """One policy's step on a :class:`ProgramTrace` (:func:`trace_policy`).

    Attributes:
      program_trace: what the policy shares with the program's other policies.
      spec: the policy.
      pure: the step as a function of arrays (NNX objects split).
      stage: its ``jax.stages.Traced`` on the placed arguments (``stage.lower()``).
      residuals: what the loss keeps by checkpoint tag (:func:`residuals`; rows offloaded to
        a target without host memory held on device); None without a loss.
      flops: matmul FLOPs per device of the traced step; None under ``no-remat`` (not walked).
      remat: where its remat regions sit (:func:`remat_kit.walker.remat_placement`); None
        under ``no-remat``.
    """

    program_trace: ProgramTrace
    spec: PolicySpec
    pure: Pure
    stage: Any
    residuals: tuple[TagResiduals, ...] | None
    flops: float | None
    remat: RematPlacement | None


def trace_policy(program_trace: ProgramTrace, spec: PolicySpec) -> Traced:
    """The program's step under ``spec``, traced; nothing lowered or compiled.

    Raises:
      Exception: whatever tracing the program's step or loss raises.
    """
    program, placement = program_trace.program, program_trace.placement
    pure, stage = trace_step(program, spec, placement)
    rows = residuals(program, spec, placement)
    if rows is not None and not program_trace.target.supports_host_offload:
        rows = held_on_device(rows)  # what it offloads stays in device memory
    jaxpr = stage.jaxpr.jaxpr if spec.wrap else None
    tpu = counts_as_tpu(program_trace.target)
    flops = None if jaxpr is None else jaxpr_flops(jaxpr, tpu) / placement.devices
    remat = None if jaxpr is None else remat_placement(jaxpr)
    return Traced(program_trace, spec, pure, stage, rows, flops, remat)


def saved(program: Program, spec: PolicySpec) -> list[Residual] | None:
    """The values the loss keeps for its backward pass under ``spec``, one
    :class:`~remat_kit.walker.Residual` each (arguments flagged); None without
    ``make_loss``. Traces the loss, compiles nothing (the builder's
    :attr:`~remat_kit.family.Known.saved` where it has one)."""
    if program.known.saved is not None:
        return program.known.saved(program, spec)
    loss = program.loss(spec)
    if loss is None:
        return None
    return list(saved_residuals(loss.fn, *loss.args))


def residuals(
    program: Program, spec: PolicySpec, placement: Placement
) -> tuple[TagResiduals, ...] | None:
    """:func:`saved` by checkpoint tag (parameters excluded; shapes as the VJP keeps them,
    e.g. [layers, batch, seq, d_model] under a layer scan); None without ``make_loss``.
    The builder's :attr:`~remat_kit.family.Known.residuals` where it has one."""
    if program.known.residuals is not None:
        return program.known.residuals(program, spec, placement)
    kept = saved(program, spec)
    return None if kept is None else tuple(group_by_tag(kept))


def buffer_names(
    program: Program, rows: Sequence[TagResiduals], placement: Placement
) -> BufferNames:
    """What names the buffers live at the peak: each residual row's shape -> its tags, and
    the differentiated arguments' shapes (parameters; their gradients share them); the
    builder's :attr:`~remat_kit.family.Known.buffer_names` where it has one."""
    if program.known.buffer_names is not None:
        return program.known.buffer_names(program, rows, placement)
    return traced_buffer_names(program, rows)


def traced_buffer_names(program: Program, rows: Sequence[TagResiduals]) -> BufferNames:
    """:func:`buffer_names` from the residual rows and the parameters as traced."""
    params = [(x.dtype.name, tuple(x.shape)) for x in param_leaves(program)]
    stacked: dict[tuple[str, tuple[int, ...]], tuple[str, ...]] = {}
    for row in rows:
        key = (row.dtype, tuple(row.shape))
        if row.tag not in stacked.get(key, ()):
            stacked[key] = (*stacked.get(key, ()), row.tag)
    return BufferNames(stacked=stacked, params=frozenset(params))


def param_leaves(program: Program) -> list[Any]:
    """The arrays the loss differentiates: the float array leaves of its ``argnums``
    arguments (not integer or boolean buffers), an NNX object's ``nnx.Param`` state only
    (not its RNG keys, counters or batch statistics); empty without a loss."""
    out = []
    for i in program.argnums if program.make_loss is not None else ():
        arg = program.loss_args[i]
        out += [x for x in jax.tree.leaves(diff_part(arg)[0]) if is_float_array(x)]
    return out
