"""Shared test setup: CPU backend, tiny configs."""

import os

# Tests run on the CPU even where a GPU is present; GPU targets are compiled deviceless.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# The persistent compile cache is off outside a test (module- and session-scoped fixtures
# compile as before; never the user's ~/.cache/remat-kit); each test gets its own, empty.
os.environ["REMAT_KIT_NO_CACHE"] = "1"
os.environ.pop("REMAT_KIT_CACHE_DIR", None)
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


@pytest.fixture(autouse=True)
def _compile_cache_in_tmp(tmp_path_factory, monkeypatch):
    """Every test gets its own empty compile cache (never the user's ~/.cache/remat-kit):
    tests stay independent of one another and of earlier runs. Fixtures of a wider scope run
    before this one, with the cache off (set above)."""
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(tmp_path_factory.mktemp("compile-cache")))
    monkeypatch.setenv("REMAT_KIT_NO_CACHE", "")
