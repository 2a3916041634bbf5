"""Layer-level remat structure: partial-layer remat and nested (two-level) remat over a layer scan.

Two ways to spend less recompute, or less memory, than one policy on every layer:

* **Partial-layer remat** (Megatron-LM's ``--recompute-method block --recompute-num-layers k``):
  ``remat_layers`` of the ``num_layers`` blocks run under the policy, the others under a second
  policy (default: not rematerialised). ``placement="first"`` puts them first (two layer scans);
  ``"interleaved"`` spreads them evenly, every ``num_layers // remat_layers``-th block (one scan
  over groups of that many blocks, each position with its static choice).
* **Nested remat** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
  arXiv:1604.06174, section 4; Levanter's nested scan): an outer scan over ``groups`` segments,
  each checkpointed whole (only its input is kept: the outer carry), an inner scan over the
  segment's ``num_layers // groups`` blocks under the per-layer policy. The backward pass
  recomputes one segment at a time, so stored layer inputs are ``groups + num_layers // groups``
  instead of ``num_layers``: least at ``groups = sqrt(num_layers)`` (:func:`sqrt_groups`), for one
  more forward pass of every block.

:class:`RematLayerStack` is a flax.linen module any linen model can use for its layer stack: it
takes a factory ``block(name) -> nn.Module`` whose module maps ``x [batch, seq, d_model]`` (plus
broadcast arguments) to the same shape. Parameters are stacked along a leading axis named
``layers`` (``nn.with_logical_partitioning`` metadata), one stack per scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import flax.linen as nn
import jax

from remat_kit.policies import PolicySpec, get_policy_spec
from remat_kit.validation import positive_int, unknown_value_error

Placement = Literal["first", "interleaved"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
#: One scan of the stack: the per-position remat choice of one scan step, and the trip count.
Run = tuple[tuple[bool, ...], int]


def layer_plan(
    num_layers: int, remat_layers: int | None = None, placement: str = "first"
) -> tuple[Run, ...]:
    """The layer scans that put ``remat_layers`` of ``num_layers`` blocks under the policy.

    Returns:
      ``((pattern, repeats), ...)``: one scan per run, each step applying ``len(pattern)``
      blocks, ``pattern[i]`` True where block ``i`` of the step is rematerialised. ``None`` (all
      layers) gives ``(((True,), num_layers),)``; ``placement="first"`` with ``0 < k < L`` gives
      ``(((True,), k), ((False,), L - k))``; ``"interleaved"`` gives one run whose pattern of
      ``L // k`` blocks rematerialises its first.

    Raises:
      ValueError: a non-positive ``num_layers``; ``remat_layers`` outside ``0..num_layers``; an
        unknown placement; ``"interleaved"`` with ``remat_layers`` not dividing ``num_layers``.
    """
    positive_int("num_layers", num_layers)
    if placement not in PLACEMENTS:
        raise unknown_value_error("remat placement", placement, PLACEMENTS)
    k = num_layers if remat_layers is None else remat_layers
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= num_layers:
        raise ValueError(f"remat_layers must be an integer in 0..{num_layers}, got {k!r}")
    if k in (0, num_layers):
        return (((k > 0,), num_layers),)
    if placement == "first":
        return (((True,), k), ((False,), num_layers - k))
    if num_layers % k:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"interleaved remat_layers={k} does not divide num_layers={num_layers}; valid: {valid}"
        )
    period = num_layers // k
    return (((True,) + (False,) * (period - 1), k),)


def sqrt_groups(num_layers: int) -> int:
    """The divisor of ``num_layers`` nearest ``sqrt(num_layers)`` (the smaller on a tie): the
    outer group count that minimises ``groups + num_layers / groups`` stored layer inputs
    (Chen et al. 2016). ``sqrt_groups(32) == 4``, ``sqrt_groups(36) == 6``.

    Raises:
      ValueError: ``num_layers`` is not a positive integer.
    """
    positive_int("num_layers", num_layers)
    root = math.sqrt(num_layers)
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    return min(divisors, key=lambda d: (abs(d - root), d))


def check_nested_groups(num_layers: int, groups: int) -> int:
    """``groups`` if it divides ``num_layers``.

    Raises:
      ValueError: ``groups`` not a positive divisor of ``num_layers`` (listing the valid ones).
    """
    positive_int("nested_groups", groups)
    if num_layers % groups:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"nested_groups={groups} does not divide num_layers={num_layers}; valid: {valid}"
        )
    return groups


def stored_layer_inputs(num_layers: int, groups: int | None = None) -> int:
    """Layer inputs live at the start of the backward pass's worst segment: ``num_layers`` for
    per-layer remat; ``groups + num_layers // groups`` nested (outer carries plus one segment's
    inner carries while it is recomputed). The textbook count that the measured bytes follow."""
    if groups is None:
        return num_layers
    return groups + num_layers // check_nested_groups(num_layers, groups)


def resolve_block_policy(policy: Any) -> PolicySpec | Callable[..., bool] | None:
    """A block's policy as the stack applies it: None for no remat (``"no-remat"``, or None as
    a :class:`~remat_kit.program.Program` factory receives for no-remat), a jax policy callable
    as given (``jax.checkpoint_policies.*``, :func:`remat_kit.custom_policy`: what a factory
    receives otherwise), else the :class:`PolicySpec` of a name, spec or per-tag mapping.

    Raises:
      ValueError: an unknown policy name or a bad mapping (:func:`get_policy_spec`).
    """
    if policy is None:
        return None
    if callable(policy) and not isinstance(policy, (str, PolicySpec)):
        return policy
    spec = get_policy_spec(policy)
    return spec if spec.wrap else None


def _apply(module: nn.Module, x: jax.Array, *args: Any) -> jax.Array:
    return module(x, *args)


class _Step(nn.Module):
    """One scan step: ``len(specs)`` blocks, block ``i`` under ``specs[i]`` (None: no remat; see
    :func:`resolve_block_policy`)."""

    block: Callable[[str], nn.Module]
    specs: tuple[PolicySpec | Callable[..., bool] | None, ...]

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any):
        for i, spec in enumerate(self.specs):
            module = self.block(f"block_{i}")
            if spec is None:
                x = module(x, *args)
            else:
                policy = spec.to_jax() if isinstance(spec, PolicySpec) else spec
                # Under a scan, prevent_cse=False: CSE cannot merge the recompute across loop
                # iterations, and the barriers only cost speed (flax.linen.remat docstring).
                x = nn.remat(_apply, policy=policy, prevent_cse=False)(module, x, *args)
        return x, None


def _scan(body: Any, length: int, axis_name: str) -> Any:
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=nn.broadcast,
        length=length,
        metadata_params={nn.PARTITION_NAME: axis_name},
    )


class _Segment(nn.Module):
    """Nested remat's outer step: the inner runs (a segment of blocks), returned as a carry."""

    block: Callable[[str], nn.Module]
    runs: tuple[tuple[tuple[PolicySpec | None, ...], int], ...]
    axis_name: str

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any):
        for j, (specs, repeats) in enumerate(self.runs):
            name = "inner" if len(self.runs) == 1 else f"inner_{j}"
            scan = _scan(_Step, repeats, self.axis_name)
            x, _ = scan(self.block, specs, name=name)(x, *args)
        return x, None


class RematLayerStack(nn.Module):
    """``num_layers`` blocks in layer scans with partial-layer or nested remat.

    ``block(name)`` must return a fresh linen module mapping ``x [batch, seq, d_model]`` and the
    broadcast ``*args`` (e.g. positions [seq]) to ``[batch, seq, d_model]``; for example
    ``lambda name: MyBlock(features=64, name=name)``.

    Attributes:
      block: the block factory.
      num_layers: blocks in the stack (L).
      policy: remat policy of the rematerialised blocks: a name, :class:`PolicySpec`, per-tag
        mapping, or what a :class:`~remat_kit.program.Program` factory receives (a jax policy
        callable, None for no remat); see :func:`resolve_block_policy`.
      remat_layers: how many blocks use ``policy`` (None: all); the rest use ``rest_policy``.
      placement: ``"first"`` or ``"interleaved"`` (see :func:`layer_plan`).
      rest_policy: policy of the other blocks (default ``"no-remat"``).
      nested_groups: if set, nested remat with this many outer segments (a divisor of L; see
        :func:`sqrt_groups`), each checkpointed whole (nothing saved but its input), the blocks
        inside under ``policy`` / ``rest_policy`` as ``remat_layers`` says (counted per segment:
        ``remat_layers`` must then be given per segment, i.e. at most ``L // nested_groups``).
      axis_name: logical axis name of the stacked parameters' leading dimension (nested: the
        outer one is ``axis_name + "_outer"``).

    Parameters: ``layers/block_0/...`` with leading dimension L for one run (the plain per-layer
    scan); ``layers_0``, ``layers_1``, ... for several runs; nested: ``layers/inner/...`` with
    leading dimensions ``[groups, L // groups]``.

    Raises (when called):
      ValueError: see :func:`layer_plan` and :func:`check_nested_groups`; unknown policy names.
    """

    block: Callable[[str], nn.Module]
    num_layers: int
    policy: Any = "save-nothing"
    remat_layers: int | None = None
    placement: str = "first"
    rest_policy: Any = "no-remat"
    nested_groups: int | None = None
    axis_name: str = "layers"

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        spec, rest = resolve_block_policy(self.policy), resolve_block_policy(self.rest_policy)
        per_scan = self.num_layers
        if self.nested_groups is not None:
            per_scan //= check_nested_groups(self.num_layers, self.nested_groups)
        runs = tuple(
            (tuple(spec if r else rest for r in pattern), repeats)
            for pattern, repeats in layer_plan(per_scan, self.remat_layers, self.placement)
        )
        if self.nested_groups is not None:
            outer = nn.remat(
                _Segment, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
            )
            # Flax's logical-to-mesh mapping rejects a name used twice: the outer axis gets its
            # own (absent from the rules, so not split).
            scan = _scan(outer, self.nested_groups, f"{self.axis_name}_outer")
            x, _ = scan(self.block, runs, self.axis_name, name="layers")(x, *args)
            return x
        for j, (specs, repeats) in enumerate(runs):
            name = "layers" if len(runs) == 1 else f"layers_{j}"
            x, _ = _scan(_Step, repeats, self.axis_name)(self.block, specs, name=name)(x, *args)
        return x
