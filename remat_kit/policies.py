"""Named rematerialization policies: a registry of :class:`PolicySpec` turned into
``jax.checkpoint`` policies (:func:`policy`).

A policy keeps each intermediate of a checkpointed function for the backward pass (on device),
offloads it to pinned host memory, or recomputes it (JAX doc "Gradient checkpointing with
jax.checkpoint"). Specs are name sets, not composed callables, which ``jax_remat3`` may run as
full remat; :func:`policy_effect` checks (docs/remat3.md).

    >>> import flax.linen as nn
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import remat_kit
    >>> RematBlock = nn.remat(remat_kit.Block, policy=remat_kit.policy("save-dots-no-batch"))
    >>> f = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)), policy=remat_kit.policy("save-nothing"))
    >>> float(jax.grad(f)(0.0))  # remat changes memory, not the maths
    1.0
    >>> remat_kit.policy("save-dot")
    Traceback (most recent call last):
    ...
    ValueError: ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from remat_kit import names as N
from remat_kit.walker import saved_residuals

#: What a spec saves: its ``save`` / ``offload`` names; every ``dot_general`` output; those
#: without batch dimensions (weight matmuls); everything.
PolicyBase = Literal["names", "dots", "dots_no_batch", "everything"]
TagAction = Literal["save", "offload", "recompute"]
TAG_ACTIONS: tuple[str, ...] = get_args(TagAction)

#: JAX memory kinds of an offload (``pinned_host``: page-locked host RAM).
OFFLOAD_SRC = "device"
OFFLOAD_DST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What a rematerialization policy keeps, offloads and recomputes.

    Attributes:
      name: registry name, or ``"custom"``.
      base: see :data:`PolicyBase`; ``save`` / ``offload`` (names on device / on host) only
        with ``"names"``.
      source: paper, JAX doc or MaxText policy name.
      wrap: False only for ``no-remat`` (no remat at all).
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
        """Whether some residuals go to host memory."""
        return bool(self.offload)

    @property
    def tags(self) -> frozenset[str]:
        """Checkpoint names saved or offloaded."""
        return self.save | self.offload

    def to_jax(self) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy."""
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
        """What a ``"names"`` spec does with ``tag``."""
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
            "elementwise ops, norms and softmax recomputed. lax.ragged_dot (MoE experts "
            "grouped by expert) is no dot to JAX's policy: recomputed.",
            base="dots",
            source=f"{_JAX_DOC} (dots_saveable)",
        ),
        PolicySpec(
            "save-dots-no-batch",
            "Weight matmul outputs kept; the batched attention score and context matmuls, "
            "softmax and elementwise ops recomputed (selective activation recompute). A "
            "matmul with a dimension in both operands and its output is batched (MoE experts "
            "as one einsum over stacked weights, 'bsef,efd->bsed'), and lax.ragged_dot no "
            "dot: both recomputed.",
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


#: MaxText ``remat_policy`` (``src/MaxText/layers/decoders.py``, ``get_remat_policy``) -> the
#: remat-kit policy saving the same names (fused ``qkv_proj`` left out): a registered name or
#: per-tag text (gated MLP names ``mlpwi_0`` / ``mlpwi_1``). ``minimal`` is the same in both.
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
_MAXTEXT_ACTIONS = types.MappingProxyType({"device": "save", "remat": "recompute"})
_TO_MAXTEXT_ACTIONS = types.MappingProxyType(
    {"save": "device", "offload": "offload", "recompute": "remat"}
)
#: The tensors MaxText's ``custom`` policy takes a setting for (its ``configs/types.py``,
#: MaxText 0.2.5); default ``remat``, ``decoder_layer_input``: ``device``.
MAXTEXT_TENSORS: tuple[str, ...] = (
    N.DECODER_LAYER_INPUT, N.INDEXER_CUTOFF_THRESHOLD, N.CONTEXT, N.MLPWI, N.MOE_MLPWI_0,
    N.MOE_MLPWI_1, N.MOE_MLPWO, "moe_x_sorted", "moe_routing_maps", N.MLPWI_0, N.MLPWI_1,
    N.MLPWO, N.QUERY_PROJ, N.KEY_PROJ, N.VALUE_PROJ, N.KV_PROJ, N.QUERY_WA_PROJ, N.KV_WA_PROJ,
    N.MLA_KV, N.MLA_Q, N.QKV_PROJ, N.ATTENTION_OUT, N.OUT_PROJ,
)  # fmt: skip
#: MaxText ``remat_policy`` names :func:`maxtext_spec` takes.
MAXTEXT_POLICY_NAMES: tuple[str, ...] = ("minimal", *MAXTEXT_POLICIES, "custom")


def maxtext_spec(name: str, tensors: Mapping[str, str] | None = None) -> PolicySpec:
    """The :class:`PolicySpec` of MaxText's ``remat_policy=name`` (same names saved and
    offloaded as its ``get_remat_policy``). For ``custom``, ``tensors`` are MaxText's
    per-tensor settings (``{"mlpwo": "offload"}``) over its defaults (:data:`MAXTEXT_TENSORS`).

    Raises:
      ValueError: an unknown MaxText policy name; ``tensors`` without ``custom``; an unknown
        tensor or setting.
    """
    if name != "custom" and tensors:
        raise ValueError(
            f"per-tensor settings ({', '.join(sorted(tensors))}) apply to MaxText's "
            f"remat_policy=custom, not {name!r}"
        )
    if name == "custom":
        given = dict(tensors or {})
        for tensor in given:
            if tensor not in MAXTEXT_TENSORS:
                raise N.unknown_value_error("MaxText custom-policy tensor", tensor, MAXTEXT_TENSORS)
        actions = {N.DECODER_LAYER_INPUT: "device", **given}
        actions = {t: _MAXTEXT_ACTIONS.get(a, a) for t, a in actions.items()}
        return custom_spec(actions)
    if name == "minimal":
        return _REGISTRY["minimal"]
    meant = MAXTEXT_POLICIES.get(name)
    if meant is None:
        raise N.unknown_value_error("MaxText remat_policy", name, MAXTEXT_POLICY_NAMES)
    source = f"MaxText remat_policy={name} (remat-kit: {meant})"
    if meant in _REGISTRY:
        return dataclasses.replace(_REGISTRY[meant], name=name, source=source)
    spec = custom_spec(_parse_tag_list(meant), name=name)
    return dataclasses.replace(spec, source=source)


def maxtext_config_lines(policy: str | PolicySpec | Mapping[str, str]) -> list[str]:
    """MaxText ``key=value`` config lines setting ``policy``: its ``remat_policy`` name, else
    ``remat_policy=custom`` and one line per tensor saved or offloaded
    (:func:`parse_maxtext_lines` reads them back)::

        >>> maxtext_config_lines("save-nothing")
        ['remat_policy=full']
        >>> maxtext_config_lines({"query_proj": "offload", "out_proj": "save"})[1:]
        ['decoder_layer_input=remat', 'out_proj=device', 'query_proj=offload']

    Raises:
      ValueError: a policy selecting by kind (``save-dots``, ``no-remat``: MaxText always
        remats its layers), or naming a tensor MaxText's ``custom`` has no setting for.
    """
    spec = get_policy_spec(policy)
    if spec.name in MAXTEXT_POLICY_NAMES and spec.name != "custom":
        if maxtext_spec(spec.name) == spec:
            return [f"remat_policy={spec.name}"]
    for name, meant in MAXTEXT_POLICIES.items():
        if _REGISTRY.get(meant) == spec:
            return [f"remat_policy={name}"]
    if spec.base != "names":
        raise ValueError(
            f"policy {policy_label(spec)!r} selects by kind ({spec.base}); MaxText's "
            f"remat_policy has no such setting (its names: {', '.join(MAXTEXT_POLICY_NAMES)})"
        )
    unknown = sorted(spec.tags - set(MAXTEXT_TENSORS))
    if unknown:
        raise ValueError(
            f"policy {policy_label(spec)!r} names {', '.join(unknown)}, which MaxText's "
            f"remat_policy=custom has no setting for (its tensors: {', '.join(MAXTEXT_TENSORS)})"
        )
    lines = [f"{t}={_TO_MAXTEXT_ACTIONS[spec.action(t)]}" for t in sorted(spec.tags)]
    if N.DECODER_LAYER_INPUT not in spec.tags:
        lines.insert(0, f"{N.DECODER_LAYER_INPUT}=remat")
    return ["remat_policy=custom", *lines]


def parse_maxtext_lines(lines: str | Sequence[str]) -> PolicySpec:
    """The policy of MaxText config lines (a list, or one string split at spaces, commas,
    newlines): ``remat_policy=NAME`` and, for ``custom``, ``TENSOR=device|offload|remat``.

    Raises:
      ValueError: no ``remat_policy``; a line not ``key=value``; as :func:`maxtext_spec`.
    """
    items = lines.replace(",", " ").split() if isinstance(lines, str) else list(lines)
    settings: dict[str, str] = {}
    for item in items:
        key, sep, value = (part.strip() for part in str(item).partition("="))
        if not sep or not key or not value:
            raise ValueError(f"cannot read MaxText line {item!r}: write key=value")
        settings[key] = value
    name = settings.pop("remat_policy", None)
    if name is None:
        raise ValueError(
            f"MaxText lines {' '.join(map(str, items))!r} set no remat_policy (e.g. "
            "remat_policy=minimal, or remat_policy=custom query_proj=device)"
        )
    return maxtext_spec(name, settings or None)


def _maxtext_meaning(policy: object) -> str | None:
    """A MaxText name's meaning in remat-kit, for the unknown-name error."""
    if policy == "custom":
        return (
            "MaxText's 'custom' takes its per-tensor settings: 'remat_policy=custom "
            "query_proj=device mlpwo=offload' (MaxText's config lines), or the per-tag spec "
            "'query_proj=save,mlpwo=offload' (device or save, offload, remat or recompute)."
        )
    meant = MAXTEXT_POLICIES.get(policy) if isinstance(policy, str) else None
    if meant is None and isinstance(policy, str):  # misspelt: MaxText's may be closest
        near = N.closest(policy, [*_REGISTRY, *MAXTEXT_POLICY_NAMES])
        if near is not None and near not in _REGISTRY:
            return (
                f"Did you mean MaxText's {near!r}? (MaxText's remat_policy names are taken "
                f"too: {', '.join(MAXTEXT_POLICY_NAMES)})"
            )
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
    """Registered policy names, in registry order."""
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


def _made_by(policy: Any, constructor: str) -> bool:
    """Whether ``policy`` is the closure ``jax.checkpoint_policies.<constructor>`` returns."""
    return getattr(policy, "__qualname__", "") == f"{constructor}.<locals>.policy"


def is_by_exclusion(policy: Any) -> bool:
    """Whether ``policy`` is ``jax.checkpoint_policies.save_any_names_but_these`` (a dataclass
    in jax 0.10, a closure in jax 0.12): what it keeps depends on the program."""
    return type(policy).__name__ == "SaveAnyNamesButThese" or _made_by(
        policy, "save_any_names_but_these"
    )


def excluded_names(policy: Any) -> frozenset[str]:
    """The names ``save_any_names_but_these`` leaves out; empty for any other policy."""
    if not is_by_exclusion(policy):
        return frozenset()
    names = getattr(policy, "names", None)
    if names is None:
        names = _closure(policy).get("names_not_to_save", ())
    return _names(names) or frozenset()


def read_jax_policy(
    policy: Callable[..., Any], emitted: Iterable[str] | None = None
) -> PolicySpec | None:
    """The :class:`PolicySpec` of a raw ``jax.checkpoint_policies`` policy, read from the data
    its constructor keeps (``jax/_src/ad_checkpoint.py``): the fixed policies, the
    ``save_only`` / ``save_and_offload_only_these_names`` sets, ``save_any_names_but_these``
    given ``emitted``. None for composed callables, lambdas and
    ``offload_dot_with_no_batch_dims``."""
    if is_by_exclusion(policy) and emitted is not None:
        excluded = excluded_names(policy)
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
    if saveable is None and _made_by(policy, "save_only_these_names"):
        saveable = _names(_closure(policy).get("names_which_can_be_saved"))
    if saveable is not None:
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
    """The :class:`PolicySpec` of a name, per-tag text (:func:`parse_policy_arg`), mapping,
    spec or raw jax policy (:func:`read_jax_policy`). ``emitted``: the program's checkpoint
    names (:func:`remat_kit.program_tags`), for ``save_any_names_but_these``.

    Raises:
      ValueError: an unknown name (listing the valid ones and the closest), a bad mapping
        (:func:`custom_spec`), a callable not readable as data, ``emitted`` not names.
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
        return parse_policy_arg(policy)
    if isinstance(policy, str) and policy.strip().lower() in ("none", "null"):
        raise ValueError(
            f"policy {policy!r}: jax.checkpoint(policy=None) / nn.remat(policy=None) saves "
            "nothing (full remat): that is 'save-nothing'; 'no-remat' is the opposite (no "
            "checkpoint, every residual kept)"
        )
    if isinstance(policy, str) and policy not in _REGISTRY:
        snake = policy.replace("-", "_")  # MaxText's names written with hyphens
        if snake in MAXTEXT_POLICIES:
            return maxtext_spec(snake)
    if not isinstance(policy, str) or policy not in _REGISTRY:
        raise N.unknown_value_error("policy", policy, policy_names(), _maxtext_meaning(policy))
    return _REGISTRY[policy]


def custom_spec(spec: Mapping[str, str], name: str = "custom") -> PolicySpec:
    """A :class:`PolicySpec` from ``{checkpoint_name: "save" | "offload" | "recompute"}``
    (MaxText's ``device`` / ``remat`` too); tags not listed are recomputed. Any name is
    accepted; :func:`check_tags` checks them against a program.

    Raises:
      ValueError: a tag not a non-empty string, or an unknown action (listing the valid ones).
    """
    save, offload = set(), set()
    spec = {t: _MAXTEXT_ACTIONS.get(a, a) if isinstance(a, str) else a for t, a in spec.items()}
    for tag, act in spec.items():
        N.validate_name(tag)
        if act not in TAG_ACTIONS:
            error = N.unknown_value_error("action", act, (*TAG_ACTIONS, *_MAXTEXT_ACTIONS))
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
    """Check every tag ``spec`` saves or offloads is in ``emitted`` (``program``: its name in
    the message).

    Raises:
      ValueError: a tag never emitted (it would be silently recomputed), naming the emitted
        names and the closest.
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
    """:func:`policies_for_tags`'s answer.

    Attributes:
      specs: the specs worth compiling, in order, without duplicates.
      restricted: ``(named spec, its cut-down custom spec)`` pairs.
      skipped: registered specs naming none of the emitted tags (they would run as
        ``save-nothing``).
    """

    specs: tuple[PolicySpec, ...]
    restricted: tuple[tuple[PolicySpec, PolicySpec], ...]
    skipped: tuple[PolicySpec, ...]

    def notes(
        self, program: str, named: bool = True, compiled: Iterable[PolicySpec] | None = None
    ) -> list[str]:
        """One line per restricted policy (``named=False``: without its name; only those in
        ``compiled`` when given) and one for the skipped ones."""
        kept = None if compiled is None else set(compiled)
        out = [
            f"{spec.name + ' ' if named else ''}names {', '.join(_missing(spec, cut))}, which "
            f"{program} does not emit: compiled as "
            f"{cut.description[len('Custom: ') :].rstrip('.')}"
            for spec, cut in self.restricted
            if kept is None or cut in kept
        ]
        if self.skipped:
            out.append(
                f"not compiled on {program}: {', '.join(s.name for s in self.skipped)} (they name "
                "none of its checkpoint names and would run as save-nothing)"
            )
        return out


def _missing(named: PolicySpec, cut: PolicySpec) -> list[str]:
    """The tags ``cut`` lost from ``named``, less the other MLP family's."""
    return sorted(t for t in named.tags - cut.tags if not N.MLP_ALTERNATES.get(t, set()) & cut.tags)


def policies_for_tags(
    policies: Iterable[str | PolicySpec | Mapping[str, str]], tags: Iterable[str]
) -> TagFit:
    """The policies that can act on a program emitting ``tags``: kind-based, user and fully
    emitted registered specs as given (the other MLP family, ``mlpwi`` / ``mlpwi_0``, counts
    as emitted); a registered spec naming some unemitted tags cut down, one naming none skipped.

    Raises:
      ValueError: as :func:`get_policy_spec`.
    """
    tags = frozenset(tags)
    specs, restricted, skipped = [], [], []
    for spec in dict.fromkeys(get_policy_spec(p, tags) for p in policies):
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
    """A :class:`PolicySpec` from a ``--policy`` value: a name, ``tag=action,...`` or JSON::

        >>> parse_policy_arg("query_proj=offload,out_proj=save").offload
        frozenset({'query_proj'})
        >>> parse_policy_arg('{"out_proj": "save"}') == custom_spec({"out_proj": "save"})
        True

    Raises:
      ValueError: an unknown name; as :func:`custom_spec`; unreadable text or JSON; a
        checkpoint name given twice.
    """
    text = str(text).strip()
    if "remat_policy=" in text:
        return parse_maxtext_lines(text)
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
    """A spec's name in tables (custom: ``custom: out_proj=save, query_proj=offload``)."""
    if spec.name != "custom":
        return spec.name
    parts = [f"{t}={spec.action(t)}" for t in sorted(spec.tags)]
    return "custom: " + (", ".join(parts) or "recompute all")


def cut_label(names: Sequence[str]) -> str:
    """The label of a cut-down spec (:func:`policies_for_tags`): ``minimal (cut)``."""
    return f"{', '.join(names)} (cut)"


def policy_arg(spec: PolicySpec) -> str:
    """The spec as ``--policy`` text (:func:`parse_policy_arg`), a sweep row's key;
    ``recompute-all`` when it keeps nothing."""
    if policy_specs().get(spec.name) == spec:
        return spec.name
    acts = {**{t: "save" for t in spec.save}, **{t: "offload" for t in spec.offload}}
    return ",".join(f"{t}={a}" for t, a in sorted(acts.items())) or "recompute-all"


def custom_policy(spec: Mapping[str, str]) -> Callable[..., Any]:
    """A ``jax.checkpoint`` policy from a per-tag mapping (``{"query_proj": "offload"}``).

    Raises:
      ValueError: see :func:`custom_spec`.
    """
    return custom_spec(spec).to_jax()


def policy(name: str | PolicySpec | Mapping[str, str]) -> Callable[..., Any]:
    """The ``policy=`` for ``jax.checkpoint`` / ``flax.linen.remat`` / ``flax.nnx.remat`` of a
    name, mapping or spec (``"no-remat"``: ``everything_saveable``).

    Raises:
      ValueError: unknown name (listing the valid ones and the closest).
    """
    return get_policy_spec(name).to_jax()


def describe(name: str | PolicySpec | Mapping[str, str]) -> str:
    """A policy's one-sentence description."""
    return get_policy_spec(name).description


def on_device_twin(spec: PolicySpec) -> PolicySpec:
    """``spec`` with its offloaded tags kept on device (to measure what an offload saves)."""
    return PolicySpec(
        f"{spec.name} (on device)",
        f"{spec.name} keeping its offloaded tensors on device.",
        save=spec.save | spec.offload,
        source=f"on-device counterpart of {spec.name}",
    )


#: JAX's remat implementations: ``remat2`` and ``jax_remat3``.
RematImplementation = Literal["classic", "remat3"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(RematImplementation)

#: Probe keys of the dots policies.
WEIGHT_MATMUL = "<weight matmul>"
BATCHED_MATMUL = "<batched matmul>"


def remat3_flag() -> bool | None:
    """``jax.config.jax_remat3``, or None in a JAX without it."""
    try:
        return bool(jax.config.jax_remat3)
    except AttributeError:
        return None


def remat_implementation() -> RematImplementation:
    """The remat implementation ``jax.checkpoint`` traces with now, read from a traced jaxpr
    (not the flag).

    Raises:
      RuntimeError: a jaxpr of neither kind (a JAX this module does not know).
    """
    return _implementation(remat3_flag(), jax.__version__)


@functools.lru_cache(maxsize=8)
def _implementation(flag: bool | None, version: str) -> RematImplementation:
    eqn = jax.make_jaxpr(jax.checkpoint(jnp.sin))(0.0).jaxpr.eqns[0]
    if eqn.primitive.name in ("remat2", "checkpoint", "remat"):
        return "classic"
    if "RematTraced" in type(eqn.params.get("_prim")).__name__:
        return "remat3"
    raise RuntimeError(
        f"jax {version}: jax.checkpoint traced to {eqn.primitive.name!r}, neither the classic "
        "remat (remat2) nor jax_remat3 (RematTraced); remat-kit does not know this JAX"
    )


@contextlib.contextmanager
def using(implementation: RematImplementation) -> Iterator[None]:
    """Trace under ``implementation`` inside the block (this thread only).

    Raises:
      ValueError: an unknown implementation, or no ``jax_remat3`` flag to switch.
    """
    if implementation not in IMPLEMENTATIONS:
        raise N.unknown_value_error("remat implementation", implementation, IMPLEMENTATIONS)
    if implementation == remat_implementation():
        yield
        return
    from jax._src import config as jax_config

    state = getattr(jax_config, "remat3", None)
    if state is None:
        raise ValueError(
            f"jax {jax.__version__} has no jax_remat3 flag: only the "
            f"{remat_implementation()!r} remat implementation can be traced"
        )
    with state(implementation == "remat3"):
        yield


@functools.cache
def _remat3_asks_callables(version: str) -> bool:
    def body(w, x):  # w [8, 8], x [2, 8]
        return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x @ w), N.QUERY_PROJ)))

    def plain(prim, *_, **params):
        return params.get("name") == N.QUERY_PROJ

    args = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((2, 8), jnp.float32))
    with using("remat3"):
        kept = saved_residuals(jax.checkpoint(body, policy=plain), *args)
    return any(r.tag == N.QUERY_PROJ and not r.is_argument for r in kept)


def remat3_asks_any_policy() -> bool:
    """Whether ``jax_remat3`` honours *any* policy callable (jax 0.12), not only those it reads
    as data (jax 0.10, others run as full remat); False without ``jax_remat3``. From a probe,
    once per JAX version."""
    if remat3_flag() is None:
        return False
    return _remat3_asks_callables(jax.__version__)


def describe_implementation(implementation: RematImplementation | None = None) -> str:
    """``"jax_remat3 (jax X.Y.Z)"`` or ``"classic remat (jax X.Y.Z)"``."""
    impl = implementation or remat_implementation()
    return f"{'jax_remat3' if impl == 'remat3' else 'classic remat'} (jax {jax.__version__})"


@dataclasses.dataclass(frozen=True)
class PolicyEffect:
    """What one policy does under one remat implementation, from a traced probe.

    Attributes:
      promised, observed: per probe key (a checkpoint name, or :data:`WEIGHT_MATMUL` /
        :data:`BATCHED_MATMUL`): ``save`` / ``offload`` / ``recompute``.
      runs_as: ``"as named"``, else the registered name or per-tag label of what it does.
      cause, fix: None when as named.
    """

    policy: str
    implementation: RematImplementation
    jax_version: str
    promised: Mapping[str, str]
    observed: Mapping[str, str]
    runs_as: str
    cause: str | None = None
    fix: str | None = None

    @property
    def as_named(self) -> bool:
        return self.runs_as == "as named"

    def line(self) -> str | None:
        """What it runs as, the cause, the fix, on one line (None when as named)."""
        if self.as_named:
            return None
        runs_as = "save-nothing (full remat)" if self.runs_as == "save-nothing" else self.runs_as
        return (
            f"policy {self.policy!r} runs as {runs_as} under "
            f"{describe_implementation(self.implementation)}: {self.cause}; fix: {self.fix}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "as_named": self.as_named, "line": self.line()}


def _probe_keys(spec: PolicySpec) -> list[str]:
    if spec.base in ("dots", "dots_no_batch"):
        return [WEIGHT_MATMUL, BATCHED_MATMUL]
    return sorted(spec.tags) or [N.QUERY_PROJ]  # saved by nothing: must be recomputed


def _promised(spec: PolicySpec) -> dict[str, str]:
    if spec.base == "dots":
        return {WEIGHT_MATMUL: "save", BATCHED_MATMUL: "save"}
    if spec.base == "dots_no_batch":
        return {WEIGHT_MATMUL: "save", BATCHED_MATMUL: "recompute"}
    if spec.base == "everything":
        return {k: "save" for k in _probe_keys(spec)}
    return {k: spec.action(k) for k in _probe_keys(spec)}


def _probe(spec: PolicySpec):
    """A checkpointed loss emitting ``spec``'s names (each on its own [2, 4, 8] value made by a
    weight matmul) and ending in a batched matmul ([2, 4, 4]); its abstract arguments."""
    tags = [] if spec.base in ("dots", "dots_no_batch") else _probe_keys(spec)
    n = max(1, len(tags))

    def body(w, x):  # w [n, 8, 8], x [2, 4, 8]
        h = x
        for i in range(n):
            y = jnp.sin(h @ w[i])  # [2, 4, 8]
            if tags:
                y = checkpoint_name(y, tags[i])
            h = h + jnp.tanh(y)
        s = jnp.einsum("bij,bkj->bik", h, h)  # batched matmul, [2, 4, 4]
        return jnp.sum(jnp.sin(s))

    loss = jax.checkpoint(body, policy=spec.to_jax()) if spec.wrap else body
    args = (
        jax.ShapeDtypeStruct((n, 8, 8), jnp.float32),
        jax.ShapeDtypeStruct((2, 4, 8), jnp.float32),
    )
    return loss, args


def _observed(spec: PolicySpec) -> dict[str, str]:

    loss, args = _probe(spec)
    kept = [r for r in saved_residuals(loss, *args) if not r.is_argument]
    out = {}
    for key in _probe_keys(spec):
        if key == WEIGHT_MATMUL:
            rows = [r for r in kept if r.source.startswith("dot_general") and r.shape == (2, 4, 8)]
        elif key == BATCHED_MATMUL:
            rows = [r for r in kept if r.source.startswith("dot_general") and r.shape == (2, 4, 4)]
        else:
            rows = [r for r in kept if r.tag == key]
        out[key] = "recompute" if not rows else "offload" if rows[0].memory == "host" else "save"
    return out


def _runs_as(spec: PolicySpec, observed: Mapping[str, str]) -> str:
    if all(v == "recompute" for v in observed.values()):
        return "save-nothing"
    if spec.base != "names":
        return ", ".join(f"{k}={v}" for k, v in observed.items())
    actions = {k: v for k, v in observed.items() if v != "recompute"}
    same = custom_spec(actions)
    for name, other in policy_specs().items():
        if other.base == "names" and (other.save, other.offload) == (same.save, same.offload):
            return name
    return policy_label(same)


def _cause_and_fix(spec: PolicySpec, implementation: str, observed: Mapping[str, str]):
    lost_offload = any(spec.action(t) == "offload" and observed.get(t) != "offload"
                       for t in spec.offload)  # fmt: skip
    twin = custom_spec({t: "save" for t in spec.save | spec.offload})
    twin_name = next((n for n, s in policy_specs().items() if s.base == "names"
                      and s.save == twin.save and not s.offload), policy_label(twin))  # fmt: skip
    other = "classic remat" if implementation == "remat3" else "jax_remat3"
    flag = "False" if implementation == "remat3" else "True"
    if implementation == "remat3" and lost_offload:
        cause = (
            "there save_and_offload_only_these_names is a closure, which jax_remat3 cannot read "
            "as data and runs as full remat (host bytes 0; JAX offloads under jax_remat3 from "
            "jax 0.11.0)"
        )
        fix = (
            "jax.config.update('jax_remat3', False) (or JAX_REMAT3=0) before tracing, keep the "
            f"tensors on device with '{twin_name}', or use jax >= 0.11.0"
        )
    else:
        cause = (
            f"{describe_implementation(implementation)} does not apply this policy as written "
            "(the saved residuals of a traced probe differ from its promise)"
        )
        fix = (
            f"trace under {other} (jax.config.update('jax_remat3', {flag})) or build the policy "
            "from name sets (remat_kit.custom_policy)"
        )
    return cause, fix


@functools.lru_cache(maxsize=256)
def _effect(spec: PolicySpec, implementation: str, version: str) -> PolicyEffect:
    promised = _promised(spec)
    if not spec.wrap:  # no remat segment at all (no-remat): no implementation reads it
        return PolicyEffect(policy_label(spec), implementation, version, promised, promised,  # type: ignore[arg-type]
                            "as named")  # fmt: skip
    with using(implementation):  # type: ignore[arg-type]
        observed = _observed(spec)
    label = policy_label(spec)
    if observed == promised:
        return PolicyEffect(label, implementation, version, promised, observed, "as named")  # type: ignore[arg-type]
    cause, fix = _cause_and_fix(spec, implementation, observed)
    return PolicyEffect(
        label,
        implementation,
        version,
        promised,
        observed,
        _runs_as(spec, observed),
        cause,
        fix,  # type: ignore[arg-type]
    )


def policy_effect(
    policy: str | PolicySpec | Mapping[str, str],
    implementation: RematImplementation | None = None,
) -> PolicyEffect:
    """What ``policy`` does under ``implementation`` (default: in use): a tiny checkpointed probe's
    :func:`remat_kit.walker.saved_residuals` against the promise; cached. docs/remat3.md.

    Raises:
      ValueError: an unknown policy name, or an implementation this JAX cannot trace with.
    """
    spec = get_policy_spec(policy)
    impl = implementation or remat_implementation()
    return _effect(spec, impl, jax.__version__)


def offload_works(implementation: RematImplementation | None = None) -> bool:
    """Whether a name-based offload reaches host memory under ``implementation``."""
    return policy_effect(custom_spec({N.QUERY_PROJ: "offload"}), implementation).as_named


def can_offload(target: Any) -> bool:
    """Whether ``target`` supports host offload and the remat implementation in use offloads."""
    return bool(target.supports_host_offload) and offload_works()


def honoured(specs: Iterable[PolicySpec]) -> tuple[list[PolicySpec], list[str]]:
    """The specs that run as named now, and a :meth:`PolicyEffect.line` for each that does not."""
    kept, notes = [], []
    for spec in specs:
        effect = policy_effect(spec)
        if effect.as_named:
            kept.append(spec)
        else:
            notes.append(f"not considered: {effect.line()}")
    return kept, notes
