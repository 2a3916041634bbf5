"""Optimizers by name (optax), for programs that say theirs as ``"adamw"``, ``"sgd"`` or
``"adafactor"``."""

from __future__ import annotations

import optax

from remat_kit.validation import unknown_value_error

OPTIMIZERS = ("adamw", "sgd", "adafactor")


def make_optimizer(
    name: str = "adamw",
    learning_rate: float | optax.Schedule = 3e-4,
    weight_decay: float = 0.1,
    grad_clip: float | None = 1.0,
) -> optax.GradientTransformation:
    """An optax optimizer by name: ``adamw`` (Loshchilov & Hutter 2019, arXiv:1711.05101; two
    moment buffers in the parameter dtype), ``sgd`` (no state), ``adafactor`` (factored second
    moments, Shazeer & Stern 2018, arXiv:1804.04235), with global-norm gradient clipping.

    Raises:
      ValueError: unknown optimizer name.
    """
    if name == "adamw":
        opt = optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay)
    elif name == "sgd":
        opt = optax.sgd(learning_rate)
    elif name == "adafactor":
        opt = optax.adafactor(learning_rate)
    else:
        raise unknown_value_error("optimizer", name, OPTIMIZERS)
    if grad_clip is None:
        return opt
    return optax.chain(optax.clip_by_global_norm(grad_clip), opt)
