"""A small decoder-only transformer in Equinox, written the way equinox's docs write models
(``eqx.Module`` classes built from ``eqx.nn`` layers with a ``key``, one sequence per call and
``jax.vmap`` over the batch, layers stacked with ``eqx.filter_vmap`` and run under
``lax.scan`` through ``eqx.partition`` / ``eqx.combine``, ``eqx.filter_checkpoint`` around the
layer, a step under ``eqx.filter_jit`` / ``eqx.filter_value_and_grad``), knowing nothing of
remat-kit. Its modules carry Python floats and bools as leaves (``eqx.nn.Dropout``'s ``p`` and
``inference``, ``eqx.nn.MultiheadAttention``'s dropout), and it emits no checkpoint names; the
only remat hook is the ``remat_policy`` argument of ``Transformer.__call__``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

D, HEADS, F, LAYERS, VOCAB, SEQ = 32, 2, 64, 2, 64, 16  # d_model, heads, d_ff, layers, vocab, seq


class AttentionBlock(eqx.Module):
    layernorm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.layernorm = eqx.nn.LayerNorm(D)
        self.attention = eqx.nn.MultiheadAttention(HEADS, D, dropout_p=0.1, inference=True, key=key)
        self.dropout = eqx.nn.Dropout(0.1, inference=True)

    def __call__(self, x):  # x: [seq, d_model]
        y = jax.vmap(self.layernorm)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        return x + self.dropout(self.attention(y, y, y, mask=mask))


class FeedForward(eqx.Module):
    layernorm: eqx.nn.LayerNorm
    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layernorm = eqx.nn.LayerNorm(D)
        self.mlp = eqx.nn.Linear(D, F, key=k1)
        self.output = eqx.nn.Linear(F, D, key=k2)
        self.dropout = eqx.nn.Dropout(0.1, inference=True)

    def __call__(self, x):  # x: [seq, d_model]
        h = jax.nn.gelu(jax.vmap(self.mlp)(jax.vmap(self.layernorm)(x)))  # [seq, d_ff]
        return x + self.dropout(jax.vmap(self.output)(h))


class TransformerLayer(eqx.Module):
    attention_block: AttentionBlock
    ff_block: FeedForward

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attention_block = AttentionBlock(k1)
        self.ff_block = FeedForward(k2)

    def __call__(self, x):
        return self.ff_block(self.attention_block(x))


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    layers: TransformerLayer  # stacked: every array has a leading [layers] axis
    layernorm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, D, key=k_embed)
        self.layers = eqx.filter_vmap(TransformerLayer)(jax.random.split(k_layers, LAYERS))
        self.layernorm = eqx.nn.LayerNorm(D)
        self.head = eqx.nn.Linear(D, VOCAB, key=k_head)

    def __call__(self, tokens, remat_policy: Callable[..., Any] | None = None):
        """Logits [seq, vocab] of one sequence of token ids [seq]; each layer under
        ``eqx.filter_checkpoint(policy=remat_policy)`` unless it is None."""
        x = jax.vmap(self.embedding)(tokens)  # [seq, d_model]
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def layer(x, params):
            return eqx.combine(params, static)(x)

        if remat_policy is not None:
            layer = eqx.filter_checkpoint(layer, policy=remat_policy)
        x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, dynamic)
        return jax.vmap(self.head)(jax.vmap(self.layernorm)(x))


def make_loss(policy):
    """``loss(model, tokens)``: next-token cross-entropy over a batch [batch, seq + 1]."""

    def loss(model, tokens):
        logits = jax.vmap(lambda t: model(t, policy))(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


OPTIMIZER = optax.adamw(1e-3)


def make_step(policy):
    """The step as equinox's docs write one: filter_jit, filter_value_and_grad, the optimizer
    state over the model's arrays, eqx.apply_updates."""
    loss = make_loss(policy)

    @eqx.filter_jit
    def step(model, opt_state, tokens):
        value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def arguments(batch: int = 2):
    """A concrete model, its optimizer state and a batch of tokens [batch, SEQ + 1]."""
    model = Transformer(jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    tokens = jax.random.randint(jax.random.key(1), (batch, SEQ + 1), 0, VOCAB)
    return model, opt_state, tokens


def abstract_arguments(batch: int = 2):
    """The same as :func:`arguments`, abstract (``jax.ShapeDtypeStruct`` leaves, nothing
    computed; the modules' float / bool leaves as they are)."""
    model = eqx.filter_eval_shape(Transformer, jax.random.key(0))
    # eqx.is_array is False for a ShapeDtypeStruct: filter the abstract arrays by their type
    arrays = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(OPTIMIZER.init, arrays)
    return model, opt_state, jax.ShapeDtypeStruct((batch, SEQ + 1), jnp.int32)


def program():
    """``--model tests/user_models/eqx_lm.py:program``: the equinox step as written."""
    from remat_kit import Program

    model, opt_state, tokens = abstract_arguments()
    return Program.from_step(
        make_step, model, opt_state, tokens, donate_argnums=(0, 1),
        make_loss=make_loss, loss_args=(model, tokens), name="eqx-lm",
    )  # fmt: skip
