"""The zoo's own API: presets built with changed fields, checked without building, the facts a
measured run needs, the textbook per-layer analysis on zoo programs only; and the library's
sweep handing measured points to a measurer (experiments/measured) instead of running them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import remat_kit
from remat_kit import zoo
from remat_kit.sweep import Grid, SweepConfig, run_sweep
from remat_kit.zoo import facts


def test_preset_takes_field_changes_and_names_a_bad_one():
    program = zoo.preset("tiny-gpt", 2, 32, scan_layers=True, remat_group_size=2)
    assert program.family.structure.scan_layers is True
    assert program.family.structure.remat_group_size == 2
    with pytest.raises(ValueError, match="unknown ModelConfig field 'd_modle'.*d_model"):
        zoo.preset("tiny-gpt", 2, 32, d_modle=8)


def test_check_preset_builds_nothing_and_says_how_to_raise_the_limit():
    assert zoo.check_preset("tiny-gpt", 64) == "no-remat"
    assert zoo.check_preset("tiny-gpt", 64, remat_policy="save-nothing") == "save-nothing"
    with pytest.raises(ValueError, match="raise max_seq_len: --set max_seq_len=4096$"):
        zoo.check_preset("tiny-gpt", 4096, "--set max_seq_len=4096")
    with pytest.raises(ValueError, match="unknown preset 'tiny-gtp'"):
        zoo.check_preset("tiny-gtp")


def test_model_facts_count_what_the_model_holds():
    """Parameter counts from the initialised shapes; model FLOPs by PaLM's formula, the tied
    embedding counted as a matmul (it is also the output projection)."""
    config = remat_kit.get_config("tiny-gpt", num_layers=2)
    params = jax.eval_shape(lambda: remat_kit.training.init_params(config, jax.random.key(0)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    pos = sum(math.prod(x.shape) for x in jax.tree.leaves(params.get("pos_embed", {})))
    got = facts.model_facts("tiny-gpt", 32, num_layers=2)
    assert got["num_params"] == total and got["matmul_params"] == total - pos
    flops = 6 * got["matmul_params"] + 12 * 2 * config.d_model * 32
    assert got["model_flops_per_token"] == facts.model_flops_per_token("tiny-gpt", 32, num_layers=2)
    assert got["model_flops_per_token"] == flops
    assert got["fields"]["num_layers"] == 2 and got["dtype"] == config.dtype


def test_initial_state_is_on_the_host_and_the_same_for_a_seed():
    import optax

    a = facts.initial_state("tiny-gpt", optax.sgd(1e-3), 0, num_layers=1)
    b = facts.initial_state("tiny-gpt", optax.sgd(1e-3), 0, num_layers=1)
    leaves = jax.tree.leaves(a.params)
    assert leaves and all(not isinstance(x, jax.Array) for x in leaves)  # numpy, not device
    assert all(
        bool(jnp.all(x == y)) for x, y in zip(leaves, jax.tree.leaves(b.params), strict=True)
    )


def test_per_layer_activations_need_a_bundled_model():
    program = remat_kit.Program.from_loss(
        lambda policy: lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((4, 4)), jnp.ones((2, 4))
    )
    with pytest.raises(ValueError, match="need a bundled model"):
        remat_kit.per_layer_activations(program)
    # the old import path still reads the moved function
    assert remat_kit.memory.per_layer_activations is remat_kit.per_layer_activations


def test_library_sweep_refuses_a_measuring_grid_without_a_measurer(tmp_path):
    measured = Grid("measured", models=("tiny-gpt",), policies=("no-remat",), measure=True)
    out = tmp_path / "o.jsonl"
    with pytest.raises(ValueError, match=r"grids \['measured'\] measure .*experiments/sweep.py"):
        run_sweep(SweepConfig("s", (measured,)), out, progress=False)
    assert not out.exists()  # refused before anything is written


def test_moved_sweep_names_say_where_they_went():
    with pytest.raises(ImportError, match="`from measured import run_program_sweep`"):
        from remat_kit.sweep import run_program_sweep  # noqa: F401
