"""Shared test setup: CPU backend, tiny configs; the order pytest-xdist starts modules in.

``REMAT_KIT_FULL_MATRIX=1`` runs the full matrices the default suite samples: every policy's
gradients in all 8 model x layout x group layouts (tests/test_policies.py), the doctor's
clean-run matrix over every model x layout at 4 layers (tests/test_walker.py).

Tests marked ``@pytest.mark.slow`` repeat a check of the default suite at a larger size or
another point of the same path; pyproject's addopts leave them out (``-m 'not slow'``), and
``python -m pytest -m slow`` runs just them (``-m ''`` everything)."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The experiments' packages (``trainer``, ``measured``: experiment machinery, not the library)
# are imported as scripts in experiments/ import them: with that folder on sys.path.
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
if str(EXPERIMENTS) not in sys.path:
    sys.path.insert(0, str(EXPERIMENTS))

# Tests run on the CPU even where a GPU is present; GPU targets are compiled deviceless.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# XLA:CPU's LLVM optimisation off for every compile of the suite, in this process and the ones
# it starts (they inherit the environment): the same HLO, schedule, buffers and memory figures
# (remat_kit.memory.xla_compile.FAST_COMPILE_OPTIONS: what analysis compiles use), machine code
# generated in about 2/3 of the CPU time; the tests run tiny steps, whose speed no test checks.
_FAST_CPU = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_CPU}".strip()
# XLA's GPU autotuner off (level 0) for the suite's deviceless GPU compiles: with no GPU to time
# candidates on, the default level still spends most of a tiny model's compile in the autotuner
# (tiny-llama bf16 on h100-sxm: 5.4 -> 1.9 s of CPU per compile) and ends with the same peaks,
# buffers, FLOPs and step-time estimates; tests/test_fast_compile_flags.py checks them against
# a compile at XLA's default level in a fresh process.
AUTOTUNE_OFF = "--xla_gpu_autotune_level=0"
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {AUTOTUNE_OFF}".strip()
# The persistent compile cache is off outside a test (module- and session-scoped fixtures
# compile as before; never the user's ~/.cache/remat-kit); each test gets its own, empty.
os.environ["REMAT_KIT_NO_CACHE"] = "1"
os.environ.pop("REMAT_KIT_CACHE_DIR", None)
# XLA's GPU kernel cache shared by every deviceless GPU compile of this process and the ones it
# starts (remat_kit.memory.compile_cache.kernel_cache_file): kernels change no figure, and a
# warm cache halves a tiny model's compile; each test's compile cache stays its own.
if not os.environ.get("REMAT_KIT_KERNEL_CACHE_DIR"):
    _KERNELS = tempfile.mkdtemp(prefix="remat-kit-test-kernels-")
    atexit.register(shutil.rmtree, _KERNELS, ignore_errors=True)
    os.environ["REMAT_KIT_KERNEL_CACHE_DIR"] = _KERNELS
# JAX's persistent compilation cache, one for this run, shared by the xdist workers and the
# processes they start (scripts, multi-process runs, the notebook): the suite runs the same
# tiny steps again and again (a policy's gradients beside no-remat's, a script after its
# in-process twin, a killed run resumed); a hit hands back the executable XLA compiled for
# the same program and options (jax/_src/cache_key.py). remat-kit's own analysis compiles
# never read it (remat_kit.memory.xla_compile.CACHE_BYPASS_OPTION: they need XLA's dumps).
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _JAX_CACHE = tempfile.mkdtemp(prefix="remat-kit-test-jax-cache-")
    atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
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


#: The modules that take longest, longest first (their summed test durations in `python -m
#: pytest -q -n 2 --durations=0`; revisit when one changes much): pytest-xdist starts them first,
#: then the others in its own order (most tests first), which fill in around them. Left to that
#: order alone, a long module of few tests (test_distributed, test_recommend_structure) starts
#: last and keeps one worker busy minutes after the other has finished.
LONGEST_FIRST = (
    "test_fast_compile_flags",
    "test_training",
    "test_recommend_structure",
    "test_docs",
    "test_distributed",
    "test_policies",
    "test_sweep",
    "test_own_models",
    "test_walker",
    "test_recommend",
    "test_gpu_check",
    "test_programs",
    "test_analyze_programs",
    # few tests each, 20-50 s in all: left to xdist's order (most tests first) they come last
    "test_memory",
    "test_mesh_analysis",
    "test_doctor",
    "test_cli_grid",
    "test_remat3",
    "test_sweep_program",
    "test_sharding",
    "test_tpu",
    "test_recommend_program",
    "test_notebook",
    "test_timeline",
    "test_one_path",
    "test_sweep_tasks",
)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (pyproject's addopts) with :data:`LONGEST_FIRST` started first."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "loadscope" or not hasattr(
        LoadScopeScheduling, "_assign_work_unit"
    ):  # another mode, or xdist's internals have changed: xdist's own scheduler
        return None

    class LongestFirst(LoadScopeScheduling):
        ordered = False

        def _assign_work_unit(self, node):
            if not self.ordered:  # the work queue is complete at the first assignment
                rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
                module = lambda scope: os.path.basename(scope.split("::")[0]).removesuffix(".py")
                units = sorted(
                    self.workqueue.items(), key=lambda u: rank.get(module(u[0]), len(rank))
                )
                self.workqueue.clear()
                self.workqueue.update(units)
                self.ordered = True
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


def run_folder(tmp_path_factory) -> "os.PathLike":
    """This pytest run's temporary folder, the same in every xdist worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True)
def _compile_cache_of_the_run(tmp_path_factory, monkeypatch):
    """One remat-kit compile cache for this run (never the user's ~/.cache/remat-kit), shared
    by the xdist workers and the processes they start, as a user's is by the runs of a day:
    entries are keyed by everything that decides what XLA produces and written atomically
    (remat_kit.memory.compile_cache), so a test reads the artifacts of the same compile whether
    another test made them or not; tests/test_compile_cache.py checks a hit against a fresh
    compile. A test that counts compiles or hits asks for :func:`fresh_compile_cache`.
    Fixtures of a wider scope run before this one, with the cache off (set above)."""
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(run_folder(tmp_path_factory) / "compile-cache"))
    monkeypatch.setenv("REMAT_KIT_NO_CACHE", "")


@pytest.fixture
def fresh_compile_cache(tmp_path_factory, monkeypatch):
    """An empty compile cache of this test's own; its folder."""
    folder = tmp_path_factory.mktemp("compile-cache")
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(folder))
    monkeypatch.setenv("REMAT_KIT_NO_CACHE", "")
    return folder
