"""The policy semantics under both of JAX's remat implementations (issue 31): gradients equal,
the tags the residual table keeps, offload real (host bytes of a compile), and what analyze, the
sweep's rows and table, recommend, the timeline and the doctor say when the implementation in
use runs a policy as something other than its name.

Each check is parametrized over :data:`remat_kit.policies.IMPLEMENTATIONS`. What a policy
should do there is never a list written here: it is the probe's verdict
(:func:`remat_kit.policies.policy_effect`), and these tests hold the tools (and the model's
own residuals and compiled host bytes) to it.
"""

import functools
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import pytest
from conftest import needs_cuda_plugin
from jax.ad_checkpoint import checkpoint_name

import remat_kit
import remat_kit.training
from remat_kit import doctor, plots
from remat_kit import names as N
from remat_kit import policies as RP
from remat_kit.policies import custom_spec, get_policy_spec, policy_names
from remat_kit.recommend.api import _resolve_specs
from remat_kit.sweep.output import warning_lines
from remat_kit.sweep.rows import analysis_fields
from remat_kit.training.step import loss_fn
from remat_kit.walker import group_by_tag
from remat_kit.zoo import block_residuals

IMPLS = list(RP.IMPLEMENTATIONS)
POLICIES = policy_names()


def _config(policy="no-remat", group=1):
    return remat_kit.get_config("tiny-gpt", remat_policy=policy, scan_layers=True,
                                remat_group_size=group, num_layers=2)  # fmt: skip


def test_implementation_is_read_from_the_trace_and_switched_per_thread():
    outside = RP.remat_implementation()
    for impl in IMPLS:
        with RP.using(impl):
            assert RP.remat_implementation() == impl
            eqn = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).jaxpr.eqns[0]
            assert (eqn.primitive.name == "remat2") == (impl == "classic")
    assert RP.remat_implementation() == outside
    with pytest.raises(ValueError, match="remat implementation.*'remat4'"):
        with RP.using("remat4"):
            pass


def test_probe_reads_every_registered_policy_as_named_under_classic():
    assert all(RP.policy_effect(p, "classic").as_named for p in POLICIES)


#: Gradients: every registered policy under classic remat is tests/test_policies.py; here the
#: ones whose meaning differs between the implementations, and one of each other kind.
GRAD_POLICIES = ["no-remat", "save-nothing", "save-dots-no-batch", "save-qkv-proj",
                 "offload-qkv-proj", "offload-layer-inputs"]  # fmt: skip


@functools.cache
def _losses_and_grads():
    """Loss and gradients per (implementation, policy): ONE compiled program, each
    ``jax.checkpoint`` traced under its implementation (the switch is read at trace time)."""
    configs = [_config(p) for p in GRAD_POLICIES]
    params = remat_kit.training.init_params(configs[0], jax.random.key(0))
    k1, k2 = jax.random.split(jax.random.key(1))
    batch = {"inputs": jax.random.randint(k1, (2, 8), 0, 256, jnp.int32),
             "targets": jax.random.randint(k2, (2, 8), 0, 256, jnp.int32)}  # fmt: skip

    def all_of(p, b):
        out = []
        for impl in IMPLS:
            with RP.using(impl):
                out += [jax.value_and_grad(loss_fn)(p, c, b) for c in configs]
        return out

    jax.config.update("jax_disable_most_optimizations", True)  # values do not depend on them
    try:
        keys = [(i, p) for i in IMPLS for p in GRAD_POLICIES]
        return dict(zip(keys, jax.jit(all_of)(params, batch), strict=True))
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


@pytest.mark.parametrize("impl", IMPLS)
def test_loss_and_grads_equal_no_remat(impl):
    out = _losses_and_grads()
    ref_loss, ref_grads = out[("classic", "no-remat")]
    for policy in GRAD_POLICIES:
        loss, grads = out[(impl, policy)]
        chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_model_residuals_keep_what_the_probe_says_the_policy_runs_as(impl):
    # The probe is a tiny function of its own; the bundled model's residual table must agree
    # with it tag by tag: as named, or (say) save-nothing's nothing. Every policy under classic
    # remat: tests/test_policies.py; here one saving and two offloading.
    config = _config(group=2)
    emitted = set(config.checkpoint_names)
    for policy in ["save-qkv-proj", "offload-qkv-proj", "offload-layer-inputs"]:
        effect = RP.policy_effect(policy, impl)
        runs = get_policy_spec(policy) if effect.as_named else get_policy_spec(effect.runs_as)
        with RP.using(impl):
            rows = group_by_tag(block_residuals(config.replace(remat_policy=policy), 2, 16))
        saved = {r.tag for r in rows if r.memory == "device" and r.tag in N.CHECKPOINT_NAMES}
        offloaded = {r.tag for r in rows if r.memory == "host"}
        assert (saved, offloaded) == (runs.save & emitted, runs.offload & emitted), policy


@pytest.mark.parametrize("impl", IMPLS)
def test_recommend_never_picks_a_policy_for_what_the_other_implementation_does(impl):
    tgt = remat_kit.get_target("h100-sxm")
    given = ["offload-qkv-proj", "offload-layer-inputs", "save-nothing", "save-qkv-proj"]
    with RP.using(impl):
        tags = frozenset(_config().checkpoint_names)
        program = SimpleNamespace(name="p", model_config=None)  # given policies: its name only
        specs, notes, _, _ = _resolve_specs(tgt, given, program, tags)
        offload_ok = RP.can_offload(tgt)
    kept = [s.name for s in specs]
    for policy in given:
        effect = RP.policy_effect(policy, impl)
        assert (policy in kept) == effect.as_named
        if not effect.as_named:
            assert sum(effect.line() in n for n in notes) == 1
    assert offload_ok == RP.offload_works(impl)


def _mlp_loss(policy):
    def layer(h, w):  # h [32, 128], w [128, 128]
        a = checkpoint_name(h @ w, "mlpwi")
        return checkpoint_name(jnp.tanh(a) @ w.T, "mlpwo") + h

    f = jax.checkpoint(layer, policy=policy)

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (f(h, w), None), x, ws)
        return (h**2).mean()

    return loss


@pytest.mark.parametrize("impl", IMPLS)
def test_doctor_reports_what_the_policy_runs_as(impl):
    ws = jax.ShapeDtypeStruct((3, 128, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    spec = custom_spec({"mlpwi": "offload"})
    with RP.using(impl):
        findings = doctor.check_function(_mlp_loss, ws, x, policy=spec)
    effect = RP.policy_effect(spec, impl)
    codes = {f.code for f in findings}
    assert ("remat3-full-remat" in codes) == (not effect.as_named)
    if not effect.as_named:  # the doctor's line carries the probe's cause and fix
        f = next(f for f in findings if f.code == "remat3-full-remat")
        assert "host bytes 0" in f.what and f.cause == effect.cause and f.fix == effect.fix


@functools.cache
def _offload_reports(impl):
    with RP.using(impl):
        return remat_kit.analyze_policies(
            remat_kit.preset(_config(), 2, 32), ["offload-to-host", "save-nothing"],
            target="h100-sxm",
            compare_offload=False,
            no_remat_baseline=False,  # no test here reads whether it frees memory
        )  # fmt: skip


@needs_cuda_plugin
@pytest.mark.parametrize("impl", IMPLS)
def test_offload_is_real_or_reported_by_analyze_and_the_sweep(impl):
    offload, nothing = _offload_reports(impl)
    effect = RP.policy_effect("offload-to-host", impl)
    assert (offload.remat_impl, offload.jax_version) == (impl, jax.__version__)
    row = {**analysis_fields(offload), "status": "ok", "policy": "offload-to-host",
           "model": "tiny-gpt", "target": "h100-sxm", "batch_size": 2, "seq_len": 64}  # fmt: skip
    if effect.as_named:  # host bytes prove it, and nothing is said
        assert offload.host_bytes > 0 and offload.runs_as is None
        assert offload.program_sha256 != nothing.program_sha256
        assert not any("runs as" in w for w in offload.warnings)
    else:  # the compile shows what the probe said (save-nothing's very program), and tools say so
        assert offload.host_bytes == 0 and offload.runs_as == effect.runs_as == "save-nothing"
        assert offload.program_sha256 == nothing.program_sha256
        assert effect.line() in offload.warnings
        assert row["runs_as"] == "save-nothing"
        assert any("runs as save-nothing (full remat) under jax_remat3" in w
                   for w in warning_lines([row]))  # fmt: skip
        fig = plots.timeline([offload], titles=["offload-to-host"])
        titles = [ax.get_title() for ax in fig.axes]
        assert any("runs as save-nothing under jax_remat3" in t for t in titles)


def test_docs_table_is_the_committed_run():
    # docs/remat3.md's tables are generated from the committed JSON, never typed: regenerate with
    # python experiments/remat3_policies.py --write-docs docs/remat3.md
    import json
    import pathlib
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "experiments"))
    import remat3_policies

    result = json.loads((repo / "experiments/results/remat3/policies.json").read_text())
    page = (repo / "docs/remat3.md").read_text()
    assert remat3_policies.with_tables(page, result) == page
    assert result["jax"] in page and result["target"] in page  # named with the figures
    for row in result["policies"]:  # the run agrees with the probe of this JAX
        if row["probe"]["jax_version"] == jax.__version__:
            effect = RP.policy_effect(row["policy"], row["implementation"])
            assert effect.runs_as == row["probe"]["runs_as"], row["policy"]


def test_a_users_step_is_judged_to_pass_the_policy_under_remat3():
    """jax_remat3 differentiates a remat segment as it traces it: a step's trace holds none, and
    every user program (the docs' plain-JAX example, Equinox, linen) was refused with 'applies
    no remat' (outside trial, session 16). The step is judged by whether save-everything and
    save-nothing trace to different steps; one that ignores the policy still is refused."""
    from remat_kit.examples import plain_jax
    from remat_kit.program import Program
    from remat_kit.reach import policy_reach

    def fixed_step(policy):  # a remat of its own: the policy given is dropped
        return plain_jax.make_step(jax.checkpoint_policies.nothing_saveable)

    args = plain_jax.abstract_args()
    loss_args = (args[0], args[2])
    with RP.using("remat3"):
        step = policy_reach(Program.from_step(plain_jax.make_step, *args, name="step"))
        assert step.passes and step.part == "make_step"
        # jax 0.10.2's remat3 differentiates a segment as it traces it (the step's trace holds
        # none: judged by two traces, the loss's segments counted); jax 0.12's leaves the
        # segments in the step's trace, counted there as under classic remat
        linearized = bool(step.linearized)
        assert linearized == (not step.segments)
        from_loss = policy_reach(plain_jax.program())
        assert from_loss.passes and from_loss.segments
        assert from_loss.part == "make_loss"  # the user's factory: the step is built from it
        both = Program.from_step(
            fixed_step, *args, name="fixed", make_loss=plain_jax.make_loss, loss_args=loss_args
        )
        refused = policy_reach(both)
        assert not refused.passes and refused.part == "make_step"
        assert (
            "traces to the same step under every policy" if linearized else "none of its"
        ) in refused.error()
    with RP.using("classic"):  # the same judgement, from counted segments
        assert policy_reach(Program.from_step(plain_jax.make_step, *args, name="s")).reached
        assert not policy_reach(both).passes
