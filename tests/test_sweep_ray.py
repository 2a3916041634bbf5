"""The Ray engine (remat_kit.sweep.ray_engine) on a local Ray instance of 2 CPUs: the same rows as
a serial run, a worker killed mid-task retried or given an error row, a killed driver resumed
from the results file. Ray is an optional dependency: without it these tests skip (CI does not
install it; docs/results/fanout.md records a run of them); the one-line error naming the
install is checked either way (tests/test_sweep_tasks.py)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_folder

ray = pytest.importorskip("ray")

from scripts.sweep_echo import EchoRunner, EchoTask  # noqa: E402
from test_sweep_tasks import _cli, _config_file, analysis_grid, by_key  # noqa: E402

from remat_kit.sweep import results, run_sweep  # noqa: E402
from remat_kit.sweep.ray_engine import RayEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "sweep.py"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A local Ray instance of 2 CPUs (the module's), its tasks importing this checkout and its
    tests' helpers and reading the run's compile cache."""
    cache = str(run_folder(tmp_path_factory) / "compile-cache")
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "REMAT_KIT_CACHE_DIR": cache, "REMAT_KIT_NO_CACHE": "",
    }  # fmt: skip
    made = RayEngine(runtime_env={"env_vars": env}, num_cpus=2, include_dashboard=False)
    yield made
    ray.shutdown()


def _run(engine, tasks, make_runner=EchoRunner):
    events = list(engine.run(tasks, make_runner, lambda n, d: None))
    starts = [e.task.key for e in events if e.kind == "start"]
    return starts, {e.task.key: e for e in events if e.kind == "done"}


def test_ray_tasks_ask_for_a_cpu_and_analysis_runs_on_the_cpu(engine):
    assert engine.analysis_slots == 2 and engine.gpus == 0 and engine.local_devices is None
    assert engine.options(EchoTask(0))["num_gpus"] == 0
    starts, done = _run(engine, [EchoTask(i) for i in range(4)])
    assert sorted(starts) == sorted(done) == [f"task-{i}" for i in range(4)]
    assert {e.rows[0]["JAX_PLATFORMS"] for e in done.values()} == {"cpu"}
    assert os.getpid() not in {e.rows[0]["pid"] for e in done.values()}


def test_a_killed_ray_worker_is_retried_then_given_an_error(engine, tmp_path):
    """Seed 1 kills its worker once (Ray runs it again: its row comes back), seed 2 every time
    (after max_retries: an error naming the lost worker); no other row is lost."""
    make = functools.partial(EchoRunner, once=(1,), always=(2,), marker=str(tmp_path / "tried"))
    _, done = _run(engine, [EchoTask(i) for i in range(4)], make)
    assert done["task-1"].rows and done["task-0"].rows and done["task-3"].rows
    err = done["task-2"].error
    assert done["task-2"].rows is None and "WorkerCrashedError" in type(err).__name__, err


def test_ray_gives_the_serial_rows(engine, tmp_path):
    """The analysis grid as Ray tasks (2 CPUs): the serial run's rows by key (timings aside)."""
    serial = run_sweep(analysis_grid(), tmp_path / "s.jsonl", progress=False)
    on_ray = run_sweep(analysis_grid(), tmp_path / "r.jsonl", progress=False, engine=engine)
    assert [r["key"] for r in on_ray.rows] == [r["key"] for r in serial.rows]
    assert by_key(results.read_rows(tmp_path / "r.jsonl")) == by_key(
        results.read_rows(tmp_path / "s.jsonl")
    )


#: The command line on Ray, killed (SIGKILL, by itself) right after its first row is written.
_CHILD = r"""
import os, runpy, signal, sys
from remat_kit.sweep import results
real = results.append_row
def append_and_die(path, row):
    real(path, row)
    os.kill(os.getpid(), signal.SIGKILL)
results.append_row = append_and_die
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_killed_ray_driver_resumes_to_the_same_rows(engine, tmp_path, capsys):
    """The command line on the module's Ray instance (--address), killed after its first row:
    --resume on Ray keeps that row byte for byte and writes the other once."""
    address = ray.get_runtime_context().gcs_address
    out = tmp_path / "sweep.jsonl"
    argv = [str(SCRIPT), "--config", str(_config_file(tmp_path)), "--out", str(out),
            "--engine", "ray", "--address", address, "--no-progress", "--no-plot"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    first = out.read_bytes()
    assert len(results.read_rows(out)) == 1
    assert _cli().main([*argv[1:], "--resume"]) == 0, capsys.readouterr().out
    assert out.read_bytes().startswith(first)
    keys = [r["key"] for r in results.read_rows(out)]
    assert sorted(keys) == sorted(p.key for p in analysis_grid().points()) and len(keys) == 2


def test_the_analyze_grid_on_ray_gives_the_serial_rows(engine, tmp_path, capsys):
    """``remat-kit analyze`` over a grid (tests/test_cli_grid.py's) with ``--engine ray`` on
    the module's Ray instance: the rows of the serial run, by key, timings aside."""
    from test_cli_grid import GRID, _by_key

    from remat_kit import cli

    address = ray.get_runtime_context().gcs_address
    serial, on_ray = tmp_path / "serial.jsonl", tmp_path / "ray.jsonl"
    assert cli.main([*GRID, "--out", str(serial)]) == 0, capsys.readouterr().err
    argv = [*GRID, "--out", str(on_ray), "--engine", "ray", "--address", address]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert _by_key(on_ray) == _by_key(serial)
