"""Whether a program's factories pass the policy they receive on to their remat segments
(two to four traces, nothing compiled)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from remat_kit.policies import remat_implementation
from remat_kit.pure import Factory, param_names, purify
from remat_kit.walker import (
    holds,
    remat_in_loop,
    remat_policy,
    remat_segments,
    wraps_whole_loop,
)


@dataclasses.dataclass(frozen=True)
class PolicyReach:
    """Whether a program's factory passes the policy it receives to its remat segments.

    Read from two traces (nothing compiled) of the loss (the step where no loss is given): one
    with a probe policy, a fresh function no model holds, and one with None (``no-remat``).

    Attributes:
      program: the program's name.
      segments: remat segments (``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat`` /
        ``eqx.filter_checkpoint``: the ``remat`` primitive) in the probe trace.
      reached: those of them whose policy is the probe or holds it (a wrapper around it).
      without_policy: remat segments in the trace for ``no-remat`` (a factory building without
        remat has none).
      part: which of the program's factories this judges (``make_step``, ``make_loss``).
      linearized: None where the segments were counted; under a ``jax_remat3`` that
        differentiates a remat segment as it traces it (jax 0.10.2's: a step's trace holds
        none; jax 0.12's leaves the segments in the step's trace, counted), whether
        the trace changes with the policy (save-everything against save-nothing): True, the
        policy reaches segments the trace no longer shows (``segments`` and ``reached`` are
        then 0, not counted).
      around_loop: those segments that wrap a whole loop with no remat in its body
        (:func:`remat_kit.walker.wraps_whole_loop`: ``jax.checkpoint`` around a ``lax.scan``).
      lone: the trace's only remat segment sits outside every loop (``jax.checkpoint`` around
        the whole loss: :data:`remat_kit.memory.undone.LONE_SEGMENT_CAUSE`).
      differentiated: those of the ``reached`` segments JAX had already differentiated when
        they took the policy (the ``remat`` primitive's ``differentiated`` parameter: a policy
        set on a step after its gradient, e.g. ``remat_kit.inject_policy`` around the whole
        step), where it changes nothing JAX keeps.
    """

    program: str
    segments: int
    reached: int
    without_policy: int
    part: str = "factory"
    linearized: bool | None = None
    around_loop: int = 0
    lone: bool = False
    differentiated: int = 0

    def after_gradient_cause(self) -> str | None:
        """Why every policy compiles to one program when each reached segment was already
        differentiated (None otherwise), with the fix."""
        if not self.reached or self.differentiated < self.reached:
            return None
        return (
            f"the {self.part}'s remat segments take the policy only after the step's gradient is "
            "taken (remat_kit.inject_policy wrapped around a whole step), when JAX has already "
            "chosen what they keep; hand it to the loss's remat calls: Program.from_loss("
            "inject_policy(loss), ...), or inject_policy(loss)(policy) inside make_step"
        )

    @property
    def passes(self) -> bool:
        """The policy decides something: at least one remat segment takes it."""
        return self.reached > 0 or bool(self.linearized)

    def error(self) -> str:
        """One line: why every policy would compile to one program, and what to do."""
        if self.linearized is False:
            return (
                f"the {self.part} of program {self.program!r} traces to the same step under "
                "every policy (under jax_remat3, which differentiates remat segments as it "
                "traces them, save-everything and save-nothing gave one step), so every policy "
                "would compile to one program; pass the policy it receives to its jax.checkpoint "
                "/ nn.remat / nnx.remat / eqx.filter_checkpoint calls"
            )
        if not self.segments:
            return (
                f"the {self.part} of program {self.program!r} applies no remat: its trace holds "
                "no remat segment (jax.checkpoint / nn.remat / nnx.remat / eqx.filter_checkpoint), "
                "so every policy would compile to the no-remat program; wrap its layers with the "
                "policy it receives: jax.checkpoint(layer, policy=policy)"
            )
        return (
            f"the {self.part} of program {self.program!r} does not pass the policy it receives "
            f"on: none of its {self.segments} remat segment(s) takes it (a remat call with no "
            "policy= or a fixed policy of its own), so every policy would compile to one "
            "program; pass the policy it receives to those remat calls, or wrap the loss in "
            "remat_kit.inject_policy(loss) (docs/own-model-no-policy-hook.md)"
        )

    def no_remat_note(self) -> str | None:
        """A note for the ``no-remat`` row when the factory remats even when given None."""
        if not self.without_policy:
            return None
        return (
            f"not a no-remat baseline: the factory still builds {self.without_policy} remat "
            "segment(s) when given no policy (None), so this row includes that remat and no "
            "recompute ratio is reported against it; build without remat for None (remat_kit."
            "inject_policy does)"
        )


def policy_reach(program: Any) -> PolicyReach:
    """Trace ``program``'s (a :class:`~remat_kit.program.Program`) step, and its loss where it
    has one, with a probe policy and with
    None and count the remat segments that take the policy (:class:`PolicyReach`). The step is
    what compiles and the loss is what is walked for residuals: a policy either drops is not
    passed (the loss's judgement where it drops it, else the step's). Traces only."""
    loss = None
    if program.make_loss is not None:
        loss = factory_reach(program.make_loss, program.loss_args, program.name, "make_loss")
        if not loss.passes:
            return loss
    # a from_loss program's step is its make_loss under value_and_grad: the user's factory
    part = "make_loss" if program.step_of_loss is not None else "make_step"
    step = factory_reach(program.make_step, program.args, program.name, part)
    if step.linearized and loss is not None:  # the loss's trace still shows its segments
        return loss
    return step


def factory_reach(
    make: Factory, args: Sequence[Any], name: str, part: str = "factory"
) -> PolicyReach:
    """:class:`PolicyReach` of a factory ``make(policy) -> fn`` on ``fn``'s arguments ``args``
    (arrays, ``ShapeDtypeStruct`` s, NNX objects, pytrees with static leaves); ``part`` names
    the factory in its messages."""

    def probe(prim: Any, *a: Any, **params: Any) -> bool:  # saves nothing, held by no one
        return jax.checkpoint_policies.nothing_saveable(prim, *a, **params)

    def trace(policy: Any) -> Any:
        fn = make(policy)
        pure = purify(fn, args, param_names(fn, len(args)))
        return jax.make_jaxpr(pure.fn)(*pure.args).jaxpr

    def segments(policy: Any) -> list[Any]:
        return remat_segments(trace(policy))

    jaxpr = trace(probe)
    probed = remat_segments(jaxpr)
    taking = [eqn for eqn in probed if holds(remat_policy(eqn), probe)]
    reached = len(taking)
    after = sum(bool(eqn.params.get("differentiated", False)) for eqn in taking)
    if not probed and remat_implementation() == "remat3":
        # a differentiated trace (a step) under jax 0.10.2's jax_remat3 holds no segment
        # (0.12's keeps them, counted above): judged by whether
        # two policies that keep different values trace to different steps
        cp = jax.checkpoint_policies
        every, none = (
            _trace_text(make, args, p) for p in (cp.everything_saveable, cp.nothing_saveable)
        )
        return PolicyReach(name, 0, 0, 0, part, linearized=every != none)
    around = sum(wraps_whole_loop(eqn) for eqn in probed)
    lone = len(probed) == 1 and not around and not remat_in_loop(jaxpr)
    return PolicyReach(
        name, len(probed), reached, len(segments(None)), part, around_loop=around, lone=lone,
        differentiated=after,
    )  # fmt: skip


def _trace_text(make: Factory, args: Sequence[Any], policy: Any) -> str:
    """The jaxpr of ``make(policy)`` on ``args``, as text (two traces compared)."""
    fn = make(policy)
    pure = purify(fn, args, param_names(fn, len(args)))
    return str(jax.make_jaxpr(pure.fn)(*pure.args))
