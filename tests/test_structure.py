"""Partial-layer and nested remat, chunked cross-entropy, attention choices (issue 17)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from remat_kit import targets as T
from remat_kit.models import (
    RematLayerStack,
    attention_choices,
    chunked_cross_entropy,
    get_config,
    layer_plan,
    sqrt_groups,
)
from remat_kit.training.step import init_params, loss_fn, make_optimizer, sharded_train_state
from remat_kit.walker import saved_residuals

L = 6


class UserBlock(nn.Module):
    """A block written outside remat_kit: [b, s, h] -> [b, s, h], no checkpoint names."""

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        y = nn.Dense(4 * h)(nn.LayerNorm()(x))
        return x + nn.Dense(h)(jnp.sin(y) * y)


class UserModel(nn.Module):
    kw: dict

    @nn.compact
    def __call__(self, x):
        return RematLayerStack(lambda name: UserBlock(name=name), num_layers=L, **self.kw)(x)


def _regroup(stacked, kw):
    """Plain per-layer params {"layers": {"block_0": [L, ...]}} rearranged for ``kw``'s stack."""
    block = stacked["layers"]["block_0"]
    take = lambda f: jax.tree.map(f, block)  # noqa: E731
    if "nested_groups" in kw:
        g = kw["nested_groups"]
        return {
            "layers": {"inner": {"block_0": take(lambda a: a.reshape(g, L // g, *a.shape[1:]))}}
        }
    k = kw["remat_layers"]
    if kw.get("placement") == "interleaved":
        m = L // k
        return {
            "layers": {
                f"block_{j}": take(lambda a, j=j: a.reshape(k, m, *a.shape[1:])[:, j])
                for j in range(m)
            }
        }
    return {
        "layers_0": {"block_0": take(lambda a: a[:k])},
        "layers_1": {"block_0": take(lambda a: a[k:])},
    }


VARIANTS = [  # "first" placement: test_bundled_model_nested_partial_and_chunked_loss
    dict(remat_layers=3, placement="interleaved"),
    dict(nested_groups=3, policy="no-remat"),
]


def _layer_inputs(residuals, shape):
    """Residuals stacked by a layer scan with per-layer shape ``shape``: their leading sizes."""
    return sorted(r.shape[0] for r in residuals if r.shape[1:] == shape and not r.is_argument)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_user_block_same_loss_and_grads(kw):
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    plain = UserModel({"policy": "save-nothing"})
    params = plain.init(jax.random.key(0), x)["params"]
    stack = params["RematLayerStack_0"]
    model = UserModel(kw)

    def loss(m, p):
        return jnp.mean(m.apply({"params": {"RematLayerStack_0": p}}, x) ** 2)

    regrouped = _regroup(stack, kw)
    assert jax.tree.structure(regrouped) == jax.tree.structure(
        model.init(jax.random.key(0), x)["params"]["RematLayerStack_0"]
    )
    want, want_g = jax.jit(jax.value_and_grad(lambda p: loss(plain, p)))(stack)
    got, got_g = jax.jit(jax.value_and_grad(lambda p: loss(model, p)))(regrouped)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(_regroup(want_g, kw)), jax.tree.leaves(got_g), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_user_block_residuals_follow_the_structure():
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)

    def residuals(kw):
        model = UserModel(kw)
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
        return saved_residuals(lambda p, h: model.apply({"params": p}, h).sum(), params, x)

    # Per-layer save-nothing keeps L layer inputs; nested keeps one per outer group.
    assert _layer_inputs(residuals({"policy": "save-nothing"}), (2, 8, 16)) == [L]
    assert _layer_inputs(residuals({"nested_groups": 2}), (2, 8, 16)) == [2]
    # First 2 layers rematerialised: their 2 inputs; the 4 others keep their activations.
    partial = residuals({"remat_layers": 2})
    assert 2 in _layer_inputs(partial, (2, 8, 16))
    assert _layer_inputs(partial, (2, 8, 64)) != []
    assert _layer_inputs(residuals({"policy": "save-nothing"}), (2, 8, 64)) == []


def test_user_block_takes_what_a_program_factory_receives():
    """The policy a Program factory is given (a jax policy callable, None for no remat) drives
    the stack as the equivalent name does."""
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)

    def residuals(kw):
        model = UserModel(kw)
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
        rows = saved_residuals(lambda p, h: model.apply({"params": p}, h).sum(), params, x)
        return sorted((r.shape, r.dtype) for r in rows if not r.is_argument)

    nothing = jax.checkpoint_policies.nothing_saveable
    assert residuals({"policy": nothing}) == residuals({"policy": "save-nothing"})
    assert residuals({"policy": None}) == residuals({"policy": "no-remat"})
    assert residuals({"policy": nothing}) != residuals({"policy": None})
    assert residuals({"policy": nothing, "remat_layers": 2}) == residuals(
        {"policy": "save-nothing", "remat_layers": 2}
    )


def test_layer_plan_and_groups():
    assert layer_plan(8) == (((True,), 8),)
    assert layer_plan(8, 0) == (((False,), 8),)
    assert layer_plan(8, 3) == (((True,), 3), ((False,), 5))
    assert layer_plan(8, 2, "interleaved") == (((True, False, False, False), 2),)
    assert [sqrt_groups(n) for n in (4, 9, 16, 32, 36)] == [2, 3, 4, 4, 6]
    with pytest.raises(ValueError, match="does not divide"):
        layer_plan(8, 3, "interleaved")
    with pytest.raises(ValueError, match="0..8"):
        layer_plan(8, 9)
    with pytest.raises(ValueError, match="placement"):
        layer_plan(8, 2, "middle")


def test_config_validation():
    with pytest.raises(ValueError, match="does not divide num_layers=4"):
        get_config("tiny-llama", nested_remat=True, nested_groups=3)
    with pytest.raises(ValueError, match="remat_group_size=1"):
        get_config("tiny-llama", remat_layers=2, remat_group_size=2)
    with pytest.raises(ValueError, match="nested_remat"):
        get_config("tiny-llama", nested_groups=2)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        get_config("tiny-llama", loss_chunk_size=0)
    assert get_config("llama3-8b", nested_remat=True).outer_groups == 4


def test_nested_params_map_to_mesh_axes():
    # Flax rejects a logical name used twice; the outer axis is "layers_outer".
    config = get_config("tiny-llama", nested_remat=True, remat_policy="save-nothing")
    _, shardings = sharded_train_state(config, make_optimizer("adamw"), T.local_mesh("fsdp=1"))
    kernel = shardings.params["stack"]["layers"]["inner"]["block_0"]["attn"]["query_proj"]["kernel"]
    assert kernel.spec == PartitionSpec(None, None, "fsdp", "tp", None)


def _batch(seq=8):
    tokens = jax.random.randint(jax.random.key(2), (2, seq + 1), 0, 256)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_bundled_model_nested_partial_and_chunked_loss():
    base = get_config("tiny-llama", num_layers=2, remat_policy="save-nothing")
    params = init_params(base, jax.random.key(0))
    batch = _batch()
    grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)
    want, want_g = grads(params, base, batch)
    cases = [
        (base.replace(remat_layers=1), dict(remat_layers=1)),
        (
            base.replace(nested_remat=True, nested_groups=2, loss_chunk_size=4),
            dict(nested_groups=2),
        ),
    ]
    global L
    saved, L = L, base.num_layers
    try:
        for config, kw in cases:
            p = dict(params)
            if kw is not None:
                p["stack"] = _regroup({"layers": p.pop("layers")}, kw)
            got, got_g = grads(p, config, batch)
            np.testing.assert_allclose(got, want, rtol=1e-5)
            if kw is not None:
                got_g = dict(got_g)
                regrouped = _regroup({"layers": want_g["layers"]}, kw)
                want_cmp = {
                    **{k: v for k, v in want_g.items() if k != "layers"},
                    "stack": regrouped,
                }
            else:
                want_cmp = want_g
            for a, b in zip(jax.tree.leaves(want_cmp), jax.tree.leaves(got_g), strict=True):
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    finally:
        L = saved


def test_chunked_loss_never_keeps_whole_logits():
    b, s, h, v = 2, 32, 8, 512
    x = jax.ShapeDtypeStruct((b, s, h), jnp.float32)
    w = jax.ShapeDtypeStruct((h, v), jnp.float32)
    t = jnp.zeros((b, s), jnp.int32)

    def whole(x, w):
        logits = jnp.dot(x, w)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

    def chunked(x, w):
        return chunked_cross_entropy(x, t, lambda c: jnp.dot(c, w), 8)

    big = lambda rs: [r.shape for r in rs if not r.is_argument and r.shape[-1:] == (v,)]  # noqa: E731
    assert big(saved_residuals(whole, x, w)) != []
    assert big(saved_residuals(chunked, x, w)) == []
    xr = jax.random.normal(jax.random.key(0), (b, s, h))
    wr = jax.random.normal(jax.random.key(1), (h, v))
    (lw, gw), (lc, gc) = (
        jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xr, wr) for f in (whole, chunked)
    )
    np.testing.assert_allclose(lc, lw, rtol=1e-5)
    for a, c in zip(gw, gc, strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="does not divide seq=32"):
        chunked_cross_entropy(xr, t, lambda c: jnp.dot(c, wr), 5)


def test_attention_choices():
    assert attention_choices("cpu") == ("xla",)
    assert attention_choices("h100-sxm", get_config("llama3-8b")) == ("xla", "cudnn")
    assert attention_choices("a100-80gb") == ("xla", "cudnn")
    assert attention_choices("h100-sxm", get_config("tiny-gpt")) == ("xla",)  # float32
    with pytest.raises(ValueError, match="target"):
        attention_choices("tpu-v9")
