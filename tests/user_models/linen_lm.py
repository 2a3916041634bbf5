"""A small decoder-only LM in flax.linen, written the way flax's examples write one (lm1b style:
sinusoidal positions, ReLU MLP, linen's own attention, an unrolled Python loop over layers),
knowing nothing of remat-kit. It carries no checkpoint_name tags; the only remat hook is the
``remat_policy`` field (``nn.remat`` around each block when set)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    emb_dim: int = 64
    num_heads: int = 4
    mlp_dim: int = 256
    num_layers: int = 2
    max_len: int = 128
    remat_policy: Any = None  # a jax.checkpoint policy; None: no remat


def sinusoidal(max_len: int, dim: int) -> np.ndarray:
    pos = np.arange(max_len)[:, None]
    div = np.exp(np.arange(0, dim, 2) * (-np.log(10000.0) / dim))
    table = np.zeros((max_len, dim), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    return table


class MlpBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.config.mlp_dim)(x))
        return nn.Dense(self.config.emb_dim)(h)


class DecoderBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.MultiHeadDotProductAttention(num_heads=self.config.num_heads, deterministic=True)(
            nn.LayerNorm()(x), mask=mask
        )
        x = x + y
        return x + MlpBlock(self.config)(nn.LayerNorm()(x))


class Decoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        x = nn.Embed(c.vocab_size, c.emb_dim)(tokens)
        x = x + sinusoidal(c.max_len, c.emb_dim)[None, : tokens.shape[1]]
        block = (
            DecoderBlock
            if c.remat_policy is None
            else nn.remat(DecoderBlock, policy=c.remat_policy)
        )
        for i in range(c.num_layers):
            x = block(c, name=f"layers_{i}")(x)
        return nn.Dense(c.vocab_size, name="logits")(nn.LayerNorm()(x))


def make_loss(policy, config: Config = Config(), apply_wrapper=None):
    """``loss(params, tokens)``: next-token cross-entropy with ``policy``."""
    model = Decoder(dataclasses.replace(config, remat_policy=policy))
    apply = model.apply if apply_wrapper is None else apply_wrapper(model.apply)

    def loss_fn(params, tokens):
        logits = apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss_fn


def make_step(policy, config: Config = Config(), apply_wrapper=None):
    """``step(params, opt_state, tokens) -> (params, opt_state, loss)`` with ``policy``."""
    loss_fn = make_loss(policy, config, apply_wrapper)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def abstract_args(batch: int = 2, seq: int = 33, config: Config = Config()):
    model = Decoder(config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.ones((batch, seq - 1), jnp.int32))
    )
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
    return params, opt_state, tokens
