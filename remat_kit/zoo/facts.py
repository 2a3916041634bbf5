"""What a measured run of a bundled model needs beyond its program: parameter counts, the
model FLOPs behind tokens per second and MFU, the initial train state, the step on a mesh.

Every function takes a preset as :func:`remat_kit.zoo.preset` does: a name (or config) and
the model fields changed (``remat_group_size=2``, ``scan_layers=True``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from remat_kit.models import ModelConfig, get_config
from remat_kit.training.step import TrainState, init_params, init_train_state, make_train_step
from remat_kit.zoo import PresetLike


def param_counts(model: PresetLike, **changes: Any) -> tuple[int, int]:
    """(all parameters, parameters used in matmuls) of the preset, from shapes only (nothing
    allocated): embedding and position tables are lookups, not matmuls, unless the embedding
    is tied to the output projection."""
    config = get_config(model, **changes)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    total = matmul = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        n = math.prod(leaf.shape)
        total += n
        top = getattr(path[0], "key", str(path[0]))
        if top == "pos_embed" or (top == "embed" and not config.tied_embeddings):
            continue  # lookup tables: no matmul (a tied embedding is also the output matmul)
        matmul += n
    return total, matmul


def model_flops_per_token(model: PresetLike, seq_len: int, **changes: Any) -> float:
    """Training FLOPs per token, PaLM appendix B (Chowdhery et al. 2022, arXiv:2204.02311):
    ``6 N + 12 L H Q T`` with N the parameters used in matmuls (:func:`param_counts`), L
    layers, H query heads, Q head dimension (``H Q = d_model``), T = ``seq_len`` [tokens].
    Forward plus backward, no recomputation; the attention term counts the full (unmasked)
    ``T x T`` scores, as the compiled attention computes them."""
    config = get_config(model, **changes)
    return _flops_per_token(config, seq_len, param_counts(config)[1])


def _flops_per_token(config: ModelConfig, seq_len: int, matmul: int) -> float:
    return 6.0 * matmul + 12.0 * config.num_layers * config.d_model * seq_len


def model_facts(model: PresetLike, seq_len: int, **changes: Any) -> dict[str, Any]:
    """A results row's model fields: ``num_params``, ``matmul_params`` (:func:`param_counts`),
    ``model_flops_per_token`` (:func:`model_flops_per_token` at ``seq_len`` [tokens]),
    ``dtype`` (the compute dtype) and ``fields`` (every model field, JSON-ready)."""
    config = get_config(model, **changes)
    total, matmul = param_counts(config)
    return {
        "num_params": total,
        "matmul_params": matmul,
        "model_flops_per_token": _flops_per_token(config, seq_len, matmul),
        "dtype": config.dtype,
        "fields": dataclasses.asdict(config),
    }


def initial_state(
    model: PresetLike, optimizer: optax.GradientTransformation, seed: int, **changes: Any
) -> TrainState:
    """The preset's initial train state (parameters from ``jax.random.key(seed)``, the
    optimizer's state) as host (numpy) arrays, made by one jitted init (flax's eager init
    compiles op by op). The remat policy does not change it."""
    config = get_config(model, **changes)
    init = jax.jit(lambda rng: init_train_state(config, optimizer, rng))
    return jax.device_get(init(jax.random.key(seed)))


def mesh_train_step(
    model: PresetLike, optimizer: optax.GradientTransformation, mesh: Mesh, **changes: Any
) -> Any:
    """The preset's jitted training step on ``mesh`` (:func:`remat_kit.make_train_step`: the
    state donated, input and output shardings fixed, so the state it returns feeds the next
    step); ``changes`` include its ``remat_policy``."""
    return make_train_step(get_config(model, **changes), optimizer, donate=True, mesh=mesh)
