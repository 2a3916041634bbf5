"""A user's training program as remat-kit reads it: a step (or loss) factory and its arguments.

:meth:`Program.from_loss` takes ``make_loss(policy) -> loss(*args)`` and builds the step
(``value_and_grad`` plus optax); :meth:`Program.from_step` takes ``make_step(policy) ->
step(*args)``. The factory gets a ``jax.checkpoint`` policy, or ``None`` for ``no-remat``;
arguments are arrays, ``ShapeDtypeStruct`` pytrees, NNX objects or equinox modules
(:mod:`remat_kit.pure`). Presets are Programs too: docs/own-model.md, docs/architecture.md.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> def make_loss(policy):
    ...     def layer(x, w):
    ...         return jnp.tanh(checkpoint_name(x @ w, "hidden"))
    ...     body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    ...     return lambda w, x: body(x, w).sum()
    >>> prog = Program.from_loss(make_loss, jnp.ones((4, 4)), jnp.ones((2, 4)), name="toy")
    >>> prog.name, prog.argument_names
    ('toy', ('opt_state', 'w', 'x'))
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optax

from remat_kit import targets as T
from remat_kit.family import Family, Known
from remat_kit.loss_step import (
    argnums_of,
    check_loss,
    check_params,
    initial_opt_state,
    loss_step_of,
)
from remat_kit.optimizers import make_optimizer
from remat_kit.placement import Layout, Placement
from remat_kit.policies import PolicySpec, get_policy_spec, remat_implementation
from remat_kit.pure import (
    Factory,
    LossTrace,
    Pure,
    is_nnx,
    jax_policy,
    param_names,
    purify,
    summary,
)
from remat_kit.reach import PolicyReach, policy_reach
from remat_kit.walker import (
    traced_flops,
)

#: Per-program memo (loss traces, policy reach), keyed by program identity, dropped with it.
_MEMO: dict[int, dict[Any, Any]] = {}


def memo(program: Any, key: Any, make: Callable[[], Any]) -> Any:
    """``make()`` once per ``program`` (by identity) and ``key``; later calls read it."""
    held = _MEMO.get(id(program))
    if held is None:
        held = _MEMO[id(program)] = {}
        weakref.finalize(program, _MEMO.pop, id(program), None)
    if key not in held:
        held[key] = make()
    return held[key]


@dataclasses.dataclass(frozen=True)
class Program:
    """A training program: what remat-kit compiles and walks for each policy.

    Attributes:
      name: shown in reports.
      make_step: ``policy -> step``; ``step(*args)`` is one training step.
      args: the step's arguments (arrays, ``ShapeDtypeStruct`` pytrees, NNX objects).
      donate_argnums: step arguments donated to its outputs (updated in place).
      make_loss: ``policy -> loss``, for residuals by tag and the doctor (None: not given).
      argnums: which loss arguments are differentiated (integer arrays never are).
      argument_names: names of the step's arguments (from its signature).
    """

    name: str
    make_step: Factory
    args: tuple[Any, ...]
    donate_argnums: tuple[int, ...] = ()
    make_loss: Factory | None = None
    loss_args: tuple[Any, ...] = ()
    argnums: tuple[int, ...] = (0,)
    argument_names: tuple[str, ...] = ()
    #: The arguments' layout over a target's devices (:func:`sharded`); None: one device.
    layout: Layout | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``loss -> step`` of a :meth:`from_loss` program; None for a user's own step.
    step_of_loss: Callable[[Callable[..., Any]], Callable[..., Any]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )
    #: What the program's builder knows of it (shapes, policy, rules); empty for a user's.
    known: Known = dataclasses.field(default=Known(), repr=False, compare=False)
    #: The programs a search may build around it; None: it cannot vary.
    family: Family | None = dataclasses.field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        """Name, each argument summarised (``int32[2, 33]``, or count, dtypes and bytes),
        donated arguments, whether a loss is given."""
        names = self.argument_names or tuple(f"arg{i}" for i in range(len(self.args)))
        args = ", ".join(f"{n}: {summary(a)}" for n, a in zip(names, self.args, strict=False))
        loss = "yes" if self.make_loss is not None else "no"
        return (
            f"Program({self.name!r}, args=({args}), donate_argnums={self.donate_argnums}, "
            f"loss={loss})"
        )

    @classmethod
    def from_loss(
        cls,
        make_loss: Factory,
        *args: Any,
        optimizer: str | optax.GradientTransformation = "adamw",
        argnums: int | Sequence[int] = 0,
        name: str | None = None,
    ) -> Program:
        """A program whose step is ``value_and_grad(loss, argnums)`` plus an optax update:
        ``step(opt_state, *args) -> (opt_state, (updated parameters...), loss)``.

        Args:
          make_loss: ``policy -> loss(*args) -> scalar``.
          *args: the loss's arguments; those in ``argnums`` are the parameters (float pytrees,
            an ``equinox.Module``, or an ``nnx.Module`` updated in place by its ``nnx.Param``).
          optimizer: a :func:`remat_kit.training.make_optimizer` name (``"adamw"``, ``"sgd"``,
            ``"adafactor"``) or an optax transformation; its state is donated with the parameters.
          name: for reports (default: the factory's name).

        Raises:
          ValueError: ``argnums`` out of range or naming an argument with no float arrays, or
            an NNX object with an integer ``nnx.Param``; an argument JAX cannot see into (a
            linen Module); a loss that does not return a float scalar; unknown optimizer.
        """
        nums = argnums_of(argnums, args)
        names = ("opt_state", *param_names(make_loss(None), len(args)))
        check_params(args, nums, names[1:])
        check_loss(make_loss, args, names[1:])
        tx = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
        opt_state = initial_opt_state(tx, args, nums)
        step_of_loss = functools.partial(loss_step_of, tx=tx, nums=nums, names=names)

        def make_step(policy):
            return step_of_loss(make_loss(policy))

        return cls(
            name=name or getattr(make_loss, "__name__", "program"),
            make_step=make_step,
            step_of_loss=step_of_loss,
            args=(opt_state, *args),
            donate_argnums=(0, *(1 + i for i in nums)),
            make_loss=make_loss,
            loss_args=tuple(args),
            argnums=nums,
            argument_names=names,
        )

    @classmethod
    def from_step(
        cls,
        make_step: Factory,
        *args: Any,
        donate_argnums: int | Sequence[int] = (),
        make_loss: Factory | None = None,
        loss_args: Sequence[Any] = (),
        argnums: int | Sequence[int] = 0,
        name: str | None = None,
    ) -> Program:
        """A program from the user's own step factory (see the module docstring).

        Raises:
          ValueError: ``donate_argnums`` or ``argnums`` out of range; with ``make_loss``, as
            :meth:`from_loss`.
        """
        donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        for i in donate:
            if not 0 <= i < len(args):
                raise ValueError(
                    f"donate_argnums {i} out of range for a step of {len(args)} arguments"
                )
        nums = argnums_of(argnums, loss_args) if make_loss is not None else (0,)
        if make_loss is not None:
            loss_names = param_names(make_loss(None), len(loss_args))
            check_params(tuple(loss_args), nums, loss_names)
            check_loss(make_loss, tuple(loss_args), loss_names)
        return cls(
            name=name or getattr(make_step, "__name__", "program"),
            make_step=make_step,
            args=tuple(args),
            donate_argnums=donate,
            make_loss=make_loss,
            loss_args=tuple(loss_args),
            argnums=nums,
            argument_names=tuple(param_names(make_step(None), len(args))),
        )

    @property
    def title(self) -> str:
        """The program as a report's name shows it."""
        return self.known.title or self.name

    def factory_input(self, spec: PolicySpec) -> Any:
        """Its ``jax.checkpoint`` policy (None for ``no-remat``), or ``spec`` itself where
        :attr:`Known.takes_spec`."""
        return spec if self.known.takes_spec else jax_policy(spec)

    def step(self, spec: PolicySpec) -> Pure:
        """The step under ``spec`` as a function of arrays (NNX objects split and merged).

        A :meth:`from_loss` step differentiates the :meth:`loss_trace`, so what is compiled is
        what the residual table and the doctor walk."""
        if self.step_of_loss is not None:
            fn = self.step_of_loss(self.loss_trace(spec).call)
        else:
            fn = self.make_step(self.factory_input(spec))
        return purify(fn, self.args, self.argument_names)

    def loss(self, spec: PolicySpec) -> Pure | None:
        """The loss under ``spec`` as a function of arrays (its :meth:`loss_trace`); None
        without ``make_loss``."""
        if self.make_loss is None:
            return None
        return self.loss_trace(spec).pure

    def loss_trace(self, spec: PolicySpec) -> LossTrace:
        """The loss traced once per program and spec; every tool reads this jaxpr.

        Raises:
          ValueError: the program has no ``make_loss``.
        """
        if self.make_loss is None:
            raise ValueError(f"program {self.name!r} has no loss (make_loss)")

        def trace() -> LossTrace:
            loss = self.make_loss(self.factory_input(spec))
            names = param_names(loss, len(self.loss_args))
            return LossTrace.of(purify(loss, self.loss_args, names))

        return memo(self, ("loss_trace", spec), trace)

    def baseline_step(self) -> Pure:
        """The step without remat (:attr:`Known.baseline` where set): the recompute ratio's
        denominator."""
        if self.known.baseline is not None:
            return self.known.baseline(self)
        return self.step(get_policy_spec("no-remat"))

    def donated(self, pure: Pure) -> tuple[int, ...]:
        """``donate_argnums`` of the pure step, whose NNX state (donated) comes first."""
        if pure.nnx_index is None:
            return self.donate_argnums
        rest = [i for i, a in enumerate(self.args) if not is_nnx(a)]
        return (pure.nnx_index, *(1 + rest.index(i) for i in self.donate_argnums if i in rest))

    def place(self, target: T.Target) -> Placement:
        """The arguments on ``target``: by :attr:`layout`, else on one device."""
        if self.layout is not None:
            return self.layout(T.get_target(target), self.baseline_step().names)
        sharding = T.abstract_sharding(target)
        return Placement(lambda args: tuple(T.abstractify(a, sharding) for a in args))

    def reach(self) -> PolicyReach:
        """Whether the factories pass the policy on (:func:`policy_reach`), judged once per
        program and remat implementation (:attr:`Known.reach` where known)."""
        if self.known.reach is not None:
            return self.known.reach
        return memo(self, ("reach", remat_implementation()), lambda: policy_reach(self))


def step_flops(program: Program, spec: PolicySpec) -> float:
    """Matmul FLOPs of the whole (global) step under ``spec``, counted on its jaxpr
    (:func:`traced_flops`), nothing compiled; the solver's tag costs and the doctor's
    :func:`remat_kit.doctor.tags.recompute_savers` judge by it."""
    pure = program.step(spec)
    return traced_flops(pure.fn, *pure.args)
