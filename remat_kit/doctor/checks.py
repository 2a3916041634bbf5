"""The doctor's entry points: :func:`check` (a bundled model), :func:`check_policies` (several
policies of one model, no-remat compiled once) and :func:`check_function` (a user's function)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_kit import residuals as R
from remat_kit import targets as T
from remat_kit import walker as W
from remat_kit.doctor.compare import Residuals, check_remat_static_argnums, compare
from remat_kit.doctor.findings import Finding, dedupe, sort_findings
from remat_kit.doctor.programs import check_program
from remat_kit.doctor.promise import (
    Promise,
    describe_callable,
    effect_findings,
    remat3_findings,
    resolve_policy,
)
from remat_kit.doctor.tags import (
    TagFacts,
    matmul_tags,
    no_remat_segment,
    policy_not_passed,
    recompute_savers,
    tag_facts,
    unknown_tags,
)
from remat_kit.memory import analyze, analyze_policies, hlo
from remat_kit.models.config import ModelConfig, get_config
from remat_kit.models.transformer import make_model
from remat_kit.policies import PolicySpec, policy_label, policy_names
from remat_kit.program import Program, factory_reach
from remat_kit.training.step import init_params
from remat_kit.walker import has_remat


def recomputed_ops(fn: Callable[..., Any], args: Sequence[Any], target: T.Target) -> int:
    """Operations of ``fn``'s compiled program for ``target`` that recompute the forward pass
    (:func:`remat_kit.memory.hlo.count_recomputed_ops`). 0 when XLA merged the recomputation
    away (CSE)."""
    sharding = T.abstract_sharding(target)
    abstract = [T.abstractify(a, sharding) for a in args]
    text = jax.jit(fn).lower(*abstract).compile().as_text()
    return hlo.count_recomputed_ops(hlo.parse_hlo_module(text))


def check(
    config: ModelConfig | str | Program,
    batch_size: int = 2,
    seq_len: int = 64,
    policy: str | PolicySpec | Mapping[str, str] | None = None,
    target: str | T.Target = "cpu",
    optimizer: str = "adamw",
) -> list[Finding]:
    """Check a policy on a bundled model (a preset or a :class:`ModelConfig`).

    Compiles two steps for ``target`` (the policy and ``no-remat``; shared setup, concurrently)
    and traces one remat segment's residuals under each.

    Args:
      config: preset name or config; its ``scan_layers`` / ``remat_group_size`` are used. Or a
        user's :class:`~remat_kit.program.Program` (``batch_size`` / ``seq_len`` then do not
        apply: ``check(program, policy="save-nothing", target="h100-sxm")``; see
        :func:`remat_kit.doctor.programs.check_program`).
      batch_size, seq_len: the step's shape ([batch, seq] tokens).
      policy: policy name, spec or custom mapping (default, None: the config's policy).
      target: compile target name.
      optimizer: ``adamw``, ``sgd`` or ``adafactor``.

    Returns:
      The findings, errors first; empty when the policy does what it promises.

    Raises:
      ValueError: unknown preset, policy or target; bad shapes; the policy name ``"none"``
        (the message says it means ``save-nothing``).
    """
    if isinstance(config, Program):
        if policy is None:
            raise ValueError(
                f"check(program): give policy= to check on {config.name!r}, or use "
                "check_program_policies(program, target=...) for the policies that act on it"
            )
        return check_program(config, [policy], target)[0]
    if isinstance(config, str):
        config = get_config(config)
    chosen = policy if policy is not None else config.remat_policy
    return check_policies(config, batch_size, seq_len, [chosen], target, optimizer)[0]


def check_policies(config: ModelConfig | str | Program, *args: Any, **kwargs: Any):
    """:func:`check` for several policies, compiling ``no-remat`` once:
    ``check_policies(config, batch_size, seq_len, policies, target, optimizer)`` for a bundled
    model, ``check_policies(program, policies, target)`` for a user's program
    (:func:`~remat_kit.doctor.programs.check_program`; ``policies=None``: the registered
    policies that act on its checkpoint names, see
    :func:`~remat_kit.doctor.programs.check_program_policies` for their labels and notes).

    Returns:
      One list of findings per policy, in order.
    """
    if isinstance(config, Program):
        return check_program(config, *args, **kwargs)
    return _check_model_policies(config, *args, **kwargs)


def _check_model_policies(
    config: ModelConfig | str,
    batch_size: int,
    seq_len: int,
    policies: Sequence[str | PolicySpec | Mapping[str, str]],
    target: str | T.Target = "cpu",
    optimizer: str = "adamw",
) -> list[list[Finding]]:
    """:func:`check` for several policies of one model, compiling ``no-remat`` once.

    Returns:
      One list of findings per policy, in order.

    Raises:
      ValueError: as :func:`check`.
    """
    if isinstance(config, str):
        config = get_config(config)
    specs = [resolve_policy(p) for p in policies]
    tgt = T.get_target(target)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    tags = W.emitted_tags(lambda p, t: make_model(config).apply({"params": p}, t), params, tokens)
    facts = TagFacts(frozenset(tags))  # the bundled models tag inside their remat segments
    reports = analyze_policies(config, batch_size, seq_len, [*specs, "no-remat"], tgt, optimizer)
    base = config.replace(remat_policy="no-remat")
    kept_base = Residuals.of(R.block_residuals(base, batch_size, seq_len))
    registered = set(policy_names())
    out = []
    for spec, report in zip(specs, reports, strict=False):
        promise = Promise.of(spec, registered=spec.name in registered)
        promise = dataclasses.replace(promise, name=policy_label(spec))  # as the CLI prints it
        kept = Residuals.of(
            R.block_residuals(config.replace(remat_policy=spec), batch_size, seq_len)
        )
        findings = (
            unknown_tags(promise, facts)
            + effect_findings(spec.name, spec, promise)
            + compare(
                promise,
                report,
                reports[-1],
                kept,
                kept_base,
                tgt,
                config.scan_layers,
                facts=facts,
            )  # fmt: skip
        )
        out.append(sort_findings(dedupe(findings)))
    return out


def check_function(
    make_loss: Callable[[Callable[..., Any] | None], Callable[..., Any]],
    *args: Any,
    policy: str | PolicySpec | Mapping[str, str] | Callable[..., Any] | None,
    target: str | T.Target = "cpu",
    remat_static_argnums: Sequence[int] | None = None,
    remat_call_args: Sequence[Any] = (),
    argnums: int | Sequence[int] | None = None,
) -> list[Finding]:
    """Check a policy on a user's own function.

    Args:
      make_loss: ``make_loss(jax_policy) -> loss(*args) -> scalar``: builds the user's loss with
        ``jax.checkpoint`` / ``nn.remat`` under the given ``jax.checkpoint`` policy.
      *args: the loss's arguments (arrays or ``jax.ShapeDtypeStruct``).
      policy: a remat-kit policy (name, spec, mapping), a raw ``jax.checkpoint_policies``
        policy (its names read back whatever they are), or None: as in ``jax.checkpoint``,
        save nothing.
      target: compile target name.
      remat_static_argnums, remat_call_args: the ``static_argnums`` given to ``nn.remat`` and
        the positional arguments of one call of the module (without ``self``), to check the
        off-by-one of ``self`` (:func:`check_remat_static_argnums`).
      argnums: the arguments to differentiate (default: every argument whose arrays are all
        floating point; integer token arrays and other non-differentiable inputs are not).

    Returns:
      The findings, errors first.

    Raises:
      ValueError: unknown policy name or target.
    """
    tgt = T.get_target(target)
    promise, findings, jax_policy = _read_policy(policy)
    loss = make_loss(jax_policy)
    jaxpr = jax.make_jaxpr(loss)(*args).jaxpr
    if not has_remat(jaxpr):  # the policy is never applied: nothing else to say about it
        return [no_remat_segment(promise.name if promise else "custom-callable", "make_loss")]
    reach = factory_reach(make_loss, args, "make_loss")  # the judgement analyze makes
    if not reach.passes:  # remat segments of the model's own, none taking the policy
        label = promise.name if promise else "custom-callable"
        return [policy_not_passed(label, "make_loss", reach.segments)]
    if remat_static_argnums is not None:
        findings += check_remat_static_argnums(remat_static_argnums, remat_call_args)
    loss_all = make_loss(jax.checkpoint_policies.everything_saveable)
    losses = {"policy": loss, "no-remat": loss_all}
    facts = tag_facts(losses["policy"], *args, emitted=W.emitted_tags(loss_all, *args))
    facts = dataclasses.replace(
        facts, savers=_savers(make_loss, args, facts.in_remat or (), matmul_tags(jaxpr))
    )
    nums = _float_argnums(args) if argnums is None else argnums
    grads = {k: jax.value_and_grad(f, argnums=nums) for k, f in losses.items()}
    reports = {k: analyze(g, *args, target=tgt, name=k, policy=k) for k, g in grads.items()}
    opaque = promise is None
    if opaque:  # an opaque callable: judge by what it does, against no-remat
        promise = Promise("custom-callable")
    else:
        findings += unknown_tags(promise, facts)
    if policy is None or (callable(policy) and not isinstance(policy, PolicySpec)):
        findings += remat3_findings(promise.name, jax_policy, promise)  # a raw JAX policy
    else:  # a remat-kit policy: what the implementation in use makes of it, from a probe
        findings += effect_findings(promise.name, resolve_policy(policy), promise)
    ops = None
    if not reports["no-remat"].flops:  # no counted FLOPs to tell recomputation by
        ops = recomputed_ops(grads["policy"], args, tgt)
    findings += compare(
        promise, reports["policy"], reports["no-remat"],
        Residuals.of(R.saved_residuals(losses["policy"], *args)),
        Residuals.of(R.saved_residuals(loss_all, *args)), tgt, recomputed_ops=ops, facts=facts,
    )  # fmt: skip
    if opaque:
        findings = [f for f in findings if f.code != "acts-as-full-remat"]
        findings += _opaque_full_remat(make_loss, jax_policy, args)
    return sort_findings(dedupe(findings))


def _read_policy(policy):
    """(promise or None for an opaque callable, findings about the callable, jax policy)."""
    if policy is None:  # as in jax.checkpoint: save nothing
        policy = jax.checkpoint_policies.nothing_saveable
    if callable(policy) and not isinstance(policy, PolicySpec):
        promise, findings = describe_callable(policy)
        return promise, findings, policy
    spec = resolve_policy(policy)
    return Promise.of(spec, registered=spec.name in policy_names()), [], spec.to_jax()


def _savers(make_loss, args: Sequence[Any], tags: frozenset[str], matmuls: frozenset[str]):
    """:attr:`TagFacts.savers` for a user's function: each name saved alone, on demand."""

    def saving(tag: str):
        policy = jax.checkpoint_policies.save_only_these_names(tag)
        return R.saved_residuals(make_loss(policy), *args)

    return functools.cache(lambda: recompute_savers(saving, tags, matmuls))


def _float_argnums(args: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the arguments whose array leaves are all floating point.

    Raises:
      ValueError: no argument is (nothing to differentiate).
    """
    nums = tuple(
        i
        for i, a in enumerate(args)
        if jax.tree.leaves(a)
        and all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(a))
    )
    if not nums:
        raise ValueError(
            "no floating-point argument to differentiate: pass the parameters (float arrays) "
            "among the loss's arguments, or argnums="
        )
    return nums


def _residuals_withremat3_findings(make_loss, policy, args, remat3: bool) -> Residuals:
    saved = jax.config.jax_remat3
    jax.config.update("jax_remat3", remat3)
    try:
        return Residuals.of(R.saved_residuals(make_loss(policy), *args))
    finally:
        jax.config.update("jax_remat3", saved)


def _opaque_full_remat(make_loss, policy, args) -> list[Finding]:
    """An opaque callable promises what classic remat (which calls it) keeps; find whether the
    remat implementation in use keeps less, i.e. runs it as full remat."""
    classic = _residuals_withremat3_findings(make_loss, policy, args, False)
    current = _residuals_withremat3_findings(make_loss, policy, args, jax.config.jax_remat3)
    nothing = _residuals_withremat3_findings(
        make_loss, jax.checkpoint_policies.nothing_saveable, args, False
    )
    kept = lambda r: r.device_bytes + r.host_bytes  # noqa: E731
    if kept(classic) > kept(nothing) and kept(current) <= kept(nothing):
        return [
            Finding(
                "acts-as-full-remat", "error",
                f"the policy keeps {kept(classic)} residual bytes under classic remat but "
                f"{kept(current)} under jax_remat3: it runs as full remat (save-nothing).",
                "jax_remat3 reads policies as data and runs callables it cannot read as full "
                "remat.",
                "build the policy from name sets: remat_kit.custom_policy({...}).",
            )
        ]  # fmt: skip
    return []
