"""The local engine (remat_kit.sweep.engine.LocalEngine): tasks side by side on worker
processes and on the local device(s), a worker lost mid-task replaced and its task retried or
given error rows. The tasks here run nothing (tests/scripts/sweep_echo.py: its workers import
no JAX), so what is checked is the scheduling; tests/test_sweep_tasks.py runs a real grid on
worker processes."""

from __future__ import annotations

import functools
import os

import pytest
from scripts.sweep_echo import EchoRunner, EchoTask

from remat_kit.sweep.engine import LocalEngine, SerialEngine, WorkerLost, local_engine


def _run(engine, tasks, make_runner=EchoRunner):
    events = list(engine.run(tasks, make_runner, lambda n, d: None))
    starts = [e.task.key for e in events if e.kind == "start"]
    done = {e.task.key: e for e in events if e.kind == "done"}
    assert len(done) == len([e for e in events if e.kind == "done"])  # each done once
    return starts, done


def test_tasks_run_side_by_side_on_cpu_workers_and_the_device_in_this_process():
    analysis = [EchoTask(i) for i in range(6)]
    device = [EchoTask(10 + i, on_device=True) for i in range(2)]
    starts, done = _run(LocalEngine(2), analysis + device)
    assert sorted(done) == sorted(starts) == sorted(t.key for t in analysis + device)
    rows = {k: e.rows[0] for k, e in done.items()}
    pids = {rows[t.key]["pid"] for t in analysis}
    assert len(pids) == 2 and os.getpid() not in pids  # two worker processes
    assert {rows[t.key]["JAX_PLATFORMS"] for t in analysis} == {"cpu"}
    assert {rows[t.key]["pid"] for t in device} == {os.getpid()}  # the local device: here


def test_each_gpu_point_gets_its_own_gpus_and_a_mesh_a_group():
    """GPU ids handed out (the workers only see CUDA_VISIBLE_DEVICES; no GPU is touched): one
    per point, or a group of a meshed point's size, one size after the other."""
    one = [EchoTask(i, on_device=True) for i in range(6)]
    two = [EchoTask(20 + i, on_device=True, devices=2) for i in range(2)]
    engine = LocalEngine(1, gpus=["3", "5", "6"])
    assert engine.local_devices == 1 and engine.device_slots == 3
    _, done = _run(engine, one + two + [EchoTask(30, on_device=True)])
    seen = [done[t.key].rows[0]["CUDA_VISIBLE_DEVICES"] for t in one]
    assert set(seen) == {"3", "5", "6"}, seen
    assert {done[t.key].rows[0]["CUDA_VISIBLE_DEVICES"] for t in two} == {"3,5"}
    assert done["task-30"].rows[0]["CUDA_VISIBLE_DEVICES"] in {"3", "5", "6"}
    with pytest.raises(ValueError, match="a point needs 4 GPUs; the engine has 3"):
        engine.device_groups(4)


def test_a_lost_worker_is_replaced_and_its_task_retried_then_given_an_error(tmp_path):
    """Seed 1 kills its worker once (retried on a new one: its row comes back), seed 2 every
    time (after one retry: WorkerLost, naming the signal and the worker's last line); every
    other task's row is kept."""
    tasks = [EchoTask(i) for i in range(5)]
    make = functools.partial(EchoRunner, once=(1,), always=(2,), marker=str(tmp_path / "tried"))
    starts, done = _run(LocalEngine(2, retries=1), tasks, make)
    assert sorted(done) == sorted(t.key for t in tasks)
    assert [starts.count(t.key) for t in tasks] == [1, 2, 2, 1, 1]
    lost = done["task-2"]
    assert lost.rows is None and isinstance(lost.error, WorkerLost)
    assert "was killed by SIGKILL (2 time(s)); its last line: dying on seed 2" in str(lost.error)
    assert all(done[t.key].rows for t in tasks if t.seed != 2)
    _, none = _run(LocalEngine(2, retries=0), [EchoTask(1), EchoTask(3)], make)
    assert none["task-1"].rows  # the marker is there: seed 1 runs
    starts, done = _run(LocalEngine(1, retries=0), tasks[2:3], make)
    assert starts == ["task-2"] and "(1 time(s))" in str(done["task-2"].error)


def test_local_engine_is_this_process_when_nothing_runs_side_by_side():
    assert isinstance(local_engine(1), SerialEngine)  # the CPU, one worker
    engine = local_engine(3)
    assert isinstance(engine, LocalEngine) and engine.gpus is None and engine.workers == 3
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        LocalEngine(0)
    with pytest.raises(ValueError, match="need a task runner they can import"):
        list(LocalEngine(2).run([EchoTask(0)], lambda: EchoRunner(), lambda n, d: None))
