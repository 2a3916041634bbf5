"""Which remat implementation a trace runs under, and what each policy becomes there.

JAX has two implementations of ``jax.checkpoint``: the classic one (``remat2`` in a jaxpr) and
the newer one switched on by ``jax.config.update("jax_remat3", True)`` (a ``RematTraced``
primitive), which JAX's changelog calls on its way to becoming the default. They read a
policy differently. The classic one calls the policy on every primitive; ``jax_remat3`` asks it
only at ``checkpoint_name`` values and at matmuls, and only for policies it can read as data
(``jax/_src/interpreters/remat.py`` ``rules``; ``jax/_src/ad_checkpoint.py``
``CheckpointName.remat``). On jax 0.10.2 that leaves out ``save_and_offload_only_these_names``
(a closure there): under ``jax_remat3`` every offloading policy runs as full remat. JAX added
``SaveAndOffloadOnlyTheseNames`` and offload under ``jax_remat3`` in jax 0.11.0 (commit
b69022a, "[remat3] support offloading via save_and_offload_only_these_names").

Rather than a list of what works where, :func:`policy_effect` asks the JAX in use: it traces a
tiny checkpointed function that emits the policy's checkpoint names (or a weight matmul and a
batched matmul, for the dots policies) under the implementation asked for, reads its saved
residuals (:func:`remat_kit.walker.saved_residuals`: checkpoint name and memory kind of each)
and compares them with what the policy promises. A trace takes a few milliseconds; results are
cached per (policy, implementation, jax version).

Example::

    >>> import remat_kit.remat_impl as RI
    >>> RI.policy_effect("save-qkv-proj", "classic").as_named
    True
    >>> effect = RI.policy_effect("offload-qkv-proj", "remat3")
    >>> effect.runs_as if effect.jax_version == "0.10.2" else "save-nothing"
    'save-nothing'
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from remat_kit import names as N
from remat_kit.policies import PolicySpec, custom_spec, get_policy_spec, policy_label, policy_specs

#: The two remat implementations of JAX: ``classic`` (``remat2``) and ``remat3``
#: (``jax_remat3``).
RematImplementation = Literal["classic", "remat3"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(RematImplementation)

#: Probe keys of the dots policies (there are no checkpoint names to follow).
WEIGHT_MATMUL = "<weight matmul>"
BATCHED_MATMUL = "<batched matmul>"


def remat3_flag() -> bool | None:
    """``jax.config.jax_remat3`` as set now, or None in a JAX without that flag."""
    try:
        return bool(jax.config.jax_remat3)
    except AttributeError:
        return None


def remat_implementation() -> RematImplementation:
    """The remat implementation ``jax.checkpoint`` traces with now, read from the primitive a
    traced ``jax.checkpoint`` leaves in its jaxpr (``remat2`` / ``checkpoint``: classic; a
    ``RematTraced`` hi-primitive: ``remat3``), so a JAX where remat3 became the default, or
    lost its flag, is read right too.

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
    """Trace under ``implementation`` inside the ``with`` block (this thread only; JAX's
    thread-local config context), whatever ``jax_remat3`` is set to outside.

    Raises:
      ValueError: an unknown implementation, or one this JAX cannot switch to (no
        ``jax_remat3`` flag).
    """
    if implementation not in IMPLEMENTATIONS:
        raise N.unknown_value_error("remat implementation", implementation, IMPLEMENTATIONS)
    if implementation == remat_implementation():
        yield
        return
    from jax._src import config as jax_config  # the flag's own context manager (thread-local)

    state = getattr(jax_config, "remat3", None)
    if state is None:
        raise ValueError(
            f"jax {jax.__version__} has no jax_remat3 flag: only the "
            f"{remat_implementation()!r} remat implementation can be traced"
        )
    with state(implementation == "remat3"):
        yield


def describe_implementation(implementation: RematImplementation | None = None) -> str:
    """``"jax_remat3 (jax 0.10.2)"`` or ``"classic remat (jax 0.10.2)"``."""
    impl = implementation or remat_implementation()
    return f"{'jax_remat3' if impl == 'remat3' else 'classic remat'} (jax {jax.__version__})"


@dataclasses.dataclass(frozen=True)
class PolicyEffect:
    """What one policy does under one remat implementation, from a traced probe.

    Attributes:
      policy: the policy as tables name it (``offload-to-host``, ``custom: q=save``).
      implementation: ``classic`` or ``remat3``; jax_version: the JAX traced with.
      promised: per probe key (a checkpoint name, or :data:`WEIGHT_MATMUL` /
        :data:`BATCHED_MATMUL` for the dots policies): ``save`` / ``offload`` / ``recompute``.
      observed: the same keys as the probe's saved residuals show them.
      runs_as: ``"as named"``, or what it does instead: a registered policy's name when one
        promises exactly that (``save-nothing`` for full remat), else a per-tag label.
      cause, fix: why it differs and what to do (None when as named).
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
        """One line for tables and warnings: what it runs as, the cause, the fix (None when it
        runs as named)."""
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
    return sorted(spec.tags) or [N.QUERY_PROJ]  # a name nothing saves: it must be recomputed


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
    from remat_kit.walker import saved_residuals  # (loads the models: only when probing)

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
    twin = custom_spec(
        {t: "save" for t in spec.save | spec.offload}
    )  # the same names kept on device
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
    """What ``policy`` does under ``implementation`` (default: the one in use now), from the
    saved residuals of a tiny traced probe (see the module docstring).

    Raises:
      ValueError: an unknown policy name, or an implementation this JAX cannot trace with.
    """
    spec = get_policy_spec(policy)
    impl = implementation or remat_implementation()
    return _effect(spec, impl, jax.__version__)


def offload_works(implementation: RematImplementation | None = None) -> bool:
    """Whether a name-based offload (``save_and_offload_only_these_names``) puts its residual
    in host memory under ``implementation`` (default: the one in use), from the probe."""
    return policy_effect(custom_spec({N.QUERY_PROJ: "offload"}), implementation).as_named


def can_offload(target: Any) -> bool:
    """Whether an offloading policy can offload on ``target`` now: the target has host memory
    (``target.supports_host_offload``) and the remat implementation in use offloads."""
    return bool(target.supports_host_offload) and offload_works()


def honoured(specs: Iterable[PolicySpec]) -> tuple[list[PolicySpec], list[str]]:
    """The specs that run as named under the implementation in use, and one line for each
    that does not (what it runs as, the cause, the fix): what a search may pick from."""
    kept, notes = [], []
    for spec in specs:
        effect = policy_effect(spec)
        if effect.as_named:
            kept.append(spec)
        else:
            notes.append(f"not considered: {effect.line()}")
    return kept, notes
