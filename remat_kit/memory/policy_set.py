"""The policies a tool compiles on a program: one set, resolved in one place.

:func:`policy_set` is what analyze, the doctor, recommend and the sweep call to turn the
policies a user asked for (or none: the default set about the program's own
``checkpoint_name`` tags) into the specs to compile, each row's label and the notes on what
was cut down, skipped or added (:class:`PolicySet`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax

from remat_kit import targets as T
from remat_kit.policies import (
    PolicySpec,
    can_offload,
    check_tags,
    custom_spec,
    cut_label,
    get_policy_spec,
    is_by_exclusion,
    policies_for_tags,
    policy_label,
    policy_names,
    policy_specs,
)
from remat_kit.program import Program
from remat_kit.trace import program_tags
from remat_kit.walker import (
    TagResiduals,
    bytes_by_tag,
    group_by_tag,
    saved_residuals,
    tags_in,
    tags_in_remat,
)

#: At most this many single-tag specs (``{tag: "save"}``) in a program's default policy set.
MAX_TAG_SPECS = 8


@dataclasses.dataclass(frozen=True)
class PolicySet:
    """The policies to compile on a program (:func:`policy_set`).

    Attributes:
      specs: the specs, in order.
      tags: the ``checkpoint_name`` tags the program emits.
      notes: one line each on what was cut down, skipped, left out or added.
      restricted: ``(registered spec, the spec it was cut down to)`` for the registered
        policies cut down to the emitted tags.
      saveable: the emitted tags the loss keeps when saved (the own-name specs' tags; default
        set only).
    """

    specs: tuple[PolicySpec, ...]
    tags: frozenset[str]
    notes: tuple[str, ...] = ()
    restricted: tuple[tuple[PolicySpec, PolicySpec], ...] = ()
    saveable: frozenset[str] = frozenset()

    def labels(self) -> list[str]:
        """Row names, one per spec: a registered policy cut down to the program's tags is
        ``minimal (cut)`` (several cut to one spec: ``a, b (cut)``; a note says to what); in
        the default set, a spec doing one thing with every emitted tag (3 or more) is
        ``custom: every name=save`` (``every saveable name`` when some emitted tags cannot be
        kept); others as :func:`~remat_kit.policies.policy_label`."""
        cut: dict[PolicySpec, list[str]] = {}
        for named, c in self.restricted:
            cut.setdefault(c, []).append(named.name)
        labels = []
        for spec in self.specs:
            actions = {spec.action(t) for t in spec.tags}
            if spec in cut:
                labels.append(cut_label(cut[spec]))
            elif (self.saveable and spec.name == "custom" and len(spec.tags) > 2
                  and len(actions) == 1 and spec.tags in (self.tags, self.saveable)):  # fmt: skip
                which = "name" if spec.tags == self.tags else "saveable name"
                labels.append(f"custom: every {which}={actions.pop()}")
            else:
                labels.append(policy_label(spec))
        return labels

    def cut_notes(self) -> dict[PolicySpec, list[str]]:
        """The note on each cut-down spec (what its registered policy named that the program
        does not emit), by the spec it was cut to."""
        out: dict[PolicySpec, list[str]] = {}
        for (_, cut), note in zip(self.restricted, self.notes, strict=False):
            out.setdefault(cut, []).append(note)  # the first notes are the cuts', in order
        return out


def own_tag_specs(
    tags: frozenset[str],
    target: T.Target,
    max_single: int = MAX_TAG_SPECS,
    kept_bytes: Mapping[str, int] | None = None,
) -> tuple[list[PolicySpec], list[str]]:
    """Specs in a program's own tag names: each tag saved alone (the first ``max_single``: by
    the bytes the loss keeps for each when every tag is saved, ``kept_bytes``, largest first,
    as the choice that trades most memory; by name without them), every tag saved, and, where
    ``target`` offloads (:func:`remat_kit.policies.can_offload`), every tag offloaded; with a
    note when the single-tag specs were capped or no offloading spec is made."""
    weight = kept_bytes or {}
    ranked = sorted(tags, key=lambda t: (-weight.get(t, 0), t))
    specs = [custom_spec({t: "save"}) for t in sorted(ranked[:max_single])]  # listed by name
    notes = []
    if len(ranked) > max_single:
        which = "with the largest residuals" if kept_bytes else "first by name"
        notes.append(
            f"{len(ranked)} checkpoint names emitted: one save-alone policy each for the "
            f"{max_single} {which} only (ask for NAME=save for "
            f"{', '.join(sorted(ranked[max_single:]))})"
        )
    names = sorted(tags)
    if len(names) > 1:
        specs.append(custom_spec(dict.fromkeys(names, "save")))
    if can_offload(target) and names:
        specs.append(custom_spec(dict.fromkeys(names, "offload")))
    elif names:
        why = (
            f"{target.name} does not offload to host memory"
            if not target.supports_host_offload
            else "the remat implementation in use does not offload"
        )
        notes.append(f"no offloading policy: {why}")
    return specs, notes


def given_specs(
    program: Program, policies: Sequence[str | PolicySpec | Mapping[str, str] | Callable]
) -> list[PolicySpec]:
    """The specs of ``policies`` as given for ``program``
    (:func:`remat_kit.policies.get_policy_spec`); ``save_any_names_but_these`` reads the
    program's ``checkpoint_name`` values (traced here only for it).

    Raises:
      ValueError: an unknown policy or one that cannot be read as data.
    """
    tags = program_tags(program) if any(is_by_exclusion(p) for p in policies) else None
    return [get_policy_spec(p, tags) for p in policies]


def policy_set(
    program: Program,
    target: str | T.Target,
    policies: Sequence[str | PolicySpec | Mapping[str, str] | Callable] | None = None,
    *,
    fit: bool = False,
    tags: frozenset[str] | None = None,
    max_single: int = MAX_TAG_SPECS,
) -> PolicySet:
    """The policies a tool compiles on ``program`` for ``target``, with their labels and notes.

    ``policies`` None: the default set about the program's own tags: the registered policies that
    can act on them (:func:`remat_kit.policies.policies_for_tags`), less the offloading ones where
    the target does not offload, plus specs in the program's own tag names (:func:`own_tag_specs`,
    at most ``max_single`` single-tag ones; with a loss, only tags it keeps when saved).
    ``policies`` given: as named (``fit=False``: analyze, the doctor) or fitted to the program as
    the default set is (``fit=True``: recommend, the sweep). ``tags``: the program's
    :func:`program_tags` where the caller has them (else traced here).

    Raises:
      ValueError: an unknown policy or target; with ``fit``: an empty ``policies``, a user's
        spec naming a tag the program does not emit, or nothing left to compile.
    """
    tags = program_tags(program) if tags is None else tags
    tgt = T.get_target(target)
    if policies is None:
        chosen = _default_set(program, tgt, tags, max_single)
    elif not fit:
        return PolicySet(tuple(get_policy_spec(p, tags) for p in policies), tags)
    else:
        chosen = _fitted(program, tgt, list(policies), tags)
    if fit and not chosen.specs:
        raise ValueError(f"no policy acts on program {program.name!r}")
    return chosen


def _fitted(program: Program, tgt: T.Target, given: list, tags: frozenset[str]) -> PolicySet:
    """``given`` fitted to a program emitting ``tags`` (:func:`policy_set` with ``fit``)."""
    if not given:
        raise ValueError("policies is empty: give at least one policy name")
    fit = policies_for_tags(given, tags)  # raises on an unknown name
    registered, cuts = policy_specs(), [cut for _, cut in fit.restricted]
    for spec in fit.specs:  # a user's own spec: every name it gives must be emitted
        if registered.get(spec.name) != spec and spec not in cuts:
            check_tags(spec, tags, f"program {program.name!r}")
    if not fit.specs:
        emits = ", ".join(sorted(tags)) or "no checkpoint_name tags"
        raise ValueError(f"no policy given acts on program {program.name!r} (emits: {emits})")
    specs = [s for s in fit.specs if tgt.supports_host_offload or not s.offloads]
    notes = fit.notes(f"program {program.name!r}", compiled=specs)
    if not specs:
        raise ValueError(f"every policy given offloads, and {tgt.name!r} does not offload")
    dropped = [s.name for s in fit.specs if s not in specs]
    if dropped:
        notes.append(f"offloading policies skipped on {tgt.name}: {', '.join(dropped)}")
    return PolicySet(tuple(specs), tags, tuple(notes), fit.restricted)


def _default_set(
    program: Program, tgt: T.Target, tags: frozenset[str], max_single: int
) -> PolicySet:
    """The default set of :func:`policy_set`."""
    fit = policies_for_tags(policy_names(), tags)
    kept = _residual_bytes(program, tags)
    own_tags = tags if kept is None else tags & frozenset(kept)
    # per-tag offload specs only where they can offload (target and remat implementation)
    own, own_notes = own_tag_specs(own_tags, tgt, max_single, kept)
    own_notes += _unsaveable_notes(program, tags - own_tags)
    specs = [
        s for s in dict.fromkeys([*fit.specs, *own]) if tgt.supports_host_offload or not s.offloads
    ]
    notes = fit.notes(f"program {program.name!r}", compiled=specs)
    cut = {c: cut_label([named.name]) for named, c in fit.restricted}
    no_host = [cut.get(s, policy_label(s)) for s in fit.specs if s.offloads and s not in specs]
    if no_host:
        notes.append(f"not compiled: {'; '.join(no_host)} (offload; {tgt.name} does not offload)")
    if not tags:
        notes.append(
            f"{program.name!r} emits no checkpoint_name tags: only the policies selecting by "
            "kind act on it; tag tensors with jax.ad_checkpoint.checkpoint_name for per-tag ones"
        )
    return PolicySet(
        tuple(specs), tags, tuple(notes + own_notes), fit.restricted, frozenset(own_tags)
    )


def _unsaveable_notes(program: Program, tags: frozenset[str]) -> list[str]:
    """Why no own-name policy saves ``tags`` (tags the loss does not keep when saved): applied
    outside every remat segment, or not used by the backward pass."""
    if not tags:
        return []
    loss = program.loss(get_policy_spec("save-nothing"))
    jaxpr = jax.make_jaxpr(loss.fn)(*loss.args).jaxpr
    inside, in_rule = tags_in_remat(jaxpr), tags - tags_in(jaxpr)
    out = []
    if tags - inside - in_rule:
        out.append(
            f"no own-name policy for {', '.join(sorted(tags - inside - in_rule))}: applied "
            "outside every remat segment (jax.checkpoint / nn.remat / nnx.remat), so it is "
            "stored or not regardless of the policy"
        )
    if in_rule:
        out.append(
            f"no own-name policy for {', '.join(sorted(in_rule))}: applied only inside a "
            "custom_vjp forward rule, whose checkpoint_name JAX's remat does not see under "
            "jax_remat3 without jax_custom_vjp3"
        )
    if tags & inside:
        out.append(
            f"no own-name policy for {', '.join(sorted(tags & inside))}: saving it keeps "
            "nothing more (its remat segment's backward pass does not use the value: e.g. a "
            "sum, or the segment's output, which the next segment keeps as its input whatever "
            "the policy)"
        )
    return out


def _residual_bytes(program: Program, tags: frozenset[str]) -> dict[str, int] | None:
    """``{tag: bytes}`` the loss keeps when a policy saves every tag, for the tags it keeps
    (those the backward pass can use); None without a loss."""
    rows = _program_residuals(program, custom_spec(dict.fromkeys(tags, "save")))
    if rows is None:
        return None
    return {t: n for t, n in bytes_by_tag(rows, memory=None).items() if n and t in tags}


def _program_residuals(program: Program, spec: PolicySpec) -> tuple[TagResiduals, ...] | None:
    """Residuals the whole loss keeps under ``spec`` by tag (parameters excluded); None without
    a loss."""
    loss = program.loss(spec)
    if loss is None:
        return None
    return tuple(group_by_tag(saved_residuals(loss.fn, *loss.args)))
