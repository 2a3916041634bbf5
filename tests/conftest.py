"""Shared test setup: CPU backend, tiny configs."""

import os

# Tests run on the CPU even where a GPU is present; GPU targets are compiled deviceless.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# The time model's figures for the local CPU: fixed, so estimates (and recommend's ranking on
# the local target) do not depend on how busy the machine is while the tests run.
os.environ.setdefault(
    "REMAT_KIT_CALIBRATION", os.path.join(os.path.dirname(__file__), "cpu_figures.json")
)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def rng():
    return jax.random.key(0)


def _cuda_plugin_installed() -> bool:
    from remat_kit import targets

    return targets.cuda_plugin_module() is not None


#: Skip a test that compiles for a GPU target when JAX's CUDA plugin is not installed.
needs_cuda_plugin = pytest.mark.skipif(
    not _cuda_plugin_installed(),
    reason="JAX's CUDA plugin is not installed (pip install 'remat-kit[cuda12]')",
)
