"""Tagging models written elsewhere (tests/user_models) without editing their source."""

import chex
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from remat_kit import tag_linen, tag_nnx
from tests.user_models import linen_lm, nnx_lm

SAVE_MLPWI = jax.checkpoint_policies.save_only_these_names("mlpwi")


def _linen_loss(policy, tags=None):
    model = linen_lm.Decoder(linen_lm.Config(remat_policy=policy))
    apply = model.apply if tags is None else tag_linen(model.apply, tags)
    return lambda params, tokens: apply(params, tokens).mean()


def test_tag_linen_names_submodule_outputs_that_a_policy_saves(capsys):
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 256
    params = linen_lm.Decoder(linen_lm.Config()).init(jax.random.key(0), tokens)
    tagged = _linen_loss(SAVE_MLPWI, {"*/MlpBlock_0/Dense_0": "mlpwi"})
    print_saved_residuals(tagged, params, tokens)
    saved = capsys.readouterr().out
    assert saved.count("named 'mlpwi'") == 2, saved  # one per layer
    print_saved_residuals(_linen_loss(SAVE_MLPWI), params, tokens)
    assert "mlpwi" not in capsys.readouterr().out  # untagged: the policy had nothing to save
    # jitted: one compile per gradient instead of one per primitive run op by op
    grad = [jax.jit(jax.grad(f))(params, tokens) for f in (tagged, _linen_loss(None))]
    chex.assert_trees_all_close(*grad, rtol=1e-5)


def test_tag_linen_unknown_path_names_the_model_paths():
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = linen_lm.Decoder(linen_lm.Config()).init(jax.random.key(0), tokens)
    loss = _linen_loss(SAVE_MLPWI, {"*/Mlp/Dense_0": "mlpwi"})
    with pytest.raises(
        ValueError, match=r"'\*/Mlp/Dense_0' matches no module; closest: .*MlpBlock_0/Dense_0"
    ):
        loss(params, tokens)


def test_tag_nnx_in_place_saved_by_name_and_train_step_unchanged(capsys):
    tokens = jnp.arange(34, dtype=jnp.int32).reshape(2, 17) % 256
    plain = nnx_lm.make_model(SAVE_MLPWI)
    tagged = tag_nnx(nnx_lm.make_model(SAVE_MLPWI), {"blocks/*/mlp/linear1": "mlpwi"})
    graphdef, state = nnx.split(tagged)
    print_saved_residuals(lambda st, t: nnx_lm.loss_fn(nnx.merge(graphdef, st), t), state, tokens)
    assert capsys.readouterr().out.count("named 'mlpwi'") == nnx_lm.LAYERS
    losses = [
        nnx.jit(nnx_lm.train_step)(m, nnx_lm.make_optimizer(m), tokens) for m in (plain, tagged)
    ]
    assert float(losses[0]) == pytest.approx(float(losses[1]), rel=1e-6)


@pytest.mark.parametrize(
    "tags, match",
    [
        ({"blocks/*/mlp/lin": "mlpwi"}, r"'blocks/\*/mlp/lin' matches no module; closest: blocks/"),
        ({}, r"non-empty mapping"),
        ({"blocks/0/mlp": ""}, r"checkpoint name must be a non-empty string"),
    ],
)
def test_tag_nnx_bad_input(tags, match):
    with pytest.raises(ValueError, match=match):
        tag_nnx(nnx_lm.make_model(), tags)


def test_tag_nnx_refuses_a_second_name_for_one_module():
    model = tag_nnx(nnx_lm.make_model(), {"blocks/0/mlp/linear1": "mlpwi"})
    tag_nnx(model, {"blocks/0/mlp/linear1": "mlpwi"})  # same name again: no-op
    with pytest.raises(ValueError, match=r"already tagged 'mlpwi'; cannot tag it 'hidden'"):
        tag_nnx(model, {"blocks/0/mlp/linear1": "hidden"})
