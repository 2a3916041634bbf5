"""Compile targets: the registry, its errors, and deviceless GPU compiles on a CPU-only machine."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from remat_kit import targets
from tests.conftest import needs_cuda_plugin

GPU_NAMES = [t.name for t in targets.TARGETS.values() if t.gpu is not None]


@pytest.mark.parametrize("name", targets.target_names())
def test_every_name_resolves(name):
    target = targets.get_target(name)
    assert target.name == name
    assert target.source and target.description
    assert targets.get_target(target) is target


@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_targets_carry_their_figures(name):
    target = targets.get_target(name)
    assert target.platform == "cuda" and target.deviceless and target.supports_host_offload
    assert target.memory_bytes > 20 * 2**30
    assert target.peak_flops_bf16 >= 100e12
    assert target.hbm_bytes_per_s >= 300e9 and target.host_link_bytes_per_s >= 32e9
    config = targets.gpu_target_config(target)
    assert f"core_count: {target.gpu.core_count}" in config
    assert f"device_memory_size: {target.memory_bytes}" in config
    assert 'platform_name: "CUDA"' in config


def test_names_are_normalised():
    assert targets.get_target("H100_SXM").name == "h100-sxm"
    assert targets.get_target(" A100-80GB ").name == "a100-80gb"


def test_unknown_name_says_what_is_valid_and_closest():
    with pytest.raises(ValueError) as err:
        targets.get_target("h100")
    message = str(err.value)
    assert "\n" not in message
    assert "'h100'" in message
    fixed = [n for n in targets.target_names() if targets.get_target(n).tpu is None]
    assert all(name in message for name in fixed)
    assert all(f"{g}-N" in message for g in ("v4", "v5e", "v5p", "v6e"))  # TPU slices, in brief
    assert "Did you mean 'h100-sxm'?" in message
    with pytest.raises(ValueError, match="Did you mean 'h200'"):
        targets.get_target("h200x")
    with pytest.raises(ValueError) as err:
        targets.get_target("tpu-v9000")
    assert "Did you mean" not in str(err.value)


def test_local_is_the_default_backend():
    local = targets.get_target("local")
    backend = jax.default_backend()
    assert local.platform == ("cuda" if backend == "gpu" else backend)
    assert local.gpu is None
    if backend == "cpu":
        assert local.memory_bytes is None
    assert targets.compile_devices("local") == jax.local_devices()[:1]


def test_fits_and_headroom():
    h100 = targets.get_target("h100-sxm")
    assert h100.fits(80 * 10**9)
    assert not h100.fits(85 * 10**9)
    assert not h100.fits(70 * 10**9, fraction=0.75)
    assert h100.headroom_bytes(h100.memory_bytes - 1) == 1
    with pytest.raises(ValueError, match="unknown device memory"):
        targets.get_target("cpu").fits(1)
    with pytest.raises(ValueError, match="fraction"):
        h100.usable_bytes(0.0)


def test_cpu_target_devices_and_too_many():
    cpus = jax.devices("cpu")
    assert targets.compile_devices("cpu", len(cpus)) == cpus
    with pytest.raises(ValueError, match="jax_num_cpu_devices"):
        targets.compile_devices("cpu", len(cpus) + 1)
    with pytest.raises(ValueError, match="not a deviceless GPU target"):
        targets.gpu_target_config("cpu")


def test_env_lets_the_cuda_plugin_load_without_a_gpu():
    if targets.has_visible_nvidia_gpu():
        pytest.skip("this machine has an NVIDIA GPU: the CUDA version check stays on")
    assert os.environ.get(_SKIP)


_SKIP = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
_REPO = Path(__file__).resolve().parents[1]


def _run_fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python with neither JAX_PLATFORMS nor the skip variable set."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", _SKIP)}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_cuda_plugin
def test_fresh_process_env_order():
    """Importing targets first keeps JAX quiet; JAX used first still gets a GPU topology."""
    if targets.has_visible_nvidia_gpu():
        pytest.skip("this machine has an NVIDIA GPU: the no-GPU environment cannot be tested")
    quiet = _run_fresh(
        "from remat_kit import targets; import jax; jax.devices(); "
        "print(len(targets.compile_devices('h100-sxm', 2)))"
    )
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "2"
    assert "plugin configuration error" not in quiet.stderr
    late = _run_fresh(
        "import jax; jax.devices(); from remat_kit import targets; "
        "print(len(targets.compile_devices('h100-sxm', 2)))"
    )
    assert late.returncode == 0, late.stderr
    assert late.stdout.strip() == "2"


@needs_cuda_plugin
def test_deviceless_h100_compile_reports_memory():
    sharding = targets.abstract_sharding("h100-sxm")
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=sharding)
    step = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w).astype(jnp.float32))))
    compiled = step.lower(x, x).compile()
    stats = compiled.memory_analysis()
    assert stats.argument_size_in_bytes == 2 * 512 * 512 * 2
    assert stats.output_size_in_bytes >= 512 * 512 * 2
    assert compiled.input_shardings[0][0].mesh.devices.flat[0].device_kind == (
        "NVIDIA H100 80GB HBM3"
    )


@needs_cuda_plugin
def test_eight_gpu_topology_shards_per_device():
    devices = targets.compile_devices("h100-sxm", 8)
    assert len(devices) == 8 and len({d.id for d in devices}) == 8
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert targets.compile_devices("h100-sxm", 8) == devices  # cached
    mesh = targets.target_mesh("h100-sxm", 8, ("data", "model"), (2, 4))
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    sharded = targets.abstract_sharding("h100-sxm", 8, P("x"))
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=sharded)
    stats = jax.jit(lambda x: x * 2).lower(x).compile().memory_analysis()
    assert stats.argument_size_in_bytes == 1024 * 256 * 4 // 8


@needs_cuda_plugin
@pytest.mark.parametrize("name", GPU_NAMES)
def test_every_gpu_target_makes_a_topology(name):
    (device,) = targets.compile_devices(name)
    gpu = targets.get_target(name).gpu
    assert device.device_kind == gpu.device_description
    assert device.compute_capability == f"{gpu.cc_major}.{gpu.cc_minor}"
    assert device.core_count == gpu.core_count


def test_missing_cuda_plugin_says_how_to_install(monkeypatch):
    monkeypatch.setattr(targets, "cuda_plugin_module", lambda: None)
    fresh = dataclasses.replace(targets.get_target("l4"), name="l4-without-plugin")
    with pytest.raises(RuntimeError, match=r"pip install 'remat-kit\[cuda12\]'") as err:
        targets.compile_devices(fresh)
    assert "\n" not in str(err.value)


def test_make_mesh_checks_its_shape():
    with pytest.raises(ValueError, match="mesh_shape"):
        targets.target_mesh("cpu", 1, ("a", "b"))
    with pytest.raises(ValueError, match="multiply"):
        targets.target_mesh("cpu", 1, ("a",), (2,))


def test_abstractify_puts_the_sharding_on_every_array():
    sharding = targets.abstract_sharding("cpu")
    tree = {"w": jnp.zeros((2, 3), jnp.bfloat16), "step": 3}
    out = targets.abstractify(tree, sharding)
    assert out["w"] == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16, sharding=sharding)
    assert out["w"].sharding == sharding and out["step"] == 3


def test_get_config_takes_a_config_and_names_a_bad_field_in_one_line():
    """A ModelConfig given for the preset name gets the overrides (it printed the whole config
    as an "unknown preset")."""
    from remat_kit.models import get_config

    config = get_config("tiny-gpt")
    assert get_config(config, d_model=32) == config.replace(d_model=32)
    with pytest.raises(ValueError, match=r"^unknown ModelConfig field 'bogus'; valid: name,"):
        get_config(config, bogus=1)
    with pytest.raises(ValueError, match=r"^unknown preset 'tiny-gtp'.*tiny-gpt"):
        get_config("tiny-gtp")
