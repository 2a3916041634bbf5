"""``remat-kit doctor``: catch the rematerialization failures that raise nothing today.

A remat policy that does not do what it promises fails silently: memory simply does not go down.
:func:`check` compares the promise (tags to save, to offload, the rest recomputed) with what
happens: the tags present in the traced program, the saved residuals by tag and memory kind (from
the jaxpr), and the compiled memory and FLOPs of the step against the same step compiled with
``no-remat`` and with ``save-nothing``. Each :class:`Finding` is one line: what is wrong, the likely
cause, the fix.

Finding codes (severity):

- ``unknown-tag`` (error): the policy names a checkpoint name the program never emits; it saves
  or offloads nothing for it.
- ``no-op-policy`` (error): the compiled step needs as much memory as without remat.
- ``cse-undid-remat`` (error): the jaxpr recomputes, but the compiled program does not: XLA merged
  the recomputation back into the forward pass (CSE; on the CPU outside ``lax.scan``).
- ``acts-as-full-remat`` (error): the policy promises to keep tensors but keeps none (e.g. a
  composed callable under ``jax_remat3``).
- ``saves-everything`` (error): ``save_anything_except_these_names`` (a JAX regression: it saves
  every value) or another policy that keeps everything it should recompute.
- ``composed-policy`` (warning): a policy built from callables; JAX's newer remat
  (``jax_remat3``) turns it into full remat.
- ``offload-no-host-bytes`` (error): an offload policy on a target with host memory puts nothing
  in host memory.
- ``offload-no-device-saving`` (warning): bytes move to host memory but the device peak does not
  go down (compared with the same policy keeping those tensors on device).
- ``offload-ignored`` (info): the backend ignores host offload (XLA:CPU); its numbers say nothing
  about a GPU's.
- ``static-argnums-self`` (error): ``nn.remat(..., static_argnums=...)`` on a linen module
  counts ``self`` as argument 0; an index pointing at an array is off by one.

Sources: JAX doc "Gradient checkpointing with jax.checkpoint"; flax.linen.remat docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from remat_kit import names as N
from remat_kit import residuals as R
from remat_kit import targets as T
from remat_kit.memory import MemoryReport, analyze, analyze_policies
from remat_kit.models.config import ModelConfig, get_config
from remat_kit.policies import PolicySpec, get_policy_spec, policy_names

Severity = Literal["error", "warning", "info"]
#: Relative tolerance when comparing two compiled figures as "the same".
SAME = 0.005


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem: ``code`` (see the module doc), ``severity``, what is wrong, the likely cause
    and the fix."""

    code: str
    severity: Severity
    what: str
    cause: str
    fix: str

    def line(self) -> str:
        return f"{self.severity}: [{self.code}] {self.what} Cause: {self.cause} Fix: {self.fix}"


def has_errors(findings: Sequence[Finding]) -> bool:
    """True when any finding has severity ``error`` (``remat-kit doctor`` then exits 1)."""
    return any(f.severity == "error" for f in findings)


# -- What the program emits -------------------------------------------------------------------


def _sub_jaxprs(value: Any):
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def emitted_tags(fn: Callable[..., Any], *args: Any) -> set[str]:
    """Checkpoint names present in the traced program of ``fn(*args)`` (sub-jaxprs included:
    scan bodies, remat and jit calls)."""
    tags: set[str] = set()
    todo = [jax.make_jaxpr(fn)(*args).jaxpr]
    while todo:
        jaxpr = todo.pop()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                tags.add(eqn.params["name"])
            for p in eqn.params.values():
                todo.extend(_sub_jaxprs(p))
    return tags


# -- What a raw policy callable promises ------------------------------------------------------


def describe_callable(policy: Callable[..., Any]) -> tuple[PolicySpec | None, list[Finding]]:
    """The :class:`PolicySpec` a raw ``jax.checkpoint_policies`` callable stands for, if it can
    be read (name sets, dots, everything/nothing), plus findings about the callable itself."""
    cp = jax.checkpoint_policies
    qual = getattr(policy, "__qualname__", type(policy).__name__)
    if policy is cp.everything_saveable:
        return PolicySpec("everything_saveable", "saves everything", base="everything"), []
    if policy is cp.nothing_saveable:
        return PolicySpec("nothing_saveable", "saves nothing"), []
    if policy is cp.dots_saveable:
        return PolicySpec("dots_saveable", "matmul outputs", base="dots"), []
    if policy is cp.dots_with_no_batch_dims_saveable:
        return PolicySpec("dots_with_no_batch_dims_saveable", "", base="dots_no_batch"), []
    names = getattr(policy, "saveable_names", None)
    if names is not None:  # save_only_these_names
        known = frozenset(n for n in names if n in N.CHECKPOINT_NAMES)
        return PolicySpec("save_only_these_names", "", save=known), []
    if qual.startswith("save_anything_except_these_names"):
        return None, [
            Finding(
                "saves-everything", "error",
                "save_anything_except_these_names saves every value: nothing is recomputed.",
                "a JAX regression: the policy returns True for everything "
                "(jax/_src/ad_checkpoint.py).",
                "list what to save with save_only_these_names, or use remat_kit.custom_policy.",
            )
        ]  # fmt: skip
    closure = dict(
        zip(
            getattr(getattr(policy, "__code__", None), "co_freevars", ()),
            (c.cell_contents for c in (getattr(policy, "__closure__", None) or ())),
            strict=False,
        )
    )
    if "names_which_can_be_offloaded" in closure:  # save_and_offload_only_these_names
        save = frozenset(n for n in closure["names_which_can_be_saved"] if n in N.CHECKPOINT_NAMES)
        off = frozenset(
            n for n in closure["names_which_can_be_offloaded"] if n in N.CHECKPOINT_NAMES
        )
        return PolicySpec("save_and_offload_only_these_names", "", save=save, offload=off), []
    return None, [
        Finding(
            "composed-policy", "error" if jax.config.jax_remat3 else "warning",
            f"policy {qual!r} is a callable JAX cannot read as data.",
            "JAX's newer remat implementation (jax_remat3) treats policies as data and runs such "
            "callables (save_from_both_policies, lambdas) as full remat"
            + (" — and jax_remat3 is on." if jax.config.jax_remat3 else "."),
            "build the policy from name sets: remat_kit.custom_policy({...}) or "
            "jax.checkpoint_policies.save_only_these_names(...).",
        )
    ]  # fmt: skip


# -- The comparisons ---------------------------------------------------------------------------


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    return abs(a - b) <= SAME * max(abs(a), abs(b), 1)


_MLP_FAMILIES = frozenset({N.MLPWI, N.MLPWI_0, N.MLPWI_1})


def _unknown_tags(spec: PolicySpec, tags: set[str]) -> list[Finding]:
    missing = spec.tags - tags
    if spec.name in policy_names() and spec.tags & tags & _MLP_FAMILIES:
        # A registered policy names both MLP families' tags; only one family is emitted.
        missing -= _MLP_FAMILIES
    out = []
    for tag in sorted(missing):
        hint = N.closest(tag, sorted(tags))
        out.append(
            Finding(
                "unknown-tag", "error",
                f"policy {spec.name!r} names {tag!r}, which the program never emits "
                f"(emitted: {', '.join(sorted(tags)) or 'none'}): nothing is "
                f"{'offloaded' if tag in spec.offload else 'saved'} for it.",
                "a typo, or a tag of another model family (mlpwi_0/mlpwi_1 are SwiGLU's, mlpwi "
                "the plain MLP's).",
                f"use {hint!r}." if hint else "tag the tensor with checkpoint_name, or drop it.",
            )
        )  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the jaxpr keeps: device and host bytes of new buffers (arguments excluded), the tags
    kept (arguments included: a remat segment's input is kept as an argument), and whether any
    untagged matmul output is kept."""

    device_bytes: int
    host_bytes: int
    tags: frozenset[str]
    dots: bool

    @classmethod
    def of(cls, residuals: Sequence[R.Residual]) -> Residuals:
        return cls(
            device_bytes=R.activation_bytes(list(residuals), "device"),
            host_bytes=R.activation_bytes(list(residuals), "host"),
            tags=frozenset(r.tag for r in residuals if r.tag is not None),
            dots=any(r.source == "dot_general" for r in residuals),
        )


#: A policy whose compiled temp bytes go down by less than this fraction of what its jaxpr
#: residuals promise (against no-remat) has not taken effect.
MIN_EFFECT = 0.1


def compare(
    spec: PolicySpec,
    report: MemoryReport,
    no_remat: MemoryReport,
    kept: Residuals,
    kept_no_remat: Residuals,
    target: T.Target,
    scan_layers: bool | None = None,
) -> list[Finding]:
    """Findings from the compiled reports of a policy and of ``no-remat`` for one step, and
    what each keeps in the jaxpr (:class:`Residuals`)."""
    out: list[Finding] = []
    if not spec.wrap:  # no-remat: nothing promised
        return out
    promised = kept_no_remat.device_bytes - kept.device_bytes  # device bytes the policy frees
    achieved = no_remat.temp_bytes - report.temp_bytes
    compiled_recomputes = (report.flops or 0) > (no_remat.flops or 0) * (1 + SAME)
    outside_scan = " outside lax.scan (scan_layers=False)" if scan_layers is False else ""
    if promised <= 0:
        out.append(
            Finding(
                "no-op-policy", "error",
                f"policy {spec.name!r} keeps everything no-remat keeps "
                f"({kept.device_bytes} residual bytes): nothing is recomputed.",
                "it names only tensors the backward pass keeps anyway, or saves every value.",
                "recompute more: save fewer tags, or use save-dots-no-batch / save-nothing.",
            )
        )  # fmt: skip
    elif achieved < MIN_EFFECT * promised and report.flops is not None:
        if not compiled_recomputes:
            out.append(
                Finding(
                    "cse-undid-remat", "error",
                    f"policy {spec.name!r} recomputes in the jaxpr, but the compiled step has no "
                    f"recomputation ({report.flops:.3g} FLOPs, as no-remat) and frees "
                    f"{max(achieved, 0)} of the {promised} bytes promised.",
                    f"XLA's CSE merged the recomputation back into the forward pass{outside_scan};"
                    " XLA:CPU drops remat's optimisation barriers outside loops.",
                    "run the layers under nn.scan (scan_layers=True) or keep prevent_cse=True; "
                    "judge remat on a GPU target.",
                )
            )  # fmt: skip
        else:
            out.append(
                Finding(
                    "no-op-policy", "error",
                    f"policy {spec.name!r} recomputes but the compiled step frees only "
                    f"{max(achieved, 0)} of the {promised} temp bytes its residuals promise "
                    f"(temp {report.temp_bytes} vs {no_remat.temp_bytes} bytes without remat).",
                    f"XLA keeps the forward values alive anyway{outside_scan} (XLA:CPU honours "
                    "remat only inside lax.scan)." if outside_scan or target.platform == "cpu"
                    else "the peak is outside the layers (optimizer update, logits).",
                    "scan the layers (scan_layers=True); judge remat on a GPU target.",
                )
            )  # fmt: skip
    promises = bool(spec.tags) or spec.base in ("dots", "dots_no_batch")
    keeps = bool(kept.tags & spec.tags) or (spec.base != "names" and kept.dots)
    if promises and not keeps:
        out.append(
            Finding(
                "acts-as-full-remat", "error",
                f"policy {spec.name!r} promises to keep "
                f"{', '.join(sorted(spec.tags)) or 'matmul outputs'} but keeps none of them: it "
                "runs as full remat (save-nothing).",
                "its tags are not emitted inside the remat segment, or a composed callable "
                "under jax_remat3.",
                "check the tag names (remat-kit doctor lists them) and build the policy from "
                "name sets.",
            )
        )  # fmt: skip
    if spec.offloads:
        out.extend(_offload_findings(spec, report, target, kept.host_bytes))
    return out


def _offload_findings(
    spec: PolicySpec, report: MemoryReport, target: T.Target, host_res: int
) -> list[Finding]:
    if not target.supports_host_offload:
        return [
            Finding(
                "offload-ignored", "info",
                f"target {target.name!r} ignores host offload: the {host_res} bytes policy "
                f"{spec.name!r} offloads are counted as device memory.",
                "XLA:CPU compiles offloads as plain copies (host memory is device memory).",
                "analyze offload policies on a GPU target (e.g. --target h100-sxm).",
            )
        ]  # fmt: skip
    if report.host_bytes == 0 and host_res > 0:
        return [
            Finding(
                "offload-no-host-bytes", "error",
                f"policy {spec.name!r} offloads {host_res} bytes in the jaxpr but the compiled "
                f"step on {target.name!r} has no host memory.",
                "XLA dropped the offload (the tensor is also needed on device, or the offloaded "
                "tags are not residuals here).",
                "offload other tags (offload-layer-inputs / offload-to-host) and check again.",
            )
        ]  # fmt: skip
    without = report.peak_bytes_without_offload
    if without is not None and report.peak_bytes >= without:
        return [
            Finding(
                "offload-no-device-saving", "warning",
                f"policy {spec.name!r} moves {report.host_bytes} bytes to host but the device "
                f"peak ({report.peak_bytes} bytes) is not below keeping them on device "
                f"({without} bytes).",
                "the peak is elsewhere (optimizer update, logits, or the copies to and from "
                "host are live at the peak).",
                "keep those tensors on device (same peak, no transfer), or offload more.",
            )
        ]  # fmt: skip
    return []


# -- Entry points ------------------------------------------------------------------------------


def check(
    config: ModelConfig | str,
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
      config: preset name or config; its ``scan_layers`` / ``remat_group_size`` are used.
      batch_size, seq_len: the step's shape ([batch, seq] tokens).
      policy: policy name, spec or custom mapping (default: the config's).
      target: compile target name.
      optimizer: ``adamw``, ``sgd`` or ``adafactor``.

    Returns:
      The findings, errors first; empty when the policy does what it promises.

    Raises:
      ValueError: unknown preset, policy or target; bad shapes.
    """
    if isinstance(config, str):
        config = get_config(config)
    chosen = policy if policy is not None else config.remat_policy
    return check_policies(config, batch_size, seq_len, [chosen], target, optimizer)[0]


def check_policies(
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
    """
    if isinstance(config, str):
        config = get_config(config)
    specs = [get_policy_spec(p) for p in policies]
    tgt = T.get_target(target)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    from remat_kit.models.transformer import make_model
    from remat_kit.train import init_params

    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    tags = emitted_tags(lambda p, t: make_model(config).apply({"params": p}, t), params, tokens)
    reports = analyze_policies(config, batch_size, seq_len, [*specs, "no-remat"], tgt, optimizer)
    base = config.replace(remat_policy="no-remat")
    kept_base = Residuals.of(R.block_residuals(base, batch_size, seq_len))
    out = []
    for spec, report in zip(specs, reports, strict=False):
        cfg = config.replace(remat_policy=spec)
        findings = _unknown_tags(spec, tags) + compare(
            spec, report, reports[-1],
            Residuals.of(R.block_residuals(cfg, batch_size, seq_len)), kept_base,
            tgt, scan_layers=config.scan_layers,
        )  # fmt: skip
        out.append(_sorted(findings))
    return out


def check_function(
    make_loss: Callable[[Callable[..., Any]], Callable[..., Any]],
    *args: Any,
    policy: str | PolicySpec | Mapping[str, str] | Callable[..., Any],
    target: str | T.Target = "cpu",
) -> list[Finding]:
    """Check a policy on a user's own function.

    Args:
      make_loss: ``make_loss(jax_policy) -> loss(*args) -> scalar``: builds the user's loss with
        ``jax.checkpoint`` / ``nn.remat`` under the given ``jax.checkpoint`` policy.
      *args: the loss's arguments (arrays or ``jax.ShapeDtypeStruct``).
      policy: a remat-kit policy (name, spec, mapping) or a raw ``jax.checkpoint_policies``
        callable (read back into a spec where possible).
      target: compile target name.

    Returns:
      The findings, errors first.
    """
    tgt = T.get_target(target)
    if callable(policy) and not isinstance(policy, PolicySpec):
        spec, findings = describe_callable(policy)
        jax_policy = policy
    else:
        spec, findings = get_policy_spec(policy), []
        jax_policy = spec.to_jax()
    cp = jax.checkpoint_policies
    loss_all = make_loss(cp.everything_saveable)
    tags = emitted_tags(loss_all, *args)
    losses = {"policy": make_loss(jax_policy), "no-remat": loss_all}
    reports = {
        k: analyze(jax.value_and_grad(f, argnums=tuple(range(len(args)))), *args, target=tgt,
                   name=k, policy=k)
        for k, f in losses.items()
    }  # fmt: skip
    if spec is None:  # an opaque callable: judge by what it does, against no-remat
        spec = PolicySpec("custom-callable", "opaque callable", save=frozenset(), source="user")
    else:
        findings += _unknown_tags(spec, tags)
    findings += compare(
        spec, reports["policy"], reports["no-remat"],
        Residuals.of(R.saved_residuals(losses["policy"], *args)),
        Residuals.of(R.saved_residuals(loss_all, *args)), tgt,
    )  # fmt: skip
    if spec.name == "custom-callable":
        findings = [f for f in findings if f.code != "acts-as-full-remat"]
        findings += _opaque_full_remat(make_loss, jax_policy, args)
    return _sorted(_dedupe(findings))


def _residuals_with_remat3(make_loss, policy, args, remat3: bool) -> Residuals:
    saved = jax.config.jax_remat3
    jax.config.update("jax_remat3", remat3)
    try:
        return Residuals.of(R.saved_residuals(make_loss(policy), *args))
    finally:
        jax.config.update("jax_remat3", saved)


def _opaque_full_remat(make_loss, policy, args) -> list[Finding]:
    """An opaque callable promises what classic remat (which calls it) keeps; find whether the
    remat implementation in use keeps less, i.e. runs it as full remat."""
    classic = _residuals_with_remat3(make_loss, policy, args, False)
    current = _residuals_with_remat3(make_loss, policy, args, jax.config.jax_remat3)
    nothing = _residuals_with_remat3(
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


def check_remat_static_argnums(
    static_argnums: Sequence[int], call_args: Sequence[Any]
) -> list[Finding]:
    """Check ``nn.remat(Module, static_argnums=...)`` against a call's positional arguments.

    flax.linen counts ``self`` as argument 0, so ``static_argnums=(1,)`` marks the first argument
    after ``self``. An index pointing at an array (or past the arguments) is almost always the
    off-by-one of counting from the first argument instead.

    Args:
      static_argnums: the indices passed to ``nn.remat``.
      call_args: the positional arguments of one ``module(...)`` call, without ``self``.
    """
    out = []
    for i in static_argnums:
        j = i - 1  # position in call_args
        if j < 0 or j >= len(call_args) or isinstance(call_args[j], (jax.Array, jnp.ndarray)):
            what = (
                "self" if j < 0 else ("past the arguments" if j >= len(call_args) else "an array")
            )
            out.append(
                Finding(
                    "static-argnums-self", "error",
                    f"static_argnums={tuple(static_argnums)}: index {i} points at {what}.",
                    "nn.remat counts self as argument 0 (flax.linen.remat docstring).",
                    f"use index {i + 1} for the argument at call position {i}.",
                )
            )  # fmt: skip
    return out


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.code, f.what) not in seen:
            seen.add((f.code, f.what))
            out.append(f)
    return out


def _sorted(findings: list[Finding]) -> list[Finding]:
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])
