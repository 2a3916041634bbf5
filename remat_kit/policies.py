"""Named rematerialization policies: a registry of small specs turned into jax.checkpoint policies.

A policy decides, for every intermediate value of a checkpointed function, whether the forward
pass keeps it for the backward pass (a *residual*, on device), moves it to pinned host memory
(*offload*), or drops it and recomputes it in the backward pass (*rematerialization*). See the JAX
doc "Gradient checkpointing with jax.checkpoint" (docs/gradient-checkpointing.md).

Every named policy is a :class:`PolicySpec` (what is saved, what is offloaded, the rest
recomputed) and :func:`policy` turns it into the callable ``jax.checkpoint``, ``flax.linen.remat``
and ``flax.nnx.remat`` take. Tag-based specs are built from name sets
(``save_only_these_names``, ``save_and_offload_only_these_names``) rather than composed callables:
JAX's newer remat implementation (``jax_remat3``) reads policies as data and turns a composed
callable into full remat without a word.

Example (a scalar function here; a block's input is [batch, seq, d_model]):

    >>> import flax.linen as nn
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import remat_kit
    >>> RematBlock = nn.remat(remat_kit.Block, policy=remat_kit.policy("save-dots-no-batch"))
    >>> custom = remat_kit.custom_policy({"query_proj": "offload", "out_proj": "save"})
    >>> f = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)), policy=remat_kit.policy("save-nothing"))
    >>> float(jax.grad(f)(0.0))  # cos(sin 0) * cos 0: remat changes memory, not the maths
    1.0
    >>> remat_kit.policy("save-dot")
    Traceback (most recent call last):
    ...
    ValueError: ...
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

import jax

from remat_kit import names as N

#: How a spec decides what to save. ``names``: the tags in ``save`` / ``offload``;
#: ``dots``: every ``dot_general`` output; ``dots_no_batch``: ``dot_general`` outputs without batch
#: dimensions (weight matmuls); ``everything``: nothing is recomputed.
PolicyBase = Literal["names", "dots", "dots_no_batch", "everything"]
#: What a custom spec may do with one tag.
TagAction = Literal["save", "offload", "recompute"]
TAG_ACTIONS: tuple[str, ...] = get_args(TagAction)

#: Memory kinds used for offloading (JAX memory kinds; ``pinned_host`` is page-locked host RAM).
OFFLOAD_SRC = "device"
OFFLOAD_DST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What a rematerialization policy keeps, offloads and recomputes.

    Attributes:
      name: registry name (``"save-dots"``) or ``"custom"`` for :func:`custom_policy` specs.
      description: one sentence: what is saved, offloaded, recomputed.
      base: how values are selected (see :data:`PolicyBase`).
      save: checkpoint names kept on device (``base == "names"`` only).
      offload: checkpoint names moved to pinned host memory (``base == "names"`` only).
      source: where the policy comes from (paper, JAX doc, MaxText policy name).
      wrap: False only for ``no-remat``: the model is then not wrapped in remat at all.
    """

    name: str
    description: str
    base: PolicyBase = "names"
    save: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    source: str = ""
    wrap: bool = True

    def __post_init__(self):
        for tag in self.save | self.offload:
            N.validate_name(tag)
        both = self.save & self.offload
        if both:
            raise ValueError(
                f"checkpoint name(s) {sorted(both)} both saved and offloaded in policy "
                f"{self.name!r}; each name is either saved on device or offloaded to host"
            )
        if self.base != "names" and (self.save or self.offload):
            raise ValueError(f"policy {self.name!r}: base {self.base!r} takes no name sets")

    @property
    def offloads(self) -> bool:
        """True when the policy moves some residuals to host memory."""
        return bool(self.offload)

    @property
    def tags(self) -> frozenset[str]:
        """Checkpoint names this spec refers to (saved or offloaded)."""
        return self.save | self.offload

    def to_jax(self) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy callable for this spec."""
        cp = jax.checkpoint_policies
        if self.base == "everything":
            return cp.everything_saveable
        if self.base == "dots":
            return cp.dots_saveable
        if self.base == "dots_no_batch":
            return cp.dots_with_no_batch_dims_saveable
        if self.offload:
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=sorted(self.save),
                names_which_can_be_offloaded=sorted(self.offload),
                offload_src=OFFLOAD_SRC,
                offload_dst=OFFLOAD_DST,
            )
        if not self.save:
            return cp.nothing_saveable
        return cp.save_only_these_names(*sorted(self.save))

    def action(self, tag: str) -> TagAction:
        """What this spec does with checkpoint name ``tag`` (for ``base == "names"`` specs)."""
        if tag in self.save:
            return "save"
        if tag in self.offload:
            return "offload"
        return "recompute"


_QKV = frozenset({N.QUERY_PROJ, N.KEY_PROJ, N.VALUE_PROJ})
_PROJECTIONS = _QKV | {N.OUT_PROJ, N.MLPWI, N.MLPWI_0, N.MLPWI_1, N.MLPWO}
_KORTHIKANTI = "Korthikanti et al. 2022, arXiv:2205.05198"
_JAX_DOC = "JAX doc: gradient-checkpointing.md (jax.checkpoint_policies)"

_REGISTRY: dict[str, PolicySpec] = {
    s.name: s
    for s in [
        PolicySpec(
            "no-remat",
            "Nothing recomputed: every residual the backward pass needs is kept on device; the "
            "model is not wrapped in remat.",
            base="everything",
            wrap=False,
            source="plain reverse-mode autodiff",
        ),
        PolicySpec(
            "save-nothing",
            "Full remat: only each remat segment's input is kept; the whole block is recomputed "
            "in the backward pass (one extra forward).",
            save=frozenset(),
            source=f"Chen et al. 2016, arXiv:1604.06174; {_JAX_DOC} (nothing_saveable)",
        ),
        PolicySpec(
            "save-layer-inputs",
            "Classic per-layer checkpointing: every block input (decoder_layer_input) kept, the "
            "inside of each block recomputed. Equals save-nothing when remat_group_size == 1.",
            save=frozenset({N.DECODER_LAYER_INPUT}),
            source="Chen et al. 2016, arXiv:1604.06174; MaxText 'save_decoder_layer_input'",
        ),
        PolicySpec(
            "save-dots",
            "Every matmul output kept (projections and the attention score / context matmuls); "
            "elementwise ops, norms and softmax recomputed.",
            base="dots",
            source=f"{_JAX_DOC} (dots_saveable)",
        ),
        PolicySpec(
            "save-dots-no-batch",
            "Weight matmul outputs kept; the batched attention score and context matmuls, "
            "softmax and elementwise ops recomputed (selective activation recompute).",
            base="dots_no_batch",
            source=f"{_KORTHIKANTI}; {_JAX_DOC} (dots_with_no_batch_dims_saveable)",
        ),
        PolicySpec(
            "save-qkv-proj",
            "Query, key and value projections kept; everything else recomputed.",
            save=_QKV,
            source="MaxText 'save_qkv_proj'",
        ),
        PolicySpec(
            "save-out-proj",
            "Attention output projection kept; everything else recomputed.",
            save=frozenset({N.OUT_PROJ}),
            source="MaxText 'save_out_proj'",
        ),
        PolicySpec(
            "save-qkv-out-proj",
            "Query, key, value and attention output projections kept; the MLP and attention "
            "scores recomputed.",
            save=_QKV | {N.OUT_PROJ},
            source="MaxText 'save_dot_except_mlp'",
        ),
        PolicySpec(
            "save-dots-except-mlp",
            "Attention matmul outputs kept (q, k, v, context, out_proj); the MLP and the "
            "[seq, seq] attention scores recomputed.",
            save=_QKV | {N.CONTEXT, N.OUT_PROJ},
            source="MaxText 'save_dot_with_context_except_mlp'",
        ),
        PolicySpec(
            "minimal",
            "All projection outputs kept (q, k, v, out_proj, mlpwi*, mlpwo); attention scores, "
            "context, norms and activations recomputed.",
            save=_PROJECTIONS,
            source="MaxText 'minimal'",
        ),
        PolicySpec(
            "offload-to-host",
            "The 'minimal' set (all projection outputs) moved to pinned host memory in the "
            "forward pass and brought back for the backward; the rest recomputed.",
            offload=_PROJECTIONS,
            source=f"{_JAX_DOC} (save_and_offload_only_these_names); MaxText 'minimal_offloaded'",
        ),
        PolicySpec(
            "offload-layer-inputs",
            "Every block input (decoder_layer_input) offloaded to pinned host memory; the inside "
            "of each block recomputed.",
            offload=frozenset({N.DECODER_LAYER_INPUT}),
            source="MaxText 'decoder_layer_input: offload'",
        ),
        PolicySpec(
            "offload-qkv-proj",
            "Query, key and value projections offloaded to pinned host memory; the rest "
            "recomputed.",
            offload=_QKV,
            source="MaxText 'qkv_proj_offloaded'",
        ),
    ]
}


def _save_text(names: frozenset[str]) -> str:
    return ",".join(f"{t}=save" for t in sorted(names))


#: MaxText's ``remat_policy`` names (``src/MaxText/layers/decoders.py``, ``get_remat_policy``;
#: ``minimal`` is remat-kit's name too) -> what remat-kit calls the policy saving the same
#: checkpoint names (MaxText's fused ``qkv_proj`` left out, as remat-kit's specs do): a
#: registered name, or the per-tag text of a set remat-kit has no name for (a per-tag spec must
#: name only what the model emits: the gated MLP's ``mlpwi_0`` / ``mlpwi_1`` are given).
MAXTEXT_POLICIES = types.MappingProxyType(
    {
        "full": "save-nothing",
        "save_qkv_proj": "save-qkv-proj",
        "save_out_proj": "save-out-proj",
        "save_dot_except_mlp": "save-qkv-out-proj",
        "save_dot_with_context_except_mlp": "save-dots-except-mlp",
        "qkv_proj_offloaded": "offload-qkv-proj",
        "minimal_offloaded": "offload-to-host",
        "save_dot_except_mlpwi": _save_text(_QKV | {N.OUT_PROJ, N.MLPWO}),
        "minimal_with_context": _save_text(_PROJECTIONS - {N.MLPWI} | {N.CONTEXT}),
        "minimal_flash": _save_text(_PROJECTIONS - {N.MLPWI} | {N.CONTEXT}),
    }
)
#: MaxText's ``custom`` policy actions (``device`` / ``offload`` / ``remat``) -> remat-kit's.
_MAXTEXT_ACTIONS = types.MappingProxyType({"device": "save", "remat": "recompute"})


def _maxtext_meaning(policy: object) -> str | None:
    """What a MaxText ``remat_policy`` name is in remat-kit (for the unknown-name error)."""
    if policy == "custom":
        return (
            "MaxText's 'custom' is a per-tag spec here: TAG=ACTION,... with save (MaxText's "
            "device), offload or recompute (remat), e.g. 'decoder_layer_input=offload,"
            "query_proj=save'."
        )
    meant = MAXTEXT_POLICIES.get(policy) if isinstance(policy, str) else None
    if meant is None:
        return None
    if meant in _REGISTRY:
        return f"{policy!r} is MaxText's name for remat-kit's {meant!r} (the same names saved)."
    gated = (
        " (mlpwi=save for a non-gated MLP; the names your model emits)"
        if "mlpwi_0" in meant
        else ""
    )
    return f"{policy!r} is MaxText's name for the per-tag spec {meant!r}{gated}."


def policy_names() -> list[str]:
    """Names of every registered policy, in registry order (least to most custom)."""
    return list(_REGISTRY)


def policy_specs() -> dict[str, PolicySpec]:
    """A copy of the registry: name -> :class:`PolicySpec`."""
    return dict(_REGISTRY)


def _closure(policy: Callable[..., Any]) -> dict[str, Any]:
    code = getattr(policy, "__code__", None)
    cells = getattr(policy, "__closure__", None) or ()
    return dict(
        zip(getattr(code, "co_freevars", ()), (c.cell_contents for c in cells), strict=False)
    )


def _names(value: Any) -> frozenset[str] | None:
    if isinstance(value, (set, frozenset, tuple, list)) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    return None


def is_by_exclusion(policy: Any) -> bool:
    """Whether ``policy`` is ``jax.checkpoint_policies.save_any_names_but_these(*names)``: it
    saves every ``checkpoint_name`` a program emits but ``names`` (a frozen dataclass,
    ``SaveAnyNamesButThese.names``, jax/_src/ad_checkpoint.py), so what it keeps depends on
    the program."""
    return type(policy).__name__ == "SaveAnyNamesButThese"


def read_jax_policy(
    policy: Callable[..., Any], emitted: Iterable[str] | None = None
) -> PolicySpec | None:
    """The :class:`PolicySpec` of a raw ``jax.checkpoint_policies`` policy, read from the data
    JAX's constructors keep (``jax/_src/ad_checkpoint.py``, jax 0.10.2): the four fixed
    policies, ``save_only_these_names`` (a dataclass with ``saveable_names``) and
    ``save_and_offload_only_these_names`` (a closure over its name sets); named after the
    constructor and its names (``save_only_these_names(attn_out, mlp_up)``).
    ``save_any_names_but_these(*names)`` on a program emitting ``emitted`` (its
    ``checkpoint_name`` values) is the name set it amounts to there: every emitted name but
    ``names`` saved. None for a callable whose effect is not a name set or a base rule
    (``save_any_names_but_these`` with no program to read names from;
    ``offload_dot_with_no_batch_dims``; composed callables and lambdas).
    """
    if is_by_exclusion(policy) and emitted is not None:
        excluded = frozenset(getattr(policy, "names", ()))
        save = frozenset(emitted) - excluded
        return PolicySpec(
            f"save_any_names_but_these({', '.join(sorted(excluded))})",
            f"Saves every checkpoint name the program emits but "
            f"{', '.join(sorted(excluded)) or 'none'}: "
            f"here {', '.join(sorted(save)) or 'none'}; everything else recomputed.",
            save=save,
            source="jax.checkpoint_policies.save_any_names_but_these",
        )
    cp = jax.checkpoint_policies
    fixed = {
        id(cp.everything_saveable): ("everything_saveable", "everything"),
        id(cp.nothing_saveable): ("nothing_saveable", "names"),
        id(cp.dots_saveable): ("dots_saveable", "dots"),
        id(cp.dots_with_no_batch_dims_saveable): ("dots_with_no_batch_dims_saveable",
                                                  "dots_no_batch"),
    }  # fmt: skip
    if id(policy) in fixed:
        name, base = fixed[id(policy)]
        return PolicySpec(name, f"jax.checkpoint_policies.{name}", base)
    saveable = _names(getattr(policy, "saveable_names", None))
    if saveable is not None:
        # named with its names: two raw policies of other name sets are other rows
        name = f"save_only_these_names({', '.join(sorted(saveable))})"
        return PolicySpec(name, "jax.checkpoint_policies.save_only_these_names", save=saveable)
    cells = _closure(policy)
    if "names_which_can_be_offloaded" in cells:
        save = _names(cells.get("names_which_can_be_saved")) or frozenset()
        off = _names(cells["names_which_can_be_offloaded"]) or frozenset()
        kind = "save_and_offload_only_these_names"
        name = f"{kind}(save: {', '.join(sorted(save)) or '-'}; offload: {', '.join(sorted(off))})"
        return PolicySpec(name, f"jax.checkpoint_policies.{kind}", save=save, offload=off)
    return None


def get_policy_spec(
    policy: str | PolicySpec | Mapping[str, str] | Callable[..., Any],
    emitted: Iterable[str] | None = None,
) -> PolicySpec:
    """Resolve a policy name, per-tag text (``"query_proj=offload,out_proj=save"``, as
    ``--policy`` takes it: :func:`parse_policy_arg`), a custom mapping, a spec, or a raw
    ``jax.checkpoint_policies`` policy that can be read as data (:func:`read_jax_policy`) to a
    :class:`PolicySpec`. ``emitted``: the ``checkpoint_name`` values of the program the policy
    is for (:func:`remat_kit.program_tags`), which ``save_any_names_but_these`` needs (the tools
    pass their program's).

    Raises:
      ValueError: unknown policy name (the message lists the valid names and the closest match),
        a bad custom mapping (see :func:`custom_spec`), a callable that cannot be read as
        data (the message says what to give instead), ``emitted`` not a collection of names.
    """
    if emitted is not None:
        names = list(emitted) if isinstance(emitted, Iterable) else None
        if isinstance(emitted, str) or names is None or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"emitted must be the checkpoint names a program emits (strings: "
                f"remat_kit.program_tags(program)), got {type(emitted).__name__}"
            )
        emitted = frozenset(names)
    if isinstance(policy, PolicySpec):
        return policy
    if isinstance(policy, Mapping):
        return custom_spec(policy)
    if callable(policy):
        spec = read_jax_policy(policy, emitted)
        if spec is None and is_by_exclusion(policy):
            raise ValueError(
                "policy save_any_names_but_these saves every checkpoint name a program emits "
                "but the ones given: give it with a program (analyze, recommend, the doctor "
                "and the sweep read its names; here: get_policy_spec(policy, "
                "remat_kit.program_tags(program))), or list what to save with "
                "save_only_these_names(...)"
            )
        if spec is None:
            qual = getattr(policy, "__qualname__", type(policy).__name__)
            raise ValueError(
                f"policy {qual!r} is a callable remat-kit cannot read as data (a composed "
                "policy, a lambda, offload_dot_with_no_batch_dims): "
                "give a policy name, a per-tag mapping or save_only_these_names(...); "
                "remat_kit.check_function judges such a callable by what it does"
            )
        return spec
    if isinstance(policy, str) and ("=" in policy or policy.lstrip().startswith("{")):
        return parse_policy_arg(policy)  # the per-tag text the command line takes, one syntax
    if isinstance(policy, str) and policy.strip().lower() in ("none", "null"):
        raise ValueError(
            f"policy {policy!r}: jax.checkpoint(policy=None) / nn.remat(policy=None) saves "
            "nothing (full remat): that is 'save-nothing'; 'no-remat' is the opposite (no "
            "checkpoint, every residual kept)"
        )
    if not isinstance(policy, str) or policy not in _REGISTRY:
        raise N.unknown_value_error("policy", policy, policy_names(), _maxtext_meaning(policy))
    return _REGISTRY[policy]


def custom_spec(spec: Mapping[str, str], name: str = "custom") -> PolicySpec:
    """A :class:`PolicySpec` from a per-tag mapping ``{checkpoint_name: "save" | "offload" |
    "recompute"}``; every tag not listed is recomputed.

    Any ``checkpoint_name`` is accepted (the bundled models' MaxText tags or a user model's own);
    :func:`check_tags` checks a spec against the names a program emits.

    Raises:
      ValueError: a tag that is not a non-empty string, or an unknown action (message names it,
        the valid ones and the closest match).
    """
    save, offload = set(), set()
    for tag, act in spec.items():
        N.validate_name(tag)
        if act not in TAG_ACTIONS:
            maxtext = _MAXTEXT_ACTIONS.get(act) if isinstance(act, str) else None
            meant = f"MaxText's {act!r} is {maxtext!r} here." if maxtext else None
            error = N.unknown_value_error("action", act, TAG_ACTIONS, meant)
            raise ValueError(f"tag {tag!r}: {error}")
        if act == "save":
            save.add(tag)
        elif act == "offload":
            offload.add(tag)
    parts = [f"{t}={a}" for t, a in sorted(spec.items()) if a != "recompute"]
    return PolicySpec(
        name,
        "Custom: " + (", ".join(parts) if parts else "everything recomputed") + "; the rest "
        "recomputed.",
        save=frozenset(save),
        offload=frozenset(offload),
        source="user spec",
    )


def check_tags(spec: PolicySpec, emitted: Iterable[str], program: str = "the program") -> None:
    """Check that every tag ``spec`` saves or offloads is one the program emits.

    Args:
      spec: the policy.
      emitted: the ``checkpoint_name`` tags the program emits (e.g. from the walker).
      program: what to call the program in the message.

    Raises:
      ValueError: a tag the program never emits (the policy would silently recompute it); the
        message names it, the emitted names and the closest one.
    """
    emitted = sorted(set(emitted))
    for tag in sorted(spec.tags):
        if tag not in emitted:
            if not emitted:
                raise ValueError(
                    f"policy {spec.name!r} names checkpoint name {tag!r}, but {program} emits no "
                    "checkpoint_name tags; tag its tensors with jax.ad_checkpoint.checkpoint_name"
                )
            raise N.unknown_value_error(f"checkpoint name (not emitted by {program})", tag, emitted)


@dataclasses.dataclass(frozen=True)
class TagFit:
    """What a set of policies does on a program emitting a given set of tags
    (:func:`policies_for_tags`).

    Attributes:
      specs: the specs worth compiling, in the given order, duplicates removed.
      restricted: ``(named spec, the custom spec it was cut down to)`` for each registered
        name-based policy naming some tags the program does not emit.
      skipped: registered name-based policies naming none of the emitted tags (they would run as
        ``save-nothing``).
    """

    specs: tuple[PolicySpec, ...]
    restricted: tuple[tuple[PolicySpec, PolicySpec], ...]
    skipped: tuple[PolicySpec, ...]

    def notes(self, program: str) -> list[str]:
        """One line per restricted policy and one for all the skipped ones."""
        out = [
            f"{named.name} names {', '.join(sorted(named.tags - cut.tags))}, which {program} "
            f"does not emit: compiled as {cut.description[len('Custom: ') :]}"
            for named, cut in self.restricted
        ]
        if self.skipped:
            out.append(
                f"not compiled on {program}: {', '.join(s.name for s in self.skipped)} (they name "
                "none of its checkpoint names and would run as save-nothing)"
            )
        return out


def policies_for_tags(
    policies: Iterable[str | PolicySpec | Mapping[str, str]], tags: Iterable[str]
) -> TagFit:
    """The policies that can act on a program emitting ``tags``.

    Kept as given: the kind-based specs (``save-nothing``, ``save-dots``, ``no-remat``...), a
    registered name-based spec whose tags the program all emits (a tag of the other MLP family,
    ``mlpwi`` where the program emits ``mlpwi_0`` / ``mlpwi_1`` or the reverse, counts as
    emitted: the registered policies name both families), and every spec that is not a
    registered one (a user's own: check it with :func:`check_tags`). A registered name-based spec
    naming some other tags the program does not emit is cut down to the emitted ones (a custom
    spec); one naming none of them is skipped.

    Raises:
      ValueError: an unknown policy name (see :func:`get_policy_spec`).
    """
    tags = frozenset(tags)
    specs, restricted, skipped = [], [], []
    for spec in dict.fromkeys(get_policy_spec(p, tags) for p in policies):
        # the other MLP family's names are absent by design (registered policies name both)
        missing = {t for t in spec.tags - tags if not N.MLP_ALTERNATES.get(t, set()) & tags}
        if _REGISTRY.get(spec.name) != spec or spec.base != "names" or not missing:
            specs.append(spec)
        elif not spec.tags & tags:
            skipped.append(spec)
        else:
            actions = {t: "save" for t in spec.save & tags}
            actions |= {t: "offload" for t in spec.offload & tags}
            cut = custom_spec(actions)
            specs.append(cut)
            restricted.append((spec, cut))
    return TagFit(tuple(dict.fromkeys(specs)), tuple(restricted), tuple(skipped))


#: How one command-line ``--policy`` value is written (shown in ``--help``).
POLICY_ARG_HELP = (
    "a registered policy name (see `remat-kit policies`), or a per-tag spec: "
    "'query_proj=offload,out_proj=save' or its JSON form '{\"query_proj\": \"offload\"}' "
    f"(actions: {', '.join(TAG_ACTIONS)}; checkpoint names not listed are recomputed)"
)


def _no_duplicates(text: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        tags = [k for k, _ in pairs]
        twice = sorted({k for k in tags if tags.count(k) > 1})
        if twice:
            raise ValueError(f"policy {text!r}: checkpoint name(s) {twice} given twice")
        return dict(pairs)

    return hook


def _parse_tag_list(text: str) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for item in text.split(","):
        tag, sep, act = (part.strip() for part in item.partition("="))
        if not sep or not tag:
            raise ValueError(
                f"cannot read policy {text!r}: write tag=action pairs separated by commas, e.g. "
                f"query_proj=offload,out_proj=save (got {item.strip()!r})"
            )
        if tag in mapping:
            raise ValueError(f"policy {text!r}: checkpoint name(s) [{tag!r}] given twice")
        mapping[tag] = act
    return mapping


def parse_policy_arg(text: str) -> PolicySpec:
    """A :class:`PolicySpec` from one command-line ``--policy`` value (the one syntax every
    command takes).

    Three forms: a registered name (``save-dots``); per-tag actions
    ``query_proj=offload,out_proj=save``; or the same as a JSON object
    ``{"query_proj": "offload", "out_proj": "save"}``. The per-tag forms go through
    :func:`custom_spec` (checkpoint names not listed are recomputed), so they accept what it
    accepts and fail as it fails.

    Example::

        >>> parse_policy_arg("query_proj=offload,out_proj=save").offload
        frozenset({'query_proj'})
        >>> parse_policy_arg('{"out_proj": "save"}') == custom_spec({"out_proj": "save"})
        True

    Raises:
      ValueError: an unknown policy name (message lists the valid ones and the closest match);
        an unknown checkpoint name or action (the errors of :func:`custom_spec`); text that is
        neither form, JSON that is not an object of strings, or a checkpoint name given twice.
    """
    text = str(text).strip()
    if text.startswith("{"):
        try:
            mapping = json.loads(text, object_pairs_hook=_no_duplicates(text))
        except json.JSONDecodeError as err:
            raise ValueError(f"cannot read policy {text!r} as JSON: {err.msg}") from None
        if not all(isinstance(v, str) for v in mapping.values()):
            raise ValueError(
                f"policy {text!r}: the JSON form maps checkpoint names to one of "
                f"{', '.join(TAG_ACTIONS)}"
            )
        return custom_spec(mapping)
    if "=" in text:
        return custom_spec(_parse_tag_list(text))
    return get_policy_spec(text)


def policy_label(spec: PolicySpec) -> str:
    """A short name for a spec in tables: its registry name, or for a custom spec its per-tag
    actions (``custom: out_proj=save, query_proj=offload``)."""
    if spec.name != "custom":
        return spec.name
    parts = [f"{t}={spec.action(t)}" for t in sorted(spec.tags)]
    return "custom: " + (", ".join(parts) or "recompute all")


def cut_label(names: Sequence[str]) -> str:
    """The label of the custom spec registered policies were cut down to on a program that
    emits only some of their tags (``minimal (cut)``; ``a, b (cut)`` when several cut to one
    spec): every tool names such a row the same way."""
    return f"{', '.join(names)} (cut)"


def policy_arg(spec: PolicySpec) -> str:
    """The spec as ``--policy`` takes it back (:func:`parse_policy_arg`), the key of a sweep
    row: a registered policy's name, or its per-tag actions (``attn_in=save,mlp_hidden=offload``;
    ``recompute-all`` when it keeps nothing)."""
    if policy_specs().get(spec.name) == spec:
        return spec.name
    acts = {**{t: "save" for t in spec.save}, **{t: "offload" for t in spec.offload}}
    return ",".join(f"{t}={a}" for t, a in sorted(acts.items())) or "recompute-all"


def custom_policy(spec: Mapping[str, str]) -> Callable[..., Any]:
    """A ``jax.checkpoint`` policy from a per-tag mapping; tags not listed are recomputed.

    Example: ``custom_policy({"query_proj": "offload", "out_proj": "save"})``.

    Raises:
      ValueError: see :func:`custom_spec`.
    """
    return custom_spec(spec).to_jax()


def policy(name: str | PolicySpec | Mapping[str, str]) -> Callable[..., Any]:
    """The ``jax.checkpoint`` policy for a registered name, a custom mapping or a spec.

    The result can be passed as ``policy=`` to ``jax.checkpoint``, ``flax.linen.remat`` and
    ``flax.nnx.remat``. ``"no-remat"`` gives ``everything_saveable`` (nothing recomputed).

    Raises:
      ValueError: unknown name (message lists the valid names and the closest match).
    """
    return get_policy_spec(name).to_jax()


def describe(name: str | PolicySpec | Mapping[str, str]) -> str:
    """The one-sentence description of a policy (what it saves, offloads and recomputes)."""
    return get_policy_spec(name).description


def on_device_twin(spec: PolicySpec) -> PolicySpec:
    """``spec`` with its offloaded tags kept on device instead: the comparison that says whether
    an offload lowered the device peak (measured, never assumed)."""
    return PolicySpec(
        f"{spec.name} (on device)",
        f"{spec.name} keeping its offloaded tensors on device.",
        save=spec.save | spec.offload,
        source=f"on-device counterpart of {spec.name}",
    )
