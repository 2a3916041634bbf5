"""The policy registry drives these tests: a new policy is tested automatically."""

import functools
import os
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import remat_kit
import remat_kit.training
from remat_kit import names as N
from remat_kit.policies import (
    MAXTEXT_POLICIES,
    check_tags,
    custom_spec,
    get_policy_spec,
    policies_for_tags,
    policy_names,
)
from remat_kit.training.step import abstract_batch, loss_fn, make_optimizer, make_train_step
from remat_kit.walker import group_by_tag
from remat_kit.zoo import block_residuals

POLICIES = remat_kit.policy_names()
MODELS = ["tiny-gpt", "tiny-llama"]
#: (model, scanned, remat group size) layouts of the gradient check, one compile each (~10 s).
#: By default every pair of values meets once (each model scanned and unrolled, each model with
#: groups of 1 and 2, each layout with both group sizes): 4 of the 8 combinations, every policy
#: in each. REMAT_KIT_FULL_MATRIX=1 runs all 8 (as tests/test_walker.py's clean-run matrix).
LAYOUTS = (
    [(m, scan, group) for m in MODELS for scan in (True, False) for group in (1, 2)]
    if os.environ.get("REMAT_KIT_FULL_MATRIX") == "1"
    else [("tiny-gpt", True, 1), ("tiny-gpt", False, 2), ("tiny-llama", True, 2),
          ("tiny-llama", False, 1)]
)  # fmt: skip
ISSUE_NAMES = [
    "no-remat", "save-nothing", "save-layer-inputs", "save-dots", "save-dots-no-batch",
    "save-qkv-proj", "save-out-proj", "save-qkv-out-proj", "save-dots-except-mlp", "minimal",
    "offload-to-host", "offload-layer-inputs", "offload-qkv-proj",
]  # fmt: skip


def _config(model, policy="no-remat", scan=True, group=1, **kw):
    return remat_kit.get_config(
        model, remat_policy=policy, scan_layers=scan, remat_group_size=group, num_layers=2, **kw
    )


def _batch(b=2, s=16):
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "inputs": jax.random.randint(k1, (b, s), 0, 256, jnp.int32),
        "targets": jax.random.randint(k2, (b, s), 0, 256, jnp.int32),
    }


@functools.cache
def _all_losses_and_grads(model, scan, group):
    """Loss and gradients under every registered policy, from ONE compiled program (compiling
    the policies together is ~3x faster than one program each)."""
    configs = [_config(model, p, scan, group) for p in POLICIES]
    params = remat_kit.training.init_params(configs[0], jax.random.key(0))
    # Values do not depend on XLA's optimisation passes (remat is decided on the jaxpr), and
    # skipping them halves the compile time.
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        fn = jax.jit(lambda p, b: [jax.value_and_grad(loss_fn)(p, c, b) for c in configs])
        return dict(zip(POLICIES, fn(params, _batch()), strict=True))
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


def _loss_and_grads(model, policy, scan, group):
    return _all_losses_and_grads(model, scan, group)[policy]


def test_registry_lists_every_promised_name():
    assert set(ISSUE_NAMES) <= set(POLICIES)
    for name in POLICIES:
        spec = remat_kit.get_policy_spec(name)
        assert spec.description and spec.source, name
        assert callable(remat_kit.policy(name))


@pytest.mark.parametrize(
    "model, scan, group",
    LAYOUTS,
    ids=[f"{m}-{'scan' if scan else 'unrolled'}-{g}" for m, scan, g in LAYOUTS],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_loss_and_grads_equal_no_remat(policy, model, scan, group):
    loss, grads = _loss_and_grads(model, policy, scan, group)
    ref_loss, ref_grads = _loss_and_grads(model, "no-remat", scan, group)
    chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def _promised_tags(spec, config):
    emitted = set(config.checkpoint_names)
    if spec.base == "dots":  # context: its batched matmul's output, kept before the transpose
        return {t for t in emitted if t != N.DECODER_LAYER_INPUT}, set()
    if spec.base == "dots_no_batch":  # no batched matmul: the scores and context recomputed
        return {t for t in emitted if t not in (N.DECODER_LAYER_INPUT, N.CONTEXT)}, set()
    return spec.save & emitted, spec.offload & emitted


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "no-remat"])
def test_saved_residuals_keep_exactly_the_promised_tags(policy, model):
    # Two blocks per remat segment so every tag (the second block's input included) is inside
    # the segment; arguments (parameters, the segment input) are not activations.
    config = _config(model, policy, group=2)
    spec = config.policy_spec
    rows = group_by_tag(block_residuals(config, 2, 16))
    saved = {r.tag for r in rows if r.memory == "device" and r.tag in N.CHECKPOINT_NAMES}
    offloaded = {r.tag for r in rows if r.memory == "host"}
    want_saved, want_offloaded = _promised_tags(spec, config)
    assert saved == want_saved
    assert offloaded == want_offloaded
    untagged = {r.tag for r in rows if r.tag not in N.CHECKPOINT_NAMES}
    if spec.base == "dots":  # the attention scores' matmul output is kept, untagged
        assert "<dot_general>" in untagged
    else:
        assert "<dot_general>" not in untagged


def test_no_remat_keeps_more_than_save_nothing():
    full = block_residuals(_config("tiny-gpt", "no-remat", group=2), 2, 16)
    none = block_residuals(_config("tiny-gpt", "save-nothing", group=2), 2, 16)
    act = remat_kit.walker.activation_bytes
    assert act(none) == 0
    assert act(full) > 0


def _temp_bytes(policy):
    config = _config("tiny-gpt", policy, num_heads=4, d_model=64, max_seq_len=128)
    optimizer = make_optimizer("sgd", grad_clip=None)
    state = remat_kit.abstract_train_state(config, optimizer)
    step = make_train_step(config, optimizer)
    compiled = step.lower(state, abstract_batch(4, 128)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temp_bytes_ordered_under_scan():
    temps = {
        p: _temp_bytes(p) for p in ["save-nothing", "save-dots-no-batch", "save-dots", "no-remat"]
    }
    assert temps["save-nothing"] <= temps["save-dots-no-batch"] <= temps["save-dots"]
    assert temps["save-dots"] <= temps["no-remat"]
    assert temps["save-nothing"] < temps["no-remat"], temps


def test_maxtext_policy_names_mean_the_policy_saving_the_same_names():
    """A MaxText user's remat_policy name (issue 53): accepted, as the spec saving MaxText's
    names (its get_remat_policy; the fused qkv_proj aside), named as MaxText names it; MaxText's
    custom settings (device, remat) are read as save and recompute."""

    maxtext = {  # MaxText's name sets (its fused qkv_proj aside)
        "save_qkv_proj": {"query_proj", "key_proj", "value_proj"},
        "save_out_proj": {"out_proj"},
        "save_dot_except_mlp": {"query_proj", "key_proj", "value_proj", "out_proj"},
        "save_dot_with_context_except_mlp": {
            "query_proj", "key_proj", "value_proj", "out_proj", "context",
        },
        "save_dot_except_mlpwi": {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"},
        "minimal_with_context": {
            "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo",
            "context",
        },
        "full": set(),
    }  # fmt: skip
    for name, names in maxtext.items():
        spec = get_policy_spec(name)
        assert spec.name == name and spec.save == names and not spec.offload, name
        assert remat_kit.policy(name) is not None
        assert get_policy_spec(MAXTEXT_POLICIES[name]).save == names  # remat-kit's own name
    assert get_policy_spec("full").to_jax() is jax.checkpoint_policies.nothing_saveable
    offloaded = get_policy_spec("qkv_proj_offloaded")
    assert offloaded.offload == {"query_proj", "key_proj", "value_proj"}
    # written with hyphens as remat-kit's names are: the same MaxText policy
    assert get_policy_spec("qkv-proj-offloaded") == offloaded
    assert get_policy_spec("save-dot-except-mlp") == get_policy_spec("save_dot_except_mlp")
    with pytest.raises(ValueError, match=re.escape("'remat_policy=custom query_proj=device")):
        remat_kit.policy("custom")
    assert get_policy_spec("query_proj=device,mlpwo=offload,out_proj=remat") == get_policy_spec(
        "query_proj=save,mlpwo=offload"
    )
    with pytest.raises(ValueError, match="Did you mean 'save-dots'"):  # not a MaxText name
        remat_kit.policy("save-dot")
    # a misspelt MaxText name is pointed at MaxText's, not at remat-kit's other policy
    with pytest.raises(ValueError, match="Did you mean MaxText's 'save_dot_except_mlp'"):
        remat_kit.policy("save_dot_except_mpl")


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: remat_kit.policy("save-dot"), r"unknown policy 'save-dot'.*Did you mean 'save-dots'"),
        (lambda: remat_kit.policy("fast"), r"unknown policy 'fast'; valid: no-remat"),
        (lambda: remat_kit.custom_policy({"": "save"}), r"checkpoint name must be a non-empty string"),
        (lambda: remat_kit.custom_policy({3: "save"}), r"checkpoint name must be .* got 3"),
        (lambda: check_tags(remat_kit.custom_spec({"query_prj": "save"}), ["query_proj", "out_proj"]),
         r"not emitted by the program.*'query_prj'.*Did you mean 'query_proj'"),
        (lambda: check_tags(remat_kit.custom_spec({"mlp_hidden": "save"}), []), r"emits no checkpoint_name"),
        (lambda: remat_kit.custom_policy({"out_proj": "keep"}), r"'keep'.*save, offload, recompute"),
        (
            lambda: remat_kit.PolicySpec("x", "d", save=frozenset({"out_proj"}),
                                         offload=frozenset({"out_proj"})),
            r"\['out_proj'\] both saved and offloaded",
        ),
        (lambda: remat_kit.get_config("llama3-9b"), r"unknown preset 'llama3-9b'.*llama3-8b"),
        (lambda: remat_kit.get_config("tiny-gpt", d_model=65), r"d_model=65.*num_heads=4"),
        (lambda: remat_kit.get_config("tiny-llama", num_kv_heads=3), r"num_kv_heads=3.*1, 2, 4"),
        (lambda: remat_kit.get_config("tiny-gpt", remat_group_size=3), r"remat_group_size=3.*1, 2, 4"),
        (lambda: remat_kit.get_config("tiny-gpt", num_layers=0), r"num_layers must be a positive"),
        (lambda: remat_kit.get_config("tiny-gpt", d_ff=-1), r"d_ff must be a positive"),
        (lambda: remat_kit.get_config("tiny-gpt", remat_policy="save-al"), r"unknown policy"),
        (lambda: remat_kit.get_config("tiny-gpt", dmodel=64), r"unknown ModelConfig field 'dmodel'.*d_model"),
        (lambda: abstract_batch(0, 16), r"batch_size must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_bad_input_raises_value_error_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_custom_policy_spec():
    spec = remat_kit.custom_spec(
        {"query_proj": "offload", "out_proj": "save", "mlpwo": "recompute"}
    )
    assert spec.save == {"out_proj"} and spec.offload == {"query_proj"}
    config = _config("tiny-llama", spec, group=2)
    rows = group_by_tag(block_residuals(config, 2, 16))
    assert {(r.tag, r.memory) for r in rows if r.tag in N.CHECKPOINT_NAMES} == {
        ("out_proj", "device"),
        ("query_proj", "host"),
    }


def test_policy_works_with_linen_remat_by_hand():
    config = _config("tiny-gpt")
    x = jnp.ones((2, 16, config.d_model))
    pos = jnp.arange(16)
    Remat = nn.remat(remat_kit.Block, policy=remat_kit.policy("save-dots"))
    params = remat_kit.Block(config).init(jax.random.key(0), x, pos)
    f_ref = lambda p: remat_kit.Block(config).apply(p, x, pos).sum()
    f_remat = lambda p: Remat(config).apply(p, x, pos).sum()
    grads = jax.jit(lambda p: (jax.grad(f_remat)(p), jax.grad(f_ref)(p)))(params)
    chex.assert_trees_all_close(*grads, rtol=1e-6)


class _NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(8, 16, rngs=rngs)
        self.wo = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        h = checkpoint_name(self.wi(x), N.MLPWI)
        return checkpoint_name(self.wo(jax.nn.gelu(h)), N.MLPWO)


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_work_with_nnx_remat(policy):
    model = _NnxMlp(nnx.Rngs(0))
    x = jnp.linspace(-1, 1, 32).reshape(4, 8)

    def loss(m, x):
        return (m(x) ** 2).sum()

    def loss_remat(m, x):
        return (nnx.remat(lambda m, x: m(x), policy=remat_kit.policy(policy))(m, x) ** 2).sum()

    g_ref = nnx.grad(loss)(model, x)
    g = nnx.grad(loss_remat)(model, x)
    chex.assert_trees_all_close(nnx.state(g), nnx.state(g_ref), rtol=1e-6)


def test_public_api_imports():
    for name in remat_kit.__all__:
        assert hasattr(remat_kit, name), name
    assert remat_kit.__all__ == sorted(remat_kit.__all__)


def test_custom_policy_takes_a_users_own_tag_names(capsys):
    """Open vocabulary: a tag of the user's own (not MaxText's) is saved or offloaded by name."""

    def block(w, x):
        h = checkpoint_name(jnp.sin(x @ w), "mlp_hidden")
        return jnp.sum(jnp.cos(h @ w))

    w = jnp.ones((8, 8)) * 0.1
    x = jnp.ones((4, 8))
    kept = {}
    for name, spec in {
        "save": {"mlp_hidden": "save"},
        "recompute": {"mlp_hidden": "recompute"},
    }.items():
        f = jax.checkpoint(block, policy=remat_kit.custom_policy(spec))
        print_saved_residuals(f, w, x)
        kept[name] = capsys.readouterr().out
        chex.assert_trees_all_close(jax.grad(f)(w, x), jax.grad(block)(w, x), rtol=1e-6)
    assert "named 'mlp_hidden'" in kept["save"], kept
    assert "mlp_hidden" not in kept["recompute"], kept
    check_tags(remat_kit.custom_spec({"mlp_hidden": "offload"}), ["mlp_hidden"])  # no error


def test_policies_for_tags_keeps_cuts_and_skips_by_emitted_tags():
    own = custom_spec({"attn_in": "save"})
    fit = policies_for_tags(
        ["save-nothing", "save-dots", "save-qkv-proj", "offload-qkv-proj", "save-out-proj", own],
        ["attn_in", "query_proj", "value_proj"],
    )
    names = [s.name for s in fit.specs]
    assert names[:2] == ["save-nothing", "save-dots"] and fit.specs[-1] is own
    assert [n.name for n, _ in fit.restricted] == ["save-qkv-proj", "offload-qkv-proj"]
    cut_save, cut_offload = (c for _, c in fit.restricted)
    assert cut_save.save == {"query_proj", "value_proj"} and not cut_save.offload
    assert cut_offload.offload == {"query_proj", "value_proj"} and not cut_offload.save
    assert [s.name for s in fit.skipped] == ["save-out-proj"]
    notes = fit.notes("'mine'")
    assert "key_proj" in notes[0] and "save-out-proj" in notes[-1]
    # every tag emitted: nothing cut or skipped; no tag emitted: every name-based one skipped
    full = policies_for_tags(["save-qkv-proj"], ["query_proj", "key_proj", "value_proj"])
    assert full.specs == (get_policy_spec("save-qkv-proj"),) and not full.restricted
    bare = policies_for_tags(policy_names(), [])
    assert {s.name for s in bare.skipped} >= {"save-qkv-proj", "minimal", "offload-to-host"}
    assert all(not s.tags for s in bare.specs)


def test_every_entry_takes_the_per_tag_text_the_command_line_takes():
    """``"mlp_in=save"`` resolves in Python as ``--policy mlp_in=save`` does (the API said
    unknown policy while the CLI and the program sweep took it)."""
    assert get_policy_spec("mlp_in=save,attn=offload") == custom_spec(
        {"mlp_in": "save", "attn": "offload"}
    )
    assert get_policy_spec('{"mlp_in": "save"}') == custom_spec({"mlp_in": "save"})
    with pytest.raises(ValueError, match="tag 'mlp_in': unknown action 'sav'"):
        get_policy_spec("mlp_in=sav")
