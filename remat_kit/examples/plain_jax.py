"""A plain-JAX transformer (no Flax), written against nothing but jax and optax, that tags its own
tensors with names of its own choosing (not MaxText's): ``attn_in``, ``attn_out``,
``mlp_hidden``. Layers run under ``lax.scan`` with ``jax.checkpoint`` around the layer body.

Sizes: d_model ``D`` = 64, ``H`` = 4 heads, d_ff ``F`` = 256, ``L`` = 3 layers, vocab ``V`` = 256.

Example:
    >>> import jax
    >>> from remat_kit.examples import plain_jax
    >>> params = plain_jax.init(jax.random.key(0))
    >>> tokens = plain_jax.tokens(batch=2, seq=33)  # int32 [batch, seq]
    >>> loss = plain_jax.make_loss(jax.checkpoint_policies.nothing_saveable)(params, tokens)
    >>> float(loss) > 0
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

D, H, F, L, V = 64, 4, 256, 3, 256  # d_model, heads, d_ff, layers, vocab
TAGS = ("attn_in", "attn_out", "mlp_hidden")


def init(key: jax.Array) -> dict:
    """Parameters: ``embed`` [V, D], ``layers`` (stacked over L: ``wqkv`` [L, D, 3D], ``wo``
    [L, D, D], ``w1`` [L, D, F], ``w2`` [L, F, D]) and ``head`` [D, V], float32."""
    k = jax.random.split(key, 6)
    s = 0.02
    return {
        "embed": jax.random.normal(k[0], (V, D)) * s,
        "layers": {
            "wqkv": jax.random.normal(k[1], (L, D, 3 * D)) * s,
            "wo": jax.random.normal(k[2], (L, D, D)) * s,
            "w1": jax.random.normal(k[3], (L, D, F)) * s,
            "w2": jax.random.normal(k[4], (L, F, D)) * s,
        },
        "head": jax.random.normal(k[5], (D, V)) * s,
    }


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def layer(x, w):
    b, s, _ = x.shape
    qkv = checkpoint_name(_norm(x) @ w["wqkv"], "attn_in")  # [b, s, 3D]
    q, k, v = jnp.split(qkv.reshape(b, s, 3, H, D // H), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]) / (D // H) ** 0.5
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v[:, :, 0]).reshape(b, s, D)
    x = x + checkpoint_name(ctx @ w["wo"], "attn_out")
    h = checkpoint_name(jax.nn.gelu(_norm(x) @ w["w1"]), "mlp_hidden")
    return x + h @ w["w2"]


def make_loss(policy):
    """``loss(params, tokens)`` with each layer under ``jax.checkpoint(policy=policy)``."""
    body = jax.checkpoint(layer, policy=policy) if policy is not None else layer

    def loss_fn(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        x, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, params["layers"])
        logits = _norm(x) @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss_fn


def loop_loss(scan: bool, prevent_cse: bool = True):
    """A ``make_loss`` with the layers under ``jax.checkpoint(policy, prevent_cse)`` in
    ``lax.scan`` (``scan=True``) or an unrolled Python loop."""

    def make(policy):
        def body(x, w):
            if policy is None:
                return layer(x, w)
            return jax.checkpoint(layer, policy=policy, prevent_cse=prevent_cse)(x, w)

        def loss_fn(params, tokens):
            x = params["embed"][tokens[:, :-1]]
            if scan:
                x, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, params["layers"])
            else:
                for i in range(params["layers"]["w1"].shape[0]):
                    x = body(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]))
            logits = _norm(x) @ params["head"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return loss_fn

    return make


def make_step(policy):
    tx = optax.adamw(1e-3)
    loss_fn = make_loss(policy)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def tokens(batch: int = 2, seq: int = 33, seed: int = 0) -> jax.Array:
    """Random token ids, int32 [batch, seq] in [0, V): the loss predicts tokens[:, 1:] from
    tokens[:, :-1]."""
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, V, dtype=jnp.int32)


def abstract_args(batch: int = 2, seq: int = 33):
    params = jax.eval_shape(init, jax.random.key(0))
    return (
        params,
        jax.eval_shape(optax.adamw(1e-3).init, params),
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
    )


def program():
    """The program the command line loads: ``--model remat_kit.examples.plain_jax:program``."""
    from remat_kit import Program

    params, _, token_ids = abstract_args(batch=2, seq=33)
    return Program.from_loss(make_loss, params, token_ids, name="plain-jax")
