"""A small decoder-only LM in flax.nnx, written the way flax's NNX examples write one (modules
holding their parameters, ``nnx.MultiHeadAttention``, an ``nnx.Optimizer`` mutated by a train
step), knowing nothing of remat-kit. No checkpoint_name tags; each block's call runs under
``nnx.remat(policy=...)`` when a policy is given."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax

VOCAB, D, HEADS, FF, LAYERS = 256, 64, 4, 256, 2


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(D, FF, rngs=rngs)
        self.linear2 = nnx.Linear(FF, D, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jax.nn.gelu(self.linear1(x)))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, decode=False, deterministic=True, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, policy=None):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)
        self.policy = policy

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            if self.policy is None:
                x = block(x)
            else:
                x = nnx.remat(lambda b, h: b(h), policy=self.policy)(block, x)
        return self.head(self.norm(x))


def make_model(policy=None, seed: int = 0) -> LM:
    return LM(nnx.Rngs(seed), policy=policy)


def make_optimizer(model: LM) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def loss_fn(model: LM, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train_step(model: LM, optimizer: nnx.Optimizer, tokens):
    """The idiomatic NNX step: mutates ``model`` and ``optimizer`` in place."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss
