"""Several processes (jax.distributed over gloo on the CPU) and meshes in the scripts.

Every process this file starts compiles with XLA:CPU's code generation optimisation off
(:data:`FAST_CPU`). The experiments/train.py runs train one tiny program and share a JAX
persistent compilation cache (:func:`train_env`): after the first run, process 0 of a run loads
its executables instead of compiling them."""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from remat_kit.sweep import Grid, SweepConfig, run_sweep

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from measured import TextMeasurer  # noqa: E402
from trainer import RESUME_MAY_CHANGE, TrainConfig, distributed, load_checkpoint  # noqa: E402

TRAIN = [sys.executable, str(ROOT / "experiments" / "train.py")]
SWEEP = [sys.executable, str(ROOT / "experiments" / "sweep.py")]
TINY_TRAIN = ["--batch", "4", "--seq", "32", "--eval-every", "2", "--eval-batches", "1",
              "--ckpt-every", "2", "--set", "d_model=32", "--set", "d_ff=64"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: XLA:CPU flags of every process started here: LLVM's optimisation off (what
#: experiments/gpu_check.py's CPU mode and remat_kit's FAST_COMPILE_OPTIONS use: the same HLO,
#: buffers and collectives, machine code generated in ~2/3 of the CPU time).
FAST_CPU = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _env(**env: str) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU}".strip()
    return {**os.environ, "XLA_FLAGS": flags, **env}


@pytest.fixture(scope="module")
def train_env(tmp_path_factory) -> dict[str, str]:
    """Environment of this module's experiments/train.py processes: one JAX persistent
    compilation cache (every run trains the same tiny program; JAX writes entries from process 0
    only, and process 1's keys differ, so process 0 of a later run reads it). Not for the
    sweep, whose analysis reads XLA's dumps of each compile: a cache hit writes none."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-compilation-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(**env))


def _start_two(
    cmd: list[str],
    env: dict[str, str] | None = None,
    per_process: dict[int, dict[str, str]] | None = None,
):
    port = str(_free_port())
    return [
        subprocess.Popen(
            [*cmd, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_env(**(env or {}), **(per_process or {}).get(i, {})),
        )
        for i in range(2)
    ]  # fmt: skip


def _two_processes(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` as processes 0 and 1 of one jax.distributed run; fail on a non-zero exit."""
    procs = _start_two(cmd, env)
    outs = [p.communicate(timeout=300) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {i}: {err[-2000:]}"


@pytest.fixture
def no_cluster_env(monkeypatch):
    for name in (*distributed.ENV_VARS, "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_SIZE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "args, match",
    [
        ((None, 0, None), r"num_processes .* must be an integer >= 1, got 0"),
        (("h:1", 2, 2), r"process_id .* must be one of 0..1 for num_processes=2, got 2"),
        (("h:1", 2, None), r"must be one of 0..1 for num_processes=2, got nothing"),
        ((None, 2, 1), r"num_processes=2 needs the coordinator's host:port"),
        (("nonsense", 2, 0), r"must be host:port, e.g. 10.0.0.1:1234, got 'nonsense'"),
    ],
)
def test_bad_process_layout_raises_one_line(no_cluster_env, args, match):
    with pytest.raises(ValueError, match=match):
        distributed.initialize(*args)


def test_bad_environment_variable_is_named(no_cluster_env, monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match=r"JAX_NUM_PROCESSES must be an integer, got 'two'"):
        distributed.initialize()


def test_one_process_starts_nothing(no_cluster_env):
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False


def _script(name: str):
    """experiments/<name>.py as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(
        f"{name}_script", ROOT / "experiments" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_error_line(stderr: str, match: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"(train|sweep)\.py: error: ", lines[0]), stderr
    assert re.search(match, lines[0]), lines[0]


def test_scripts_reject_a_bad_layout_or_mesh_in_one_line(tmp_path, no_cluster_env, capsys):
    """Exit 2 and one line on stderr: one real process (nothing else on its stderr: no JAX
    backend started, no traceback), the other bad inputs through the scripts' main(argv)."""
    out = _run([*TRAIN, "--workdir", str(tmp_path / "a"), "--num-processes", "2",
                "--process-id", "2", "--coordinator", "127.0.0.1:1"])  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    _one_error_line(out.stderr, "must be one of 0..1")
    n = jax.device_count() + 1  # one device more than this process has
    for main, argv, match in [
        (_script("train").main, ["--workdir", str(tmp_path / "b"), "--mesh", f"fsdp={n}"],
         rf"mesh dp=1,fsdp={n},tp=1 needs {n} devices .* but this run has {n - 1}"),
        (_script("sweep").main,
         ["--config", "quick", "--out", str(tmp_path / "c.jsonl"), "--mesh", "pp=2"],
         "unknown mesh axis 'pp'; valid: dp, fsdp, tp"),
    ]:  # fmt: skip
        capsys.readouterr()
        assert main(argv) == 2
        _one_error_line(capsys.readouterr().err, match)
    assert not (tmp_path / "b" / "checkpoints").exists()
    assert not (tmp_path / "c.jsonl").exists()


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, train_env) -> Path:
    """An uninterrupted 6-step run over 2 processes (checkpoints every 2 steps)."""
    workdir = tmp_path_factory.mktemp("two-uninterrupted")
    _two_processes([*TRAIN, "--workdir", str(workdir), "--steps", "6", *TINY_TRAIN], train_env)
    return workdir


def test_train_script_over_two_processes_matches_one(two_process_run, tmp_path):
    """2 processes (data parallel over their 2 CPU devices) give one process's losses; a
    one-device run resumes from their checkpoint and continues as an uninterrupted run. The
    one-process runs are experiments/train.py's main(argv) in this process (one CPU device,
    the same XLA flags): no interpreter to start, and the resume reuses the run's compiled
    step (the trainer caches compiled steps per process)."""
    two, one = tmp_path / "two", tmp_path / "one"
    train_main = _script("train").main
    assert train_main(["--workdir", str(one), "--steps", "8", *TINY_TRAIN]) == 0
    r2 = json.loads((two_process_run / "result.json").read_text())
    r1 = json.loads((one / "result.json").read_text())
    assert (r2["num_processes"], r2["mesh"], r2["environment"]["process_count"]) == (
        2, "dp=2,fsdp=1,tp=1", 2)  # fmt: skip
    assert (r1["num_processes"], r1["mesh"]) == (1, "dp=1,fsdp=1,tp=1")
    np.testing.assert_allclose(r2["losses"], r1["losses"][:6], rtol=1e-5)
    np.testing.assert_allclose(
        [v for _, v in r2["val_losses"]], [v for _, v in r1["val_losses"][:4]], rtol=1e-5
    )
    # The 2-process checkpoint (sharded over 2 devices) restores onto 1 device: a copy of the
    # uninterrupted 2-process run (the other tests compare with it) continues to step 8.
    shutil.copytree(two_process_run, two)
    assert train_main(["--workdir", str(two), "--steps", "8", "--resume", *TINY_TRAIN]) == 0
    resumed = json.loads((two / "result.json").read_text())
    assert resumed["resumed_from"] == 6 and resumed["num_processes"] == 1
    np.testing.assert_allclose(resumed["losses"], r1["losses"], rtol=1e-5)


@pytest.mark.parametrize(
    "victim, point",
    [pytest.param(1, "before-save@4", marks=pytest.mark.slow), (0, "mid-save@4")],
    ids=["process-1-before-save", "process-0-mid-save"],
)
def test_one_process_killed_resumes_bitwise(two_process_run, train_env, tmp_path, victim, point):
    """One process of a 2-process run SIGKILLs itself at checkpoint 4 (process 1 before its
    save; process 0, which finalises orbax saves, after every item is written and before the
    rename); the other is then killed as a scheduler tears the job down (left alone it would
    abort on the coordinator's heartbeat timeout). Resumed over 2 processes, the run continues
    from checkpoint 2 and ends bitwise where the uninterrupted run ends.

    The default suite kills process 0 mid-save (the process that finalises saves, at the
    hardest point); process 1 killed before its save is marked slow (the same path with the
    other victim; tests/test_training.py kills a one-process run before-save too)."""
    workdir = tmp_path / "run"
    cmd = [*TRAIN, "--workdir", str(workdir), "--steps", "6", *TINY_TRAIN]
    procs = _start_two(cmd, train_env, {victim: {"REMAT_KIT_KILL_AT": point}})
    _, err = procs[victim].communicate(timeout=300)
    assert procs[victim].returncode == -signal.SIGKILL, err[-2000:]  # the hook fired
    other = procs[1 - victim]
    other.kill()
    other.communicate(timeout=60)
    ckpts = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    assert "2" in ckpts and "6" not in ckpts, ckpts
    _two_processes([*cmd, "--resume"], train_env)
    got = json.loads((workdir / "result.json").read_text())
    want = json.loads((two_process_run / "result.json").read_text())
    assert got["resumed_from"] == 2 and got["num_processes"] == 2
    assert got["losses"] == want["losses"]  # float equality: bitwise
    assert got["val_losses"] == want["val_losses"]
    # Same checkpoints kept as the uninterrupted run, and no unfinished save left behind.
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == sorted(
        p.name for p in (two_process_run / "checkpoints").iterdir()
    )
    (state, meta), (ref, ref_meta) = load_checkpoint(workdir), load_checkpoint(two_process_run)
    assert meta["step"] == ref_meta["step"] == 6
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


SWEEP_CONFIG = """
from remat_kit.sweep import Grid, SweepConfig

def get_config():
    return SweepConfig("two", grids=(Grid(**GRID),))
"""
#: One point: the smallest grid that still runs the sweep's measured path over a mesh.
GRID = dict(
    name="measured",
    measure=True,
    models=("tiny-gpt",),
    policies=("save-nothing",),
    batch_sizes=(2,),
    seq_lens=(16,),
    overrides={"scan_layers": True},
    warmup_steps=0,
    timed_steps=2,
)


def test_sweep_script_over_two_processes_matches_one(tmp_path):
    """fsdp over the devices of 2 processes: process 0 writes one row per point, rows name the
    mesh, and the losses are those of a one-device sweep of the same grid."""
    (tmp_path / "two.py").write_text(f"GRID = {GRID!r}\n{SWEEP_CONFIG}")
    out = tmp_path / "rows.jsonl"
    _two_processes([*SWEEP, "--config", str(tmp_path / "two.py"), "--out", str(out),
                    "--mesh", "fsdp=2", "--no-plot", "--no-progress"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["policy"] for r in rows] == list(GRID["policies"])
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert {(r["mesh"], r["device_count"], r["process_count"]) for r in rows} == {
        ("dp=1,fsdp=2,tp=1", 2, 2)}  # fmt: skip
    single = run_sweep(SweepConfig("one", (Grid(**GRID),)), tmp_path / "one.jsonl", progress=False,
                       measurer=TextMeasurer())  # fmt: skip
    for r, s in zip(rows, single.rows, strict=True):
        assert "mesh" not in s  # one device: no mesh, the point keys of earlier sweeps
        np.testing.assert_allclose(r["losses"], s["losses"], rtol=1e-5)
        # fsdp=2 halves the parameters and optimizer state each device holds.
        assert r["argument_bytes"] < 0.6 * s["argument_bytes"]


def test_grid_mesh_errors_name_the_numbers():
    grid = Grid("g", models=("tiny-gpt",), policies=("no-remat",), batch_sizes=(4,))
    with pytest.raises(ValueError, match=r"grid 'g': mesh dp=1,fsdp=2,tp=1 needs 2 devices"):
        SweepConfig("s", (Grid(**{**grid.__dict__, "mesh": "fsdp=2"}),)).points()
    with pytest.raises(ValueError, match=r"grid 'g': unknown mesh axis 'x'"):
        SweepConfig("s", (Grid(**{**grid.__dict__, "mesh": "x=2"}),)).points()
    three = Grid(**{**grid.__dict__, "mesh": "dp=3", "targets": ("h100-sxm",)})
    with pytest.raises(ValueError, match=r"batch_size=4 does not split evenly over dp\*fsdp=3"):
        SweepConfig("s", (three,)).points()


def test_train_config_mesh_is_checked():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'pp'"):
        TrainConfig(mesh="pp=2")
    assert "mesh" in RESUME_MAY_CHANGE  # a run may resume on another mesh
