"""The sweep's points as tasks: stable keys, rows in any order, resume and summary whatever the
order (remat_kit.sweep.tasks, remat_kit.sweep.engine).

End-to-end runs use an analysis-only grid (one-layer tiny-gpt, two shapes, no-remat: two
points, two groups: a compile each) so nothing is timed; it is run once per module (the serial
reference, into the run's compile cache) and every other run reads its compiles from there.
"""

from __future__ import annotations

import io
import re
import time

import pytest
from conftest import run_folder

from remat_kit.sweep import Grid, SweepConfig, results, run_sweep
from remat_kit.sweep.engine import SerialEngine
from remat_kit.sweep.tasks import Tally, Task, make_tasks

#: Row fields that are times or say how a figure was obtained (cached or not), not what it is.
TIMING_FIELDS = (
    "time", "point_s", "analysis_compile_s", "compile_s", "compile_reused", "step_times_s",
    "step_time_s", "step_cpu_times_s", "step_cpu_s", "tokens_per_s", "mfu", "load_average",
    "step_order", "losses", "measured_peak_bytes", "measured_peak_note", "peak_error",
)  # fmt: skip


def figures(row: dict) -> dict:
    """A row without its timings (and the report's ``compile_cached``)."""
    out = {k: v for k, v in row.items() if k not in TIMING_FIELDS}
    out["report"] = {k: v for k, v in (row.get("report") or {}).items() if k != "compile_cached"}
    return out


def by_key(rows) -> dict[str, dict]:
    return {r["key"]: figures(r) for r in rows}


def analysis_grid(name: str = "tasks", policies=("no-remat",)) -> SweepConfig:
    return SweepConfig(name, grids=(Grid(
        name="analysis", models=("tiny-gpt",), policies=policies, batch_sizes=(2,),
        seq_lens=(32, 64), overrides={"num_layers": 1}, measure=False,
    ),))  # fmt: skip


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The grid run serially, in point order, its compiles in the run's compile cache: (the run,
    its file)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REMAT_KIT_CACHE_DIR", str(run_folder(tmp_path_factory) / "compile-cache"))
        mp.setenv("REMAT_KIT_NO_CACHE", "")
        path = tmp_path_factory.mktemp("serial") / "sweep.jsonl"
        run = run_sweep(analysis_grid(), path, progress=False)
    assert all(r["status"] == "ok" for r in run.rows), [r["error"] for r in run.rows]
    return run, path


class ReversedEngine(SerialEngine):
    """The tasks in reverse order: rows reach the file last group first."""

    def run(self, tasks, make_runner, advance):
        return super().run(list(tasks)[::-1], make_runner, advance)


def test_tasks_are_groups_or_shares_of_them_with_stable_keys():
    points = analysis_grid(policies=("no-remat", "save-nothing")).points()
    tasks = make_tasks(points)
    assert [len(t.points) for t in tasks] == [2, 2]  # one per group (shape)
    assert [p for t in tasks for p in t.points] == points
    again = make_tasks(analysis_grid(policies=("no-remat", "save-nothing")).points())
    assert [t.key for t in tasks] == [t.key for t in again]
    assert len({t.key for t in tasks}) == 2
    assert tasks[0].label == "tiny-gpt b=2 s=32 @local, 2 policies"
    # four processes for two groups: each group in two shares, every point once, in order
    shares = make_tasks(points, analysis_slots=4)
    assert [len(t.points) for t in shares] == [1, 1, 1, 1]
    assert [t.points[0] for t in shares] == points
    # measured groups are cut by the device slots alone
    measured = analysis_grid().grids[0].__class__
    grid = SweepConfig("m", grids=(measured(
        name="m", models=("tiny-gpt",), policies=("no-remat", "save-nothing", "save-dots"),
        seq_lens=(32,), overrides={"scan_layers": True},
    ),)).points()  # fmt: skip
    assert [len(t.points) for t in make_tasks(grid, analysis_slots=8)] == [3]
    assert [len(t.points) for t in make_tasks(grid, device_slots=2)] == [1, 2]
    with pytest.raises(ValueError, match="slots must be >= 1"):
        make_tasks(points, analysis_slots=0)


def test_tally_counts_points_and_says_what_runs_when_nothing_is_said():
    from rich.console import Console

    from remat_kit.sweep.output import progress

    points = analysis_grid(policies=("no-remat", "save-nothing")).points()
    a, b = make_tasks(points)
    buf = io.StringIO()
    with progress(True, Console(file=buf, width=200), 4) as advance:
        with Tally(4, advance, heartbeat_s=0.05) as tally:
            tally.start(a)
            tally.start(b)
            deadline = time.monotonic() + 5
            while "running" not in buf.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
            tally.finish(a, [{"key": p.key, "status": "ok"} for p in a.points])
    lines = buf.getvalue().splitlines()
    beat = next(line for line in lines if " running " in line)
    assert re.search(r"running tiny-gpt b=2 s=32 @local, 2 policies; tiny-gpt b=2 s=64 @local, "
                     r"2 policies \[0 done, 4 running, 0 left\]", beat), beat  # fmt: skip
    assert lines[-1].endswith("done: tiny-gpt b=2 s=32 save-nothing @local [2 done, 2 running, "
                              "0 left]"), lines  # fmt: skip


def test_tasks_in_any_order_give_the_same_rows_summary_and_resume(tmp_path, serial):
    """The grid run in reverse task order: the same rows by key as in point order (timings
    aside), the same summary; a file holding the last group's row alone (and a torn line)
    resumes to the same rows."""
    first, path = serial
    config = analysis_grid()
    other = run_sweep(config, tmp_path / "b.jsonl", progress=False, engine=ReversedEngine())
    in_file = results.read_rows(tmp_path / "b.jsonl")
    assert [r["seq_len"] for r in in_file] == [64, 32]  # as finished
    points = [p.key for p in config.points()]
    assert [r["key"] for r in first.rows] == [r["key"] for r in other.rows] == points
    assert by_key(in_file) == by_key(results.read_rows(path))
    assert results.summary_markdown(first.rows) == results.summary_markdown(other.rows)
    assert results.summary_markdown(first.rows).count("| no-remat |") == 2
    # resume onto the last group's row and a torn line
    part = tmp_path / "c.jsonl"
    lines = (tmp_path / "b.jsonl").read_bytes().splitlines(keepends=True)
    part.write_bytes(lines[0] + lines[1][:40])
    resumed = run_sweep(config, part, resume=True, progress=False)
    assert resumed.skipped == 1 and len(resumed.new_rows) == 1
    assert [r["key"] for r in resumed.rows] == points
    assert by_key(results.read_rows(part, timelines=False)) == by_key(
        results.read_rows(path, timelines=False)
    )
    assert results.summary_markdown(resumed.rows) == results.summary_markdown(first.rows)


def test_a_task_that_fails_outside_its_points_gives_an_error_row_per_point(tmp_path, serial):
    """A runner raising (a bug, a lost process) loses only its task's points: each gets an
    error row with every field, and the other tasks' rows are written."""
    config = analysis_grid()
    points = config.points()

    class Failing(SerialEngine):
        def run(self, tasks, make_runner, advance):
            def make():
                real = make_runner()

                def run(task: Task, adv):
                    if task.points[0].seq_len == 32:
                        raise RuntimeError("lost\nmore")
                    return [{**r, "status": "ok"} for r in real(task, adv)]

                return run

            return super().run(tasks, make, advance)

    run = run_sweep(config, tmp_path / "f.jsonl", progress=False, engine=Failing())
    rows = {r["key"]: r for r in results.read_rows(tmp_path / "f.jsonl")}
    assert set(rows) == {p.key for p in points}
    lost = rows[points[0].key]
    assert lost["status"] == "error" and lost["error"] == "RuntimeError: lost"
    assert lost["seq_len"] == 32 and lost["peak_bytes"] is None
    assert set(lost) == set(rows[points[1].key])  # every field
    assert [r["status"] for r in run.rows] == ["error", "ok"]
