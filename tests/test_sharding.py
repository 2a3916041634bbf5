"""Meshes (dp, fsdp, tp) on fake CPU devices and deviceless GPU topologies."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import remat_kit
from remat_kit import targets
from remat_kit import targets as T
from remat_kit.training import (
    abstract_batch,
    make_optimizer,
    make_train_step,
    sharded_train_state,
)


@pytest.mark.parametrize(
    "text, n, match",
    [
        ("dp=2,fsdp=3", 8, r"mesh dp=2,fsdp=3,tp=1 has 6 device\(s\) .* but 8 device\(s\)"),
        ("pp=2", None, r"unknown mesh axis 'pp'; valid: dp, fsdp, tp"),
        ("fsdp=0", None, r"mesh axis fsdp must have a positive integer size, got '0'"),
        ("fsdp", None, r"bad mesh entry 'fsdp'"),
    ],
)
def test_bad_mesh_raises_one_line(text, n, match):
    with pytest.raises(ValueError, match=match):
        T.parse_mesh(text, n)


def test_parse_mesh():
    assert T.parse_mesh("dp=2,fsdp=4", 8).shape == (2, 4, 1)
    assert T.parse_mesh(None, 4).shape == (4, 1, 1)


def _compiled_argument_bytes(config, mesh_text, n):
    optimizer = make_optimizer("adamw")
    devices = targets.compile_devices("h100-sxm", n)
    mesh = T.make_mesh(T.parse_mesh(mesh_text, n), devices)
    state, shardings = sharded_train_state(config, optimizer, mesh)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=T.batch_sharding(mesh)),
        abstract_batch(8, 64),
    )
    step = make_train_step(config, optimizer, jit=False)
    fn = jax.jit(step, in_shardings=(shardings, T.batch_sharding(mesh)), donate_argnums=0)
    return fn.lower(state, batch).compile().memory_analysis().argument_size_in_bytes


def test_fsdp_divides_per_device_argument_bytes():
    # One layer (the per-layer parameters shard like any other's); d_model 256 so the
    # replicated norm scales are a small part of the argument bytes.
    config = remat_kit.get_config(
        "tiny-llama", d_model=256, num_heads=8, num_kv_heads=8, d_ff=512, num_layers=1
    )
    one = _compiled_argument_bytes(config, "fsdp=1", 1)
    eight = _compiled_argument_bytes(config, "fsdp=8", 8)
    # Norm scales and the step counter stay replicated: "within padding".
    assert one / 8 <= eight <= one / 8 * 1.02, (one, eight)


def test_indivisible_axis_names_the_numbers():
    config = remat_kit.get_config("tiny-llama")  # 4 heads, 2 kv heads
    mesh = T.make_mesh(T.parse_mesh("tp=8", 8), targets.compile_devices("h100-sxm", 8))
    with pytest.raises(ValueError, match=r"dimension 2 of size 2 is not divisible by mesh axes tp"):
        sharded_train_state(config, make_optimizer("adamw"), mesh)


#: XLA:CPU's LLVM optimisation off for the script's compiles (experiments/gpu_check.py's CPU
#: mode flags): the same HLO and sharding, machine code generated in ~2/3 of the CPU time; every
#: mesh compiled alike in the one process.
FAST_CPU = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def test_dp_fsdp_tp_give_the_loss_of_one_device():
    script = Path(__file__).parent / "scripts" / "sharded_losses.py"
    meshes = ["none", "dp=8", "fsdp=8", "dp=2,fsdp=2,tp=2"]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU}".strip()}
    out = subprocess.run(
        [sys.executable, str(script), *meshes], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])
    for mesh in meshes[1:]:
        np.testing.assert_allclose(losses[mesh], losses["none"], rtol=1e-5, atol=1e-5)
