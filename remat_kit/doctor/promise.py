"""What a policy promises: read from a remat-kit policy or from a raw ``jax.checkpoint`` policy
built with JAX's constructors, whatever its names, and what ``jax_remat3`` makes of it.

JAX's constructors keep their name sets and memory kinds where they can be read back, as
dataclass fields or closure cells depending on the version (``jax/_src/ad_checkpoint.py``;
:mod:`remat_kit.policies` reads every layout). Which policies ``jax_remat3`` honours depends on
the JAX in use (:func:`remat_kit.policies.remat3_asks_any_policy`, a traced probe;
docs/remat3.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from remat_kit.doctor.findings import Finding
from remat_kit.policies import (
    PolicySpec,
    describe_implementation,
    excluded_names,
    get_policy_spec,
    is_by_exclusion,
    offload_works,
    policy_effect,
    read_jax_policy,
    remat3_asks_any_policy,
)
from remat_kit.validation import closest


@dataclasses.dataclass(frozen=True)
class Promise:
    """A policy's promise in the terms the doctor checks: tags kept on device (``save``), tags
    moved to host (``offload``), or a base rule (``everything``, ``dots``, ``dots_no_batch``,
    ``names``); ``wrap`` False for no remat at all. Unlike :class:`PolicySpec`, names are any
    strings (a user's own tags, typos included)."""

    name: str
    base: str = "names"
    save: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    wrap: bool = True
    registered: bool = False  # a remat-kit registry policy (names both MLP families' tags)
    offloads_dots: bool = False  # offload_dot_with_no_batch_dims
    by_exclusion: bool = False  # save_any_names_but_these: the names are the program's rest

    @property
    def tags(self) -> frozenset[str]:
        return self.save | self.offload

    @property
    def offloads(self) -> bool:
        return bool(self.offload) or self.offloads_dots

    @classmethod
    def of(cls, spec: PolicySpec, registered: bool = False) -> Promise:
        return cls(spec.name, spec.base, spec.save, spec.offload, spec.wrap, registered)


def _saves_everything() -> Finding:
    return Finding(
        "saves-everything", "error",
        "save_anything_except_these_names saves every value: nothing is recomputed.",
        "a JAX regression: the policy returns True for everything (jax/_src/ad_checkpoint.py).",
        "list what to save with save_only_these_names, or use remat_kit.custom_policy.",
    )  # fmt: skip


def _composed(qual: str) -> Finding:
    on = jax.config.jax_remat3
    if remat3_asks_any_policy():  # jax_remat3 calls it, but only at names and matmuls
        return Finding(
            "composed-policy", "warning",
            f"policy {qual!r} is a callable remat-kit cannot read as data: it is judged by "
            "what it does.",
            f"{remat3_rule()} A callable that saves other values (elementwise outputs) "
            "keeps them under classic remat only" + (" — and jax_remat3 is on." if on else "."),
            "build the policy from name sets: remat_kit.custom_policy({...}) or "
            "jax.checkpoint_policies.save_only_these_names(...).",
        )  # fmt: skip
    return Finding(
        "composed-policy", "error" if on else "warning",
        f"policy {qual!r} is a callable JAX cannot read as data.",
        "JAX's newer remat implementation (jax_remat3) treats policies as data and runs such "
        "callables (save_from_both_policies, lambdas) as full remat"
        + (" — and jax_remat3 is on." if on else "."),
        "build the policy from name sets: remat_kit.custom_policy({...}) or "
        "jax.checkpoint_policies.save_only_these_names(...).",
    )  # fmt: skip


def _remat3_has_conv_rule() -> bool:
    """Whether jax_remat3 has a rule for convolutions (``remat.rules``; jax 0.12), which asks the
    policy at them as at matmuls; without one a convolution is recomputed."""
    try:
        from jax._src.interpreters import remat
        from jax._src.lax import convolution
    except ImportError:
        return False
    return convolution.conv_general_dilated_p in getattr(remat, "rules", {})


def remat3_rule() -> str:
    """What this JAX's ``jax_remat3`` does with a policy, in one sentence (the cause the
    findings about it give; see :func:`remat_kit.policies.remat3_asks_any_policy`)."""
    if remat3_asks_any_policy():
        offload = (
            "keeps or offloads what it answers"
            if offload_works("remat3")
            else "keeps what it answers (offloading nothing to host)"
        )
        convs = " and convolutions" if _remat3_has_conv_rule() else ""
        return (
            f"jax_remat3 (jax {jax.__version__}) asks any policy only at checkpoint_name "
            f"values and matmuls{convs} and {offload}; every other value is recomputed."
        )
    return (
        f"jax_remat3 (jax {jax.__version__}) applies policies only at checkpoint_name values "
        "(save_only_these_names, save_any_names_but_these, everything_saveable) and matmuls "
        "(dots policies); save_and_offload_only_these_names, offload_dot_with_no_batch_dims and "
        "composed callables recompute everything."
    )


def describe_callable(policy: Callable[..., Any]) -> tuple[Promise | None, list[Finding]]:
    """The :class:`Promise` of a raw ``jax.checkpoint_policies`` policy, read from the data
    JAX's constructors keep (every name, known to remat-kit or not), plus findings about the
    callable itself; ``(None, findings)`` for a callable that cannot be read."""
    qual = getattr(policy, "__qualname__", type(policy).__name__)
    spec = read_jax_policy(policy)  # the fixed policies and the name-set constructors
    if spec is not None:
        return Promise.of(spec), []
    if is_by_exclusion(policy):
        return None, []  # data remat3 reads; what it keeps depends on the names emitted
    if qual.startswith("save_anything_except_these_names"):
        return None, [_saves_everything()]
    if qual.startswith("offload_dot_with_no_batch_dims"):
        return Promise("offload_dot_with_no_batch_dims", "dots_no_batch", offloads_dots=True), []
    return None, [_composed(qual)]


def promise_of_exclusions(policy: Callable[..., Any], emitted: frozenset[str]) -> Promise | None:
    """The :class:`Promise` of ``save_any_names_but_these(*names)`` on a program that emits
    ``emitted``: it saves every emitted name but those (``SaveAnyNamesButThese.names``,
    jax/_src/ad_checkpoint.py), so it is judged as the name set it amounts to (the per-tag
    mapping ``{name: "save"}`` of the rest). None for any other policy."""
    if not is_by_exclusion(policy):
        return None
    excluded = excluded_names(policy)
    return Promise(
        "save_any_names_but_these", save=frozenset(emitted) - excluded, by_exclusion=True
    )


def excluded_unknown(policy: Callable[..., Any], emitted: frozenset[str]) -> list[Finding]:
    """``unknown-tag`` for the names ``save_any_names_but_these`` leaves out that the program
    never emits: nothing is recomputed for them (a typo saves what it meant to recompute)."""
    if not is_by_exclusion(policy):
        return []
    missing = sorted(excluded_names(policy) - frozenset(emitted))
    if not missing:
        return []
    listed = ", ".join(
        f"{t!r}" + (f" (closest: {h!r})" if (h := closest(t, sorted(emitted))) else "")
        for t in missing
    )
    return [
        Finding(
            "unknown-tag", "error",
            f"policy 'save_any_names_but_these' leaves out {listed}, which the program never "
            f"emits (emitted: {', '.join(sorted(emitted)) or 'none'}): leaving "
            f"{'it' if len(missing) == 1 else 'them'} out recomputes nothing.",
            "a typo, or a tensor the program does not tag.",
            _excluded_fix(missing, emitted),
        )
    ]  # fmt: skip


def _excluded_fix(missing: list[str], emitted: frozenset[str]) -> str:
    """``use 'attn_scores'`` where each name left out has a closest emitted one, as the
    ``unknown-tag`` fix of a per-tag spec says; else which names there are."""
    meant = [closest(t, sorted(emitted)) for t in missing]
    if all(meant):
        pairs = ", ".join(f"{m!r} for {t!r}" for t, m in zip(missing, meant, strict=True))
        return f"use {pairs} in save_any_names_but_these(...)."
    return "leave out names the program emits (the emitted names above)."


def remat3_honours(policy: Callable[..., Any]) -> bool:
    """Whether ``jax_remat3`` applies ``policy`` as written, by the rule of the JAX installed.
    Its remat rules (``jax/_src/interpreters/remat.py`` ``rules``) consult a policy only at
    ``checkpoint_name`` values (``CheckpointName.remat``) and at ``dot_general``
    (``lax._dot_general_remat``). Where it asks any policy
    (:func:`remat_kit.policies.remat3_asks_any_policy`) every policy of
    ``jax.checkpoint_policies`` is applied, an offloading one where offload works under remat3
    (:func:`remat_kit.policies.offload_works`), and an opaque callable is judged by what it does;
    elsewhere only the policies it reads as data are, the rest running as full remat."""
    cp = jax.checkpoint_policies
    if policy is cp.everything_saveable or policy is cp.nothing_saveable:
        return True
    if remat3_asks_any_policy():
        spec = read_jax_policy(policy)
        offloads = (spec is not None and spec.offloads) or getattr(
            policy, "__qualname__", ""
        ).startswith("offload_dot_with_no_batch_dims")
        return not offloads or offload_works("remat3")
    return type(policy).__name__ in ("SaveOnlyTheseNames", "SaveAnyNamesButThese", "DotsSaveable")


def remat3_finding(name: str, promise: Promise | None) -> Finding:
    """The error for a policy that ``jax_remat3`` (on) runs as full remat."""
    what = "offloads nothing to host (host bytes 0) and " if promise and promise.offloads else ""
    return Finding(
        "remat3-full-remat", "error",
        f"policy {name!r} runs as full remat under jax_remat3: it {what}recomputes everything "
        "it promised to keep.",
        remat3_rule(),
        "turn jax_remat3 off (jax.config.update('jax_remat3', False)) for offload policies, "
        "or save the tensors on device with save_only_these_names.",
    )  # fmt: skip


def resolve_policy(
    policy: str | PolicySpec | Mapping[str, str] | Callable[..., Any],
    emitted: frozenset[str] | None = None,
) -> PolicySpec:
    """:func:`remat_kit.get_policy_spec`, with ``"none"`` explained: ``policy=None`` in
    ``jax.checkpoint`` / ``nn.remat`` saves nothing. ``emitted``: the program's
    ``checkpoint_name`` values (``save_any_names_but_these`` is read against them).

    Raises:
      ValueError: ``"none"`` (use ``save-nothing``; ``no-remat`` is the opposite, it saves
        everything), or an unknown policy name.
    """
    return get_policy_spec(policy, emitted)


def effect_findings(name: str, spec: PolicySpec, promise: Promise | None) -> list[Finding]:
    """The error for a remat-kit policy that the remat implementation in use does not apply as
    named, from :func:`remat_kit.policies.policy_effect` (a traced probe); ``[]`` when it
    does. Code ``remat3-full-remat`` when ``jax_remat3`` runs it as full remat, else
    ``runs-as-other``."""
    effect = policy_effect(spec)
    if effect.as_named:
        return []
    full = effect.runs_as == "save-nothing"
    lost = "offloads nothing to host (host bytes 0) and " if promise and promise.offloads else ""
    what = (
        f"policy {name!r} runs as {'full remat' if full else effect.runs_as} under "
        f"{describe_implementation(effect.implementation)}: it {lost}does not keep what it "
        "promised."
    )
    code = "remat3-full-remat" if full and effect.implementation == "remat3" else "runs-as-other"
    return [Finding(code, "error", what, str(effect.cause), str(effect.fix))]


def remat3_findings(name: str, jax_policy: Callable[..., Any], promise: Promise | None) -> list:
    """``[remat3_finding(...)]`` when ``jax_remat3`` is on and runs ``jax_policy`` as full remat,
    else ``[]``."""
    if jax.config.jax_remat3 and not remat3_honours(jax_policy):
        return [remat3_finding(name, promise)]
    return []
