"""What a program's builder knows of it, and the programs a search may build around it.

A :class:`~remat_kit.program.Program` is its factories and its arguments. A builder that
knows more of its model (the zoo's :func:`~remat_kit.zoo.preset`, :mod:`remat_kit.maxtext`)
says so in two plain values beside them, and the tools read those instead of asking which
kind of program they hold:

- :class:`Known`: its shapes, optimizer and mesh, the policy it is configured with, a cache
  key, and rules that answer what a trace would, faster or per device (one remat segment's
  residuals, the step without remat); a user's program has the empty ``Known()``.
- :class:`Family`: ``build(**changes) -> Program``, the same model at another batch, sequence
  length or :class:`Structure`: what recommend's searches vary; None where the program
  cannot vary (a user's program carries its own shapes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat_kit.placement import BufferNames, Placement
    from remat_kit.policies import PolicySpec
    from remat_kit.pure import Pure
    from remat_kit.reach import PolicyReach
    from remat_kit.targets import MeshSpec, Target
    from remat_kit.walker import Residual, TagResiduals


@dataclasses.dataclass(frozen=True)
class Known:
    """What a program's builder knows of it; every field None (the default) where it does not.

    Attributes:
      title: the program as a report names it (default: its name).
      batch_size: sequences per step (global); seq_len: tokens per sequence.
      optimizer: the optimizer's name; mesh: the (dp, fsdp, tp) mesh it is compiled on.
      logits: ``((batch, seq, vocab), compute dtype)`` of the logits.
      scan_layers: whether the layers run under a scan (None: advice speaks of the user's code).
      default_policy: the policy the program is configured with (None: the factory takes
        whichever is asked).
      cache_key: what decides its reports without tracing (the report cache's key; None: the
        program is traced and its compiles cached by their lowered text).
      takes_spec: its factories receive the :class:`~remat_kit.policies.PolicySpec` itself
        (they apply it per layer group, offload and nesting included), not a
        ``jax.checkpoint`` policy.
      reach: how its factories pass the policy on, known by construction (None: traced).
      baseline: ``program -> Pure``: the step without remat, where it is not the factory's
        ``no-remat`` step (e.g. without nested remat or a chunked loss).
      saved: ``(program, spec) -> [Residual]``: the values kept for the backward pass (one
        remat segment of a model that repeats it; per chip where the batch is sharded).
      residuals: ``(program, spec, placement) -> (TagResiduals, ...)``: :attr:`saved` by tag,
        per device on the placement's mesh.
      buffer_names: ``(program, rows, placement) -> BufferNames``: what names the buffers live
        at the peak, where the residual rows are stacked or the parameters sharded.
      model: the builder's own description of its model (the zoo's config), read only by the
        builder's own analyses (:mod:`remat_kit.zoo.textbook`, :mod:`remat_kit.zoo.facts`);
        the tools never read it.
    """

    title: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    optimizer: str | None = None
    mesh: MeshSpec | None = None
    logits: tuple[tuple[int, int, int], str] | None = None
    scan_layers: bool | None = None
    default_policy: PolicySpec | str | None = None
    cache_key: tuple[Any, ...] | None = None
    takes_spec: bool = False
    reach: PolicyReach | None = None
    baseline: Callable[[Any], Pure] | None = None
    saved: Callable[[Any, PolicySpec], list[Residual]] | None = None
    residuals: Callable[[Any, PolicySpec, Placement], tuple[TagResiduals, ...]] | None = None
    buffer_names: Callable[[Any, Sequence[TagResiduals], Placement], BufferNames] | None = None
    model: Any = None


@dataclasses.dataclass(frozen=True)
class Structure:
    """The layer structure of a family's program: what recommend's structure searches read and
    change (a change is ``(field, value)`` pairs of these names, plus ``nested_remat``).

    Attributes:
      num_layers: blocks in the stack (group sizes divide it).
      remat_group_size: blocks per remat segment.
      scan_layers: the blocks run under one scan.
      attention: the attention kernel (``"xla"``, ``"cudnn"``); None where not chosen.
      loss_chunk_size: tokens per chunk of a chunked loss (None: the whole logits).
      remat_layers: blocks under the policy (None: all).
      nested_groups: nested remat's outer segments (None: not nested).
      name: the name ``get_config(name, ...)`` rebuilds it from (None: a config of one's own).
    """

    num_layers: int
    remat_group_size: int = 1
    scan_layers: bool = True
    attention: str | None = None
    loss_chunk_size: int | None = None
    remat_layers: int | None = None
    nested_groups: int | None = None
    name: str | None = None

    @property
    def layer_structure(self) -> bool:
        """Partial-layer or nested remat is on."""
        return self.remat_layers is not None or self.nested_groups is not None

    def changed(self, changes: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> Structure:
        """The structure after ``changes`` (``nested_remat=False`` drops the nesting).

        Raises:
          ValueError: a change that names no field of a structure.
        """
        items = dict(changes)
        nested = items.pop("nested_remat", None)
        fields = {f.name for f in dataclasses.fields(self)} - {"num_layers", "name"}
        unknown = sorted(set(items) - fields)
        if unknown:
            raise ValueError(f"unknown structure field(s) {unknown}; valid: {sorted(fields)}")
        out = dataclasses.replace(self, **items)
        return dataclasses.replace(out, nested_groups=None) if nested is False else out


@dataclasses.dataclass(frozen=True)
class Family:
    """The programs a search may build around one (recommend's batch, group-size, sequence and
    structure searches).

    Attributes:
      build: ``build(**changes) -> Program`` for changes among :attr:`accepts`; raises
        ``ValueError`` for a value the model refuses (the search notes it and goes on).
      structure: the program's own structure.
      accepts: the changes ``build`` takes: ``batch_size``, ``seq_len`` and :class:`Structure`
        fields (``remat_group_size``, ``attention``, ``loss_chunk_size``, ``remat_layers``,
        ``nested_remat`` / ``nested_groups``); a search that needs another is not run.
      attention_options: ``target -> attention kernels worth compiling there``.
      nested_groups: the outer segment count nested remat would use (None: not offered).
    """

    build: Callable[..., Any]
    structure: Structure
    accepts: frozenset[str] = frozenset({"batch_size", "seq_len"})
    attention_options: Callable[[Target], tuple[str, ...]] = lambda target: ()
    nested_groups: int | None = None

    def takes(self, *changes: str) -> bool:
        """Whether :attr:`build` takes every one of ``changes``."""
        return set(changes) <= self.accepts
