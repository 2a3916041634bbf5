"""Chunked cross-entropy: the LM head and the loss over sequence chunks, under remat.

The whole-sequence loss materialises the logits [batch, seq, vocab] in the compute dtype, a
float32 copy for the softmax, and the logits' gradient: remat policies inside the layer stack do
not touch them (llama3-8b, b=1, s=8192: 2 GiB bf16 logits plus a 4 GiB float32 copy). Here a
``lax.scan`` runs over ``seq // chunk_size`` chunks; each step computes one chunk's logits
[batch, chunk, vocab] and the summed loss inside ``jax.checkpoint`` (nothing saved), so the
forward keeps only the scan's inputs (the hidden states [batch, seq, d_model]) and the backward
recomputes one chunk's logits at a time. Cost: the LM head's matmul runs once more (forward
again in the backward pass). Same idea as Liger-Kernel's fused linear cross-entropy and
MaxText's ``num_vocab_tiling``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from remat_kit.models.config import ModelConfig
from remat_kit.models.transformer import make_model


def chunked_cross_entropy(
    hidden: jax.Array,
    targets: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk_size: int,
) -> jax.Array:
    """Mean next-token cross-entropy (nats) computed chunk by chunk along the sequence.

    Args:
      hidden: [batch, seq, d_model], the LM head's input.
      targets: [batch, seq] int token ids.
      logits_fn: ``x [batch, chunk, d_model] -> logits [batch, chunk, vocab]`` (any float dtype,
        upcast to float32); may close over traced parameters (their gradients flow). A function
        of arrays: inside a linen module it must not call a submodule (``nn.Dense`` called
        under this function's ``jax.checkpoint`` / ``lax.scan`` leaks tracers, flax's
        ``UnexpectedTracerError``); take the head's kernel as an array instead, e.g.
        ``kernel = self.param("head", init, (d_model, vocab))`` then
        ``lambda x: x @ kernel``, or call it outside ``apply`` with the params tree.
      chunk_size: tokens per chunk; must divide ``seq``.

    Returns:
      float32 scalar, equal (within float32 summation order) to
      ``optax.softmax_cross_entropy_with_integer_labels(logits_fn(hidden), targets).mean()``.

    Raises:
      ValueError: ``chunk_size`` not a positive divisor of ``seq``; shapes that disagree.
    """
    b, s, h = hidden.shape
    if targets.shape != (b, s):
        raise ValueError(f"targets shape {targets.shape} does not match hidden {hidden.shape}")
    if not isinstance(chunk_size, int) or chunk_size <= 0 or s % chunk_size:
        valid = [d for d in range(1, s + 1) if s % d == 0]
        raise ValueError(
            f"chunk_size={chunk_size!r} does not divide seq={s}; valid chunk sizes: {valid}"
        )
    n = s // chunk_size
    xs = hidden.reshape(b, n, chunk_size, h).swapaxes(0, 1)  # (n, b, c, h)
    ts = targets.reshape(b, n, chunk_size).swapaxes(0, 1)  # (n, b, c)

    # Nothing saved but the inputs; under the scan CSE cannot merge the recompute back.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_loss(x, t):
        logits = logits_fn(x).astype(jnp.float32)  # (b, c, V)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).sum()

    def body(total, xt):
        return total + chunk_loss(*xt), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts))
    return total / (b * s)


def lm_head_logits(config: ModelConfig, params: Any, x: jax.Array) -> jax.Array:
    """The bundled Transformer's LM head on ``x [..., d_model]`` -> ``[..., vocab]`` in the
    compute dtype: the tied embedding transposed, or the ``lm_head`` kernel [d_model, vocab]."""
    dtype = config.compute_dtype
    if config.tied_embeddings:
        return jnp.dot(x.astype(dtype), params["embed"]["embedding"].astype(dtype).T)
    return jnp.dot(x.astype(dtype), params["lm_head"]["kernel"].astype(dtype))


def chunked_model_loss(params: Any, config: ModelConfig, batch: dict[str, jax.Array]) -> jax.Array:
    """The bundled model's mean loss on ``batch`` ({"inputs", "targets"}: [batch, seq] int32)
    with the LM head and cross-entropy chunked by ``config.loss_chunk_size`` tokens.

    Raises:
      ValueError: ``config.loss_chunk_size`` is None or does not divide the sequence length.
    """
    if config.loss_chunk_size is None:
        raise ValueError("config.loss_chunk_size is None; set it to a divisor of the sequence")
    hidden = make_model(config).apply({"params": params}, batch["inputs"], return_hidden=True)
    return chunked_cross_entropy(
        hidden,
        batch["targets"],
        lambda x: lm_head_logits(config, params, x),
        config.loss_chunk_size,
    )
