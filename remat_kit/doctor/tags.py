"""The doctor's view of a program's checkpoint names: which it emits, which inside a remat
segment (from :mod:`remat_kit.walker`), and the one ``unknown-tag`` finding per policy.

Advice speaks the program's language: the MLP-family hint (``mlpwi`` vs SwiGLU's
``mlpwi_0`` / ``mlpwi_1``) only where the program emits remat-kit's (MaxText) names, and a fix
for a user's program written in its own names (``'attn_in=offload'``), not remat-kit's
registered policies.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jcore

from remat_kit import names as N
from remat_kit import walker as W
from remat_kit.doctor.findings import Finding
from remat_kit.doctor.promise import Promise
from remat_kit.validation import closest
from remat_kit.walker import tags_in_remat

_MLP_FAMILIES = frozenset({N.MLPWI, N.MLPWI_0, N.MLPWI_1})


@dataclasses.dataclass(frozen=True)
class TagFacts:
    """What the walk of a program shows of its checkpoint names.

    Attributes:
      emitted: every name the program applies (forward and differentiation program).
      in_remat: the names applied inside a remat segment (``jax.checkpoint`` / ``nn.remat`` /
        ``nnx.remat`` body); None when not walked (the bundled models: always inside).
      user: a user's program or function (advice in its own terms), not a bundled model.
      savers: returns the names applied inside a remat segment whose saving alone keeps them
        as residuals (saving them removes recompute), matmul outputs first
        (:func:`recompute_savers`); called only when advice needs it (it traces once per
        name). None: not known.
    """

    emitted: frozenset[str]
    in_remat: frozenset[str] | None = None
    user: bool = False
    savers: Callable[[], tuple[str, ...]] | None = dataclasses.field(default=None, compare=False)
    #: For each name, the names applied to what it is computed from with no matmul between,
    #: and the names computed from a remat segment's inputs with no matmul at all
    #: (:func:`feeds`); None: not walked.
    feeds: Feeds | None = dataclasses.field(default=None, compare=False)
    #: ``flops_keeping(names)``: the step's traced matmul FLOPs (forward and backward) when
    #: ``names`` are kept (saved or offloaded: the FLOPs are the same) and the rest recomputed,
    #: to judge a name within a policy (names that spare a matmul only together: K and V of one
    #: einsum). None: not known.
    flops_keeping: Callable[[frozenset[str]], float] | None = dataclasses.field(
        default=None, compare=False
    )
    #: ``(unbatched, batched, ragged)`` matmuls inside remat segments
    #: (:func:`remat_kit.walker.dots_in_remat`): why a dots policy keeps no matmul output, and
    #: the ragged ones it recomputes. None: not walked.
    remat_dots: tuple[int, int, int] | None = None
    #: The names applied only inside a ``custom_vjp`` forward rule (emitted by the
    #: differentiated program, absent from the primal one): JAX's remat sees them only where it
    #: traces the rule (classic remat, or ``jax_remat3`` with ``jax_custom_vjp3``).
    in_fwd_rule: frozenset[str] = frozenset()

    @property
    def remat_kit_names(self) -> bool:
        """Whether the program emits remat-kit's (MaxText) checkpoint names."""
        return bool(self.emitted & set(N.CHECKPOINT_NAMES))

    def outside_remat(self, tags: Iterable[str]) -> frozenset[str]:
        """Those of ``tags`` the program emits only outside every remat segment."""
        if self.in_remat is None:
            return frozenset()
        return frozenset(tags) & self.emitted - self.in_remat - self.in_fwd_rule


def tag_facts(fn: Callable[..., Any], *args: Any, emitted: Iterable[str] | None = None):
    """:class:`TagFacts` of a user's function with remat inside (``fn(*args)``, arrays or
    ``jax.ShapeDtypeStruct``): ``emitted`` as given (else :func:`remat_kit.walker.emitted_tags`),
    ``in_remat`` from its jaxpr. Traces only."""
    tags = W.emitted_tags(fn, *args) if emitted is None else emitted
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return TagFacts(
        frozenset(tags), tags_in_remat(jaxpr), user=True, feeds=feeds(jaxpr),
        remat_dots=W.dots_in_remat(jaxpr), in_fwd_rule=frozenset(tags) - W.tags_in(jaxpr),
    )  # fmt: skip


#: Primitives looked through from a name back to the matmul it tags: a bias add, a layout
#: change, a cast (linen's ``DenseGeneral`` adds its bias; attention's einsum is transposed).
_THROUGH = frozenset({"add", "transpose", "reshape", "convert_element_type", "copy", "pjit", "jit"})
_MATMULS = ("dot_general", "conv_general_dilated")


def _is_var(x: Any) -> bool:
    """A jaxpr variable, not a literal (a constant operand: it has an aval but no producer, and
    is not hashable)."""
    return isinstance(x, jcore.Var)


def _from_matmul(producer: dict, v: Any, depth: int = 0) -> bool:
    eqn = producer.get(v) if _is_var(v) else None
    if eqn is None or depth > 4:
        return False
    if eqn.primitive.name in _MATMULS:
        return True
    inner = W.body(eqn)
    if inner is not None and eqn.primitive.name in _THROUGH:
        found = inner.outvars[eqn.outvars.index(v)]
        return _from_matmul({o: e for e in inner.eqns for o in e.outvars}, found, depth + 1)
    if eqn.primitive.name not in _THROUGH:
        return False
    return any(_from_matmul(producer, x, depth + 1) for x in eqn.invars if _is_var(x))


def matmul_tags(jaxpr: Any) -> frozenset[str]:
    """Checkpoint names applied to a matmul or convolution output (through a bias add, a
    transpose, a reshape or a cast) anywhere in ``jaxpr``."""
    found, todo = set(), [jaxpr]
    while todo:
        j = todo.pop()
        producer = {o: e for e in j.eqns for o in e.outvars}
        for eqn in j.eqns:
            tag = W.eqn_tag(eqn)
            if tag is not None and eqn.invars and _from_matmul(producer, eqn.invars[0]):
                found.add(tag)
            todo.extend(W.sub_jaxprs(eqn))
    return frozenset(found)


def _has_matmul(j: Any) -> bool:
    return any(
        e.primitive.name in _MATMULS or any(_has_matmul(sub) for sub in W.sub_jaxprs(e))
        for e in j.eqns
    )


class Feeds(NamedTuple):
    """What each checkpoint name is computed from (:func:`feeds`).

    Attributes:
      fed: for each name, the names applied to the values it is computed from without a
        matmul between (``{"mlp_act": {"mlp_up"}}`` where ``mlp_act = gelu(mlp_up)``).
      no_matmul: the names applied directly in a remat segment's body and computed from the
        segment's inputs alone with no matmul or convolution anywhere between (a norm of the
        layer's input, the input itself, a name fed only by such names): the backward pass
        recomputes no matmul for them.
    """

    fed: dict[str, frozenset[str]]
    no_matmul: frozenset[str]


def feeds(jaxpr: Any, depth: int = 8) -> Feeds:
    """:class:`Feeds` of ``jaxpr``: from each name back through elementwise work and calls
    holding no matmul, up to ``depth`` equations. A name applied to ``gelu(x @ w)`` with
    ``x @ w`` untagged is fed by none and is not in ``no_matmul``; one whose walk stops at the
    depth, or is applied inside a call nested in the segment (its inputs are not the
    segment's), is not in ``no_matmul`` either (not known)."""
    found: dict[str, set[str]] = {}
    rooted: dict[str, bool] = {}  # a name: True while only the segment's inputs were reached
    holds: dict[int, bool] = {}  # by equation: a matmul somewhere inside (each call judged once)

    def opaque(e: Any) -> bool:
        if id(e) not in holds:
            holds[id(e)] = any(_has_matmul(sub) for sub in W.sub_jaxprs(e))
        return holds[id(e)]

    todo = [(jaxpr, False)]
    while todo:
        j, segment = todo.pop()
        producer = {o: e for e in j.eqns for o in e.outvars}
        for eqn in j.eqns:
            todo.extend((sub, W.is_remat(eqn)) for sub in W.sub_jaxprs(eqn))
            tag = W.eqn_tag(eqn)
            if tag is None or not eqn.invars:
                continue
            names = found.setdefault(tag, set())
            clean = segment and rooted.get(tag, True)
            frontier, seen = [(eqn.invars[0], 0)], set()
            while frontier:
                v, d = frontier.pop()
                up = producer.get(v) if _is_var(v) else None
                if up is None:  # an input of this body, or a literal
                    continue
                if d >= depth or id(up) in seen:
                    clean = clean and id(up) in seen
                    continue
                seen.add(id(up))
                name = W.eqn_tag(up)
                if name is not None:
                    names.add(name)
                elif up.primitive.name in _MATMULS or opaque(up):
                    clean = False
                else:
                    frontier += [(x, d + 1) for x in up.invars if _is_var(x)]
            rooted[tag] = clean
    fed = {t: frozenset(f) for t, f in found.items()}
    # fed only by names that are themselves computed from the inputs alone: a fixed point
    clear = {t for t, ok in rooted.items() if ok}
    while True:
        keep = {t for t in clear if fed[t] <= clear}
        if keep == clear:
            break
        clear = keep
    return Feeds(fed, frozenset(clear))


def recompute_savers(
    residuals_saving: Callable[[str], Sequence[W.Residual]],
    tags: Iterable[str],
    matmuls: Iterable[str] = (),
    flops_saving: Callable[[str | None], float] | None = None,
) -> tuple[str, ...]:
    """Those of ``tags`` whose saving alone keeps them as new residuals (not the remat
    segment's input, kept anyway) and, with ``flops_saving``, lowers the step's traced matmul
    FLOPs: the backward pass then reads them instead of recomputing them (a name applied after
    an activation is kept but its matmul is recomputed all the same, for the activation's
    derivative: not one). The ``matmuls`` among them (matmul outputs, :func:`matmul_tags`: they
    save the most FLOPs) first, then by name. The solver's per-tag FLOPs
    (:func:`remat_kit.recommend.tag_costs`) judge the same way.

    Args:
      residuals_saving: ``residuals_saving(tag)``: the residuals of the loss under a policy
        saving ``tag`` alone (:func:`remat_kit.walker.saved_residuals`).
      flops_saving: ``flops_saving(tag)``: traced matmul FLOPs of the step (forward and
        backward) saving ``tag`` alone; ``flops_saving(None)``: saving nothing.
    """
    kept = [
        t for t in sorted(tags)
        if any(r.tag == t and r.nbytes and not r.is_argument for r in residuals_saving(t))
    ]  # fmt: skip
    if flops_saving is not None and kept:
        nothing = flops_saving(None)
        kept = [t for t in kept if flops_saving(t) < nothing]
    first = frozenset(matmuls)
    return tuple(sorted(kept, key=lambda t: (t not in first, t)))


def _never_applied(label: str | None) -> str:
    """``"policy 'x' is never applied"``; ``label`` None: every policy (``"no policy is
    applied"``)."""
    return "no policy is applied" if label is None else f"{label} is never applied"


def no_remat_segment(label: str | None, factory: str) -> Finding:
    """The error for a policy (``label``; None: every policy) whose step holds no remat
    segment: ``factory`` (the user's ``make_loss``) does not apply the policy it receives, so
    the policy decides nothing."""
    return Finding(
        "no-remat-segment", "error",
        f"{_never_applied(label)}: the step contains no remat segment (no "
        "jax.checkpoint / nn.remat / nnx.remat anywhere in its traced jaxpr), so it stores "
        "what no-remat stores.",
        f"{factory} does not use the policy it receives.",
        "pass the policy it receives to jax.checkpoint(layer, policy=policy) / "
        "nn.remat(Block, policy=policy) / nnx.remat(f, policy=policy) around the layers.",
    )  # fmt: skip


def policy_not_passed(label: str | None, factory: str, segments: int) -> Finding:
    """The error for a policy (``label``; None: every policy) that none of the step's
    ``segments`` remat segments takes: the model rematerializes on its own (``nn.remat`` /
    ``jax.checkpoint`` without ``policy=``, or with a fixed policy of its own), so every policy
    compiles to one program."""
    return Finding(
        "policy-not-passed", "error",
        f"{_never_applied(label)}: none of the {segments} remat segment(s) of the step takes "
        "the policy, so every policy compiles to the same program.",
        f"{factory} builds remat segments that do not take the policy it receives (a remat "
        "call without policy=, or with a fixed policy of its own, e.g. a Hugging Face Flax "
        "model with gradient_checkpointing=True).",
        "pass the policy the factory receives to those remat calls (policy=policy), or wrap "
        "the loss in remat_kit.inject_policy(loss), which sets the policy of every remat "
        "segment (docs/own-model-no-policy-hook.md).",
    )  # fmt: skip


def no_remat_remats(label: str, factory: str, segments: int) -> Finding:
    """The error for the ``no-remat`` row (``label``) of a program whose ``factory`` builds
    ``segments`` remat segments when given None (:meth:`~remat_kit.reach.PolicyReach.
    no_remat_note`, which analyze writes under the same row): it is no step without remat."""
    return Finding(
        "no-remat-remats", "error",
        f"policy {label!r} still rematerializes: the factory builds {segments} remat "
        "segment(s) when given no policy (None), so this row is not a step without remat "
        "and no policy's recompute is measured against it.",
        f"{factory} passes None on to its remat calls (jax.checkpoint / nn.remat / nnx.remat "
        "with policy=None save nothing: full remat), as MaxText's scanned "
        "remat_policy='none' does, instead of building the layers without remat.",
        "build the layers without remat when the policy is None (body = layer if policy is "
        "None else jax.checkpoint(layer, policy=policy)), or wrap the loss in "
        "remat_kit.inject_policy(loss), which builds none for None "
        "(docs/own-model-no-policy-hook.md).",
    )  # fmt: skip


def own_example(facts: TagFacts, action: str, prefer: Iterable[str] = ()) -> str:
    """A per-tag policy in the program's own names: ``'attn_in=offload'`` (the first of
    ``prefer`` it emits, else its first name); ``""`` when it emits none."""
    emitted = sorted(facts.emitted)
    tag = next((t for t in sorted(prefer) if t in facts.emitted), emitted[0] if emitted else None)
    return f"'{tag}={action}'" if tag else ""


def _runs_as(promise: Promise, acting: frozenset[str]) -> str:
    if promise.base != "names":
        return f"{promise.name} without them"
    parts = [f"{t}={'offload' if t in promise.offload else 'save'}" for t in sorted(acting)]
    return ", ".join(parts) + " (the rest recomputed)" if parts else "save-nothing"


def unknown_tags(promise: Promise, facts: TagFacts) -> list[Finding]:
    """One ``unknown-tag`` error for the names the policy saves or offloads that the program
    never emits: each with its closest emitted name, the emitted names, and what the policy runs
    as without them. A registered policy that acts on some emitted names gets a
    ``tag-not-emitted`` note (info) for the rest instead: it names every tensor of its kind in
    remat-kit's (MaxText's) vocabulary and a model emits those it has (a fused key/value
    projection tags ``key_proj`` alone), as analyze's note under its row says."""
    emitted = facts.emitted
    missing = promise.tags - emitted
    if promise.registered and promise.tags & emitted & _MLP_FAMILIES:
        # A registered policy names both MLP families' tags; only one family is emitted.
        missing -= _MLP_FAMILIES
    if not missing:
        return []
    if promise.registered and promise.tags & emitted:
        return [_not_emitted(promise, missing, promise.tags & emitted)]
    hints = {t: _hint(t, emitted) for t in sorted(missing)}
    listed = ", ".join(f"{t!r}" + (f" (closest: {h!r})" if h else "") for t, h in hints.items())
    what = (
        f"policy {promise.name!r} names {listed}, which the program never emits (emitted: "
        f"{', '.join(sorted(emitted)) or 'none'}): nothing is saved or offloaded for "
        f"{'it' if len(missing) == 1 else 'them'}; it runs as "
        f"{_runs_as(promise, promise.tags & emitted)}."
    )
    return [Finding("unknown-tag", "error", what, _cause(promise, facts, missing),
                    _fix(promise, facts, hints))]  # fmt: skip


def _hint(tag: str, emitted: frozenset[str]) -> str | None:
    """The emitted name closest to ``tag`` in spelling, unless both are names of remat-kit's
    (MaxText's) vocabulary for different tensors (``mlpwo`` is not ``mlpwi``, ``out_proj`` not
    ``value_proj``); one MLP family's name for the other's stays a hint (``mlpwi_0`` ->
    ``mlpwi``: the cause says which family is which)."""
    near = closest(tag, sorted(emitted))
    known = set(N.CHECKPOINT_NAMES)
    if near in known and tag in known and not {near, tag} <= _MLP_FAMILIES:
        return None
    return near


def _not_emitted(promise: Promise, missing: frozenset[str], acting: frozenset[str]) -> Finding:
    """The note for a registered policy naming ``missing`` beside the names it acts on."""
    runs = _runs_as(promise, acting)
    return Finding(
        "tag-not-emitted", "info",
        f"policy {promise.name!r} names {', '.join(sorted(missing))}, which the program does "
        f"not emit: it acts on the names it emits and runs as {runs}.",
        "remat-kit's registered policies name every tensor of their kind in its (MaxText's) "
        "vocabulary; a model emits those it has (one fusing its key and value projections tags "
        "key_proj alone).",
        "none needed; to name exactly what it keeps, write the per-tag spec it runs as.",
    )  # fmt: skip


def _cause(promise: Promise, facts: TagFacts, missing: frozenset[str]) -> str:
    if facts.remat_kit_names and missing & _MLP_FAMILIES:
        return (
            "a typo, or a tag of another model family (mlpwi_0/mlpwi_1 are SwiGLU's, mlpwi "
            "the plain MLP's)."
        )
    if promise.registered and not facts.remat_kit_names and facts.emitted:
        return (
            "remat-kit's named policies use its models' (MaxText) names; this program tags its "
            "tensors with names of its own."
        )
    if not facts.emitted:
        return "the program applies no checkpoint_name at all."
    return "a typo, or a tensor the program does not tag."


def _fix(promise: Promise, facts: TagFacts, hints: dict[str, str | None]) -> str:
    found = [f"{h!r} for {t!r}" for t, h in hints.items() if h]
    if found and not (promise.registered and facts.user):
        return f"use {', '.join(found)}."
    if facts.user and facts.emitted:
        action = "offload" if promise.offload else "save"
        # the closest names, else the program's names that share a word with the policy's
        # (save-qkv-proj -> qkv), rather than its first name in sorted order
        words = set(re.split(r"[-_]", " ".join([promise.name, *hints]).replace(" ", "-")))
        prefer = [h for h in hints.values() if h] or [
            t for t in facts.emitted if words & set(re.split(r"[-_]", t))
        ]
        example = own_example(facts, action, prefer)
        return f"write the policy in the program's own names, e.g. {example}."
    return "tag the tensor with checkpoint_name, or drop it from the policy."
