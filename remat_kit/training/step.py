"""Loss, optimizer, train state and the train-step factory (real, abstract or sharded state)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit import targets as T
from remat_kit.models import ModelConfig, chunked_model_loss, make_model
from remat_kit.optimizers import OPTIMIZERS as OPTIMIZERS
from remat_kit.optimizers import make_optimizer as make_optimizer
from remat_kit.validation import positive_int

Batch = dict[str, jax.Array]  # {"inputs": [b, s] int32, "targets": [b, s] int32}


@flax.struct.dataclass
class TrainState:
    """Everything a training step updates: step counter, parameters, optimizer state."""

    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any


def cross_entropy_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats.

    Args:
      logits: [batch, seq, vocab], any float dtype (upcast to float32).
      targets: [batch, seq] int token ids.

    Returns:
      float32 scalar.
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


def loss_fn(params: Any, config: ModelConfig, batch: Batch) -> jax.Array:
    """Loss of the model for ``config`` on ``batch`` ({"inputs", "targets"}: [batch, seq]);
    over sequence chunks when ``config.loss_chunk_size`` is set (the full [batch, seq, vocab]
    logits never exist at once: :func:`remat_kit.models.chunked_model_loss`)."""
    if config.loss_chunk_size is not None:
        return chunked_model_loss(params, config, batch)
    logits = make_model(config).apply({"params": params}, batch["inputs"])
    return cross_entropy_loss(logits, batch["targets"])


def init_params(config: ModelConfig, rng: jax.Array, seq_len: int = 8) -> Any:
    """Initialise parameters (real arrays). Parameter shapes do not depend on ``seq_len``."""
    return flax.core.meta.unbox(init_boxed_params(config, rng, seq_len))


def init_boxed_params(config: ModelConfig, rng: jax.Array, seq_len: int = 8) -> Any:
    """Parameters as flax ``LogicallyPartitioned`` boxes carrying logical axis names (for
    ``nn.get_partition_spec``); :func:`init_params` unboxes them."""
    tokens = jnp.zeros((1, min(seq_len, config.max_seq_len)), jnp.int32)
    return make_model(config).init(rng, tokens)["params"]


def init_train_state(
    config: ModelConfig, optimizer: optax.GradientTransformation, rng: jax.Array
) -> TrainState:
    """A fresh :class:`TrainState` with real arrays."""
    params = init_params(config, rng)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )


def abstract_train_state(
    config: ModelConfig, optimizer: optax.GradientTransformation
) -> TrainState:
    """The :class:`TrainState` as ``jax.ShapeDtypeStruct`` leaves: shapes only, nothing allocated
    (``jax.eval_shape``)."""
    return jax.eval_shape(lambda: init_train_state(config, optimizer, jax.random.key(0)))


def abstract_batch(batch_size: int, seq_len: int) -> Batch:
    """The batch as ``jax.ShapeDtypeStruct``: {"inputs", "targets"}: [batch_size, seq_len] int32.

    Raises:
      ValueError: non-positive batch_size or seq_len.
    """
    positive_int("batch_size", batch_size)
    positive_int("seq_len", seq_len)
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return {"inputs": spec, "targets": spec}


def check_micro_batches(batch_size: int, micro_batches: int) -> int:
    """Return ``batch_size`` if ``micro_batches`` micro-batches of whole rows make it up.

    Raises:
      ValueError: either is not a positive integer, or ``batch_size % micro_batches != 0``.
    """
    positive_int("batch_size", batch_size)
    positive_int("micro_batches", micro_batches)
    if batch_size % micro_batches:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by micro_batches={micro_batches}; the "
            "micro-batch size must be a whole number of rows"
        )
    return batch_size


def grad_fn(
    config: ModelConfig,
    micro_batches: int = 1,
    before_micro_batch: Callable[[jax.Array], Any] | None = None,
) -> Callable[[Any, Batch], tuple]:
    """``(params, batch) -> (loss, grads)``, accumulating over ``micro_batches`` micro-batches.

    Accumulation is a ``lax.scan`` over micro-batches (batch [n*m, s] split into n micro-batches
    [m, s], micro-batch k taking rows k, k + n, ...): the
    activations of one micro-batch are live at a time, so activation memory is ~1/n of the full
    batch, and the gradients are summed in float32 then averaged (equal to one big batch within
    float tolerance).

    ``before_micro_batch(k)`` (traced, ``k`` an int32 scalar) is called as micro-batch ``k``
    begins, e.g. to put a ``jax.debug.callback`` there; None adds nothing to the program.

    Raises:
      ValueError: the batch size is not divisible by ``micro_batches``.
    """
    vg = jax.value_and_grad(loss_fn)
    if micro_batches == 1:

        def one(params, batch):
            if before_micro_batch is not None:
                before_micro_batch(jnp.zeros((), jnp.int32))
            return vg(params, config, batch)

        return one

    def accumulate(params, batch):
        b = check_micro_batches(batch["inputs"].shape[0], micro_batches)
        # Micro-batch k holds rows k, k + n, k + 2n, ... (a strided split): with the batch
        # split over devices along its rows, every device then holds an equal share of every
        # micro-batch, and no micro-batch has to be moved between devices.
        split = jax.tree.map(
            lambda x: x.reshape(b // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1),
            batch,
        )  # [n, b // n, s]
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(carry, xs):
            loss_sum, g_sum = carry
            if before_micro_batch is None:
                micro = xs
            else:
                k, micro = xs
                before_micro_batch(k)
            loss, g = vg(params, config, micro)
            g_sum = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), g_sum, g)
            return (loss_sum + loss, g_sum), None

        xs = split if before_micro_batch is None else (jnp.arange(micro_batches), split)
        (loss_sum, g_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), xs)
        grads = jax.tree.map(lambda g, p: (g / micro_batches).astype(p.dtype), g_sum, params)
        return loss_sum / micro_batches, grads

    return accumulate


def make_train_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    micro_batches: int = 1,
    donate: bool = True,
    jit: bool = True,
    mesh: Mesh | None = None,
    on_micro_batch: Callable[[Any, Any], None] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """``step(state, batch) -> (new_state, {"loss", "grad_norm"})``: forward, backward (with the
    config's remat policy), optax update. With ``donate`` the state's buffers are donated
    (``donate_argnums=0``) so the update happens in place, as in a real training loop.

    With a ``mesh`` (axes dp, fsdp, tp; :mod:`remat_kit.targets`) the jitted step takes and
    returns the state sharded as :func:`sharded_train_state` lays it out and the batch split
    over (dp, fsdp), the metrics replicated; each block's input is split along the batch while
    the step is traced (:func:`remat_kit.targets.activation_sharding`).

    ``on_micro_batch(step, k)`` (host callback, two int32 scalars: the state's step counter and
    the micro-batch index) runs through ``jax.debug.callback`` as micro-batch ``k`` begins; it
    changes the compiled program (the experiments' trainer kills a run between micro-batches
    with it: ``experiments/trainer/faults.py``).

    Raises:
      ValueError (with ``mesh``): a parameter dimension not divisible by its mesh axes.
    """

    def step(state: TrainState, batch: Batch):
        hook = None
        if on_micro_batch is not None:
            hook = lambda k: jax.debug.callback(on_micro_batch, state.step, k)  # noqa: E731
        grads_of = grad_fn(config, micro_batches, hook)
        # Without a mesh, leave an enclosing activation_sharding (the analyzer's) in force.
        with T.activation_sharding(mesh) if mesh is not None else contextlib.nullcontext():
            loss, grads = grads_of(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if not jit:
        return step
    donate_argnums = (0,) if donate else ()
    if mesh is None:
        return jax.jit(step, donate_argnums=donate_argnums)
    _, state_shardings = sharded_train_state(config, optimizer, mesh)
    return jax.jit(
        step,
        in_shardings=(state_shardings, T.batch_sharding(mesh)),
        out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=donate_argnums,
    )


def sharded_train_state(
    config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> tuple[TrainState, TrainState]:
    """The abstract train state and its shardings on ``mesh`` (nothing allocated).

    Parameters are split as their logical axes say (:data:`remat_kit.targets.LOGICAL_RULES`),
    optimizer moments like their parameters, everything else replicated.

    Returns:
      ``(state, shardings)``: a :class:`TrainState` of ``jax.ShapeDtypeStruct`` leaves carrying
      their ``NamedSharding``, and the same tree of shardings (for ``jax.jit(in_shardings=...)``).

    Raises:
      ValueError: a parameter dimension not divisible by its mesh axes.
    """
    boxed = jax.eval_shape(lambda: init_boxed_params(config, jax.random.key(0)))
    p_shard = T.param_shardings(boxed, mesh)
    state = abstract_train_state(config, optimizer)
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = TrainState(
        step=replicated,
        params=p_shard,
        opt_state=T.like_params_shardings(state.opt_state, state.params, p_shard, mesh),
    )
    abstract = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings
    )
    return abstract, shardings
