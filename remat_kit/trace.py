"""The trace stage: what a program's loss keeps for its backward pass under a policy (traced,
nothing compiled), by checkpoint name, and what names the buffers alive at the compiled peak.

Each function answers from the program's builder where it knows better
(:class:`~remat_kit.family.Known`: one remat segment of a bundled model, per chip for MaxText)
and from the loss's one trace (:meth:`~remat_kit.program.Program.loss`) otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from remat_kit.loss_step import diff_part
from remat_kit.placement import BufferNames, Placement
from remat_kit.policies import PolicySpec
from remat_kit.program import Program
from remat_kit.pure import is_float_array
from remat_kit.walker import Residual, TagResiduals, group_by_tag, saved_residuals


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
