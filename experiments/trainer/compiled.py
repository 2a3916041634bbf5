"""What the training loop compiles and keeps: optimizers with injected hyperparameters, initial
parameters, the compiled train step and the jitted validation loss.

Each cache is a ``functools.lru_cache`` with a ``maxsize`` (so a process that trains many
configs holds a bounded number of executables); :func:`clear_caches` empties them all. They make
runs of the same shapes in one process (a resume, a test) compile once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from remat_kit import targets as T
from remat_kit.models import ModelConfig, make_model
from remat_kit.training.step import (
    TrainState,
    abstract_batch,
    abstract_train_state,
    init_params,
    loss_fn,
    make_optimizer,
    make_train_step,
    sharded_train_state,
)

from .config import TrainConfig


def optimizer_for(cfg: TrainConfig) -> optax.GradientTransformation:
    """``make_optimizer`` with the learning rate and weight decay held in the optimizer state
    (``optax.inject_hyperparams``), so one compiled step serves every value of them."""
    return _injected(*opt_key(cfg))(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)


def opt_key(cfg: TrainConfig) -> tuple[str, float | None]:
    """What of ``cfg``'s optimizer shapes the compiled step: ``(optimizer, grad_clip)``."""
    return (cfg.optimizer, cfg.grad_clip)


@functools.lru_cache(maxsize=16)
def _injected(name: str, grad_clip: float | None) -> Callable[..., optax.GradientTransformation]:
    return functools.partial(
        optax.inject_hyperparams(make_optimizer, static_args=("name", "grad_clip")),
        name=name,
        grad_clip=grad_clip,
    )


@functools.lru_cache(maxsize=8)
def _initial_params(model: ModelConfig, seed: int) -> Any:
    """Initial parameters (host numpy arrays) for ``model`` and ``seed``, computed by one jitted
    init (op-by-op init costs seconds on CPU). The remat policy does not change the parameters,
    so the cache key ignores it: every policy starts from the same values."""
    model = model.replace(remat_policy="no-remat")
    init_key, _ = jax.random.split(jax.random.key(seed))
    return jax.device_get(jax.jit(init_params, static_argnums=0)(model, init_key))


def initial_state(cfg: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """A fresh TrainState with its own buffers (the train step donates them); on ``mesh``,
    sharded as the train step takes it (every process places its own shards)."""
    host = _initial_params(cfg.model_config(), cfg.seed)
    if mesh is None:
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), host)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer_for(cfg).init(params)
        )
    init, shardings = _init_on_mesh(
        cfg.model_config(), opt_key(cfg), cfg.lr, cfg.weight_decay, mesh
    )
    return init(T.put_global(host, shardings.params))


@functools.lru_cache(maxsize=8)
def _init_on_mesh(
    model: ModelConfig, opt: tuple, lr: float, weight_decay: float, mesh: Mesh
) -> tuple[Callable, TrainState]:
    """Jitted ``params -> TrainState`` (step 0, fresh optimizer state) laid out on ``mesh``, and
    the state's shardings."""
    optimizer = _injected(*opt)(learning_rate=lr, weight_decay=weight_decay)
    shardings = sharded_train_state(model, optimizer, mesh)[1]
    init = jax.jit(
        lambda params: TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
        ),
        out_shardings=shardings,
    )
    return init, shardings


@functools.lru_cache(maxsize=16)
def compiled_step(
    model: ModelConfig,
    opt: tuple,
    micro_batches: int,
    batch_size: int,
    seq_len: int,
    mesh: Mesh | None = None,
    on_micro_batch: Callable[[Any, Any], None] | None = None,
) -> tuple[Any, float]:
    """The compiled train step (state donated; on ``mesh``, sharded) and its compile time in
    seconds. ``opt`` is :func:`opt_key`; ``on_micro_batch`` see
    :func:`remat_kit.training.make_train_step`."""
    optimizer = _injected(*opt)(learning_rate=0.0, weight_decay=0.0)  # values live in the state
    step = make_train_step(
        model, optimizer, micro_batches=micro_batches, mesh=mesh, on_micro_batch=on_micro_batch
    )
    t0 = time.perf_counter()
    compiled = step.lower(
        abstract_train_state(model, optimizer), abstract_batch(batch_size, seq_len)
    ).compile()
    return compiled, time.perf_counter() - t0


@functools.lru_cache(maxsize=16)
def eval_fn(model: ModelConfig, mesh: Mesh | None = None) -> Callable:
    """Jitted ``(params, inputs, targets) -> mean loss``; on ``mesh``, batch split as in
    training."""

    def loss(params, inputs, targets):
        with T.activation_sharding(mesh):
            return loss_fn(params, model, {"inputs": inputs, "targets": targets})

    return jax.jit(loss)


def clear_caches() -> None:
    """Forget every cached executable, initial parameters and optimizer of this module (and
    the model cache of :func:`remat_kit.make_model`): the next run compiles afresh."""
    for cache in (_injected, _initial_params, _init_on_mesh, compiled_step, eval_fn, make_model):
        cache.cache_clear()
