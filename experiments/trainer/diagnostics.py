"""Diagnostics of training: where a result was measured (:func:`environment_info`), one update
as one batch vs accumulated (:func:`compare_updates`), and the compiled step's memory
(:func:`train_step_memory`)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

import jax
import jax.numpy as jnp

from remat_kit.training.step import check_micro_batches, grad_fn

from .compiled import compiled_step, initial_state, opt_key
from .config import TrainConfig
from .data import load_corpus


def environment_info() -> dict[str, Any]:
    """Where a result was measured: hardware, backend and library versions (JSON-ready)."""

    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                None,
            )
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d.device_kind) for d in jax.devices()],
        "process_count": jax.process_count(),
        "python": sys.version.split()[0],
        **{
            name: version(name)
            for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
        },
    }


def compare_updates(cfg: TrainConfig, micro_batches: int, grads: bool = True) -> dict[str, Any]:
    """One optimizer update as one batch vs accumulated over ``micro_batches`` micro-batches.

    Both start from the same initial state (``cfg.seed``) and take the same global batch
    ``batch_at(0)`` of shape [cfg.batch_size, cfg.seq_len]; the first compiles the step with
    ``micro_batches=1``, the second with ``micro_batches`` (``cfg.micro_batches`` is ignored).

    Args:
      cfg: model, optimizer, batch and data; ``cfg.micro_batches`` is ignored.
      micro_batches: micro-batches of the accumulated step; divides ``cfg.batch_size``.
      grads: also compare the gradients themselves (two more compiles, of ``grad_fn``).

    Returns:
      ``loss_abs_diff`` (nats) and ``grad_norm_abs_diff`` of the two steps; with ``grads``,
      ``grads_max_abs_diff`` (largest absolute difference of any gradient element) and
      ``grads_max_abs`` (largest gradient magnitude, for scale); ``params_max_abs_diff``
      (largest absolute difference of any parameter after the update), ``params_worst_leaf``
      (the parameter path where it occurs) and ``params_max_abs`` (for scale);
      ``memory_one_batch`` and ``memory_accumulated``: the :func:`train_step_memory` dicts
      (bytes) of the two compiled steps, and ``temp_ratio``: one-batch temp bytes /
      accumulated temp bytes.

    Note: Adam's first update is ``lr * g / (|g| + eps)`` per element, so for elements whose
    gradient is near 0 it magnifies float noise in ``g`` (an attention key bias has a true
    gradient of exactly 0: softmax ignores a shift shared by all keys; its ~1e-10 noise becomes
    a step of ~``lr * 1e-10 / eps``). ``params_max_abs_diff`` can then be ~1e-5 with
    ``lr = 1e-3`` while the gradients agree to ~1e-7: compare the gradients.

    Raises:
      ValueError: ``cfg.batch_size`` not divisible by ``micro_batches``.
    """
    check_micro_batches(cfg.batch_size, micro_batches)
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes, val_fraction=cfg.val_fraction)
    inputs, targets = corpus.batcher(cfg.batch_size, cfg.seq_len, cfg.seed).batch_at(0)
    batch = {"inputs": inputs, "targets": targets}
    model = cfg.model_config()
    steps, gradients, memory = [], [], []
    for n in (1, micro_batches):
        state = initial_state(cfg)  # fresh buffers: the step donates them
        if grads:
            gradients.append(jax.jit(grad_fn(model, n))(state.params, batch)[1])
        compiled, _ = compiled_step(model, opt_key(cfg), n, cfg.batch_size, cfg.seq_len)
        steps.append(compiled(state, batch))
        memory.append(_memory(compiled))
    (s1, m1), (sn, mn) = steps

    def max_abs(tree) -> float:
        return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))

    param_diffs = jax.tree_util.tree_leaves_with_path(
        jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s1.params, sn.params)
    )
    worst_path, worst = max(param_diffs, key=lambda kv: kv[1])
    out: dict[str, Any] = {
        "loss_abs_diff": abs(float(m1["loss"]) - float(mn["loss"])),
        "grad_norm_abs_diff": abs(float(m1["grad_norm"]) - float(mn["grad_norm"])),
    }
    if grads:
        out["grads_max_abs_diff"] = max_abs(jax.tree.map(lambda a, b: a - b, *gradients))
        out["grads_max_abs"] = max_abs(gradients[0])
    return out | {
        "params_max_abs_diff": worst,
        "params_worst_leaf": jax.tree_util.keystr(worst_path),
        "params_max_abs": max_abs(s1.params),
        "memory_one_batch": memory[0],
        "memory_accumulated": memory[1],
        "temp_ratio": memory[0]["temp_bytes"] / max(memory[1]["temp_bytes"], 1),
    }


def train_step_memory(cfg: TrainConfig) -> dict[str, int]:
    """XLA's memory analysis of ``cfg``'s compiled train step on the local backend (nothing run).

    The step is compiled for ``cfg``'s model, optimizer, ``micro_batches``, ``batch_size`` and
    ``seq_len``, with the train state donated as in :func:`train`.

    Returns:
      Bytes: ``temp_bytes`` (scratch: activations and residuals kept for the backward pass,
      gradient buffers, optimizer temporaries), ``argument_bytes``, ``output_bytes``,
      ``alias_bytes`` (donated arguments reused for outputs) and ``peak_bytes`` = argument +
      output + temp - alias.
    """
    compiled, _ = compiled_step(
        cfg.model_config(), opt_key(cfg), cfg.micro_batches, cfg.batch_size, cfg.seq_len
    )
    return _memory(compiled)


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }
    out["peak_bytes"] = (
        out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    )
    return out
