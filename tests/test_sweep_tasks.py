"""The sweep's points as tasks: stable keys, rows in any order, resume and summary whatever the
order (remat_kit.sweep.tasks, remat_kit.sweep.engine).

End-to-end runs use an analysis-only grid (one-layer tiny-gpt, two shapes, no-remat: two
points, two groups: a compile each) so nothing is timed; it is run once per module (the serial
reference, into the run's compile cache) and every other run reads its compiles from there.
"""

from __future__ import annotations

import importlib.util
import io
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import run_folder
from measured import summary

from remat_kit.sweep import Grid, SweepConfig, results, run_sweep
from remat_kit.sweep.engine import LocalEngine, SerialEngine
from remat_kit.sweep.shard import Shard, parse_shard, shard_points
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
        seq_lens=(32,), overrides={"scan_layers": True}, measure=True,
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
    assert re.search(r"\[0 done, 4 running, 0 left\] running tiny-gpt b=2 s=32 @local, 2 "
                     r"policies; tiny-gpt b=2 s=64 @local, 2 policies", beat), beat  # fmt: skip
    # the counts come first (a line cut to the width keeps them), and the finished task's
    # point not yet said counts as running, not as left
    said = [line for line in lines if "done:" in line]
    assert said[0].endswith("done: [1 done, 3 running, 0 left] tiny-gpt b=2 s=32 no-remat @local")
    assert said[1].endswith("done: [2 done, 2 running, 0 left] tiny-gpt b=2 s=32 save-nothing "
                            "@local"), lines  # fmt: skip


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
    assert summary.summary_markdown(first.rows) == summary.summary_markdown(other.rows)
    assert summary.summary_markdown(first.rows).count("| no-remat |") == 2
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
    assert summary.summary_markdown(resumed.rows) == summary.summary_markdown(first.rows)


def test_rows_written_under_old_field_names_read_and_resume_as_current(tmp_path, serial):
    """A row with ``model_config`` (the old name of ``model_fields``) reads as ``model_fields``,
    in place; a resume over a file of old rows runs none of them again and leaves their bytes,
    and over a file holding one old row runs only the other point."""
    first, path = serial
    old_lines = [
        line.replace(b'"model_fields":', b'"model_config":')
        for line in path.read_bytes().splitlines(keepends=True)
    ]
    assert all(b'"model_config":' in line for line in old_lines)
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"".join(old_lines))
    current = results.read_rows(path, timelines=False)  # the old file has no timelines beside
    assert results.read_rows(old) == current
    assert [list(r) for r in results.read_rows(old)] == [list(r) for r in current]  # in place
    # both names in one row: the current name's value is kept
    both = tmp_path / "both.jsonl"
    both.write_text('{"key": "k", "model_config": {"a": 1}, "model_fields": {"a": 2}}\n')
    assert results.read_rows(both) == [{"key": "k", "model_fields": {"a": 2}}]
    resumed = run_sweep(analysis_grid(), old, resume=True, progress=False)
    assert resumed.skipped == 2 and resumed.new_rows == []
    assert old.read_bytes() == b"".join(old_lines)
    assert by_key(resumed.rows) == by_key(current)
    half = tmp_path / "half.jsonl"
    half.write_bytes(old_lines[0])
    resumed = run_sweep(analysis_grid(), half, resume=True, progress=False)
    assert resumed.skipped == 1 and [r["key"] for r in resumed.new_rows] == [current[1]["key"]]
    assert half.read_bytes().startswith(old_lines[0])
    assert by_key(results.read_rows(half, timelines=False)) == by_key(current)


def test_worker_processes_give_the_serial_rows(tmp_path, serial):
    """The grid on the local engine's two CPU worker processes (one group each): the serial
    run's rows by key, timings aside; each row says where it ran (a worker's environment)."""
    first, path = serial
    run = run_sweep(analysis_grid(), tmp_path / "w.jsonl", progress=False, engine=LocalEngine(2))
    assert [r["key"] for r in run.rows] == [r["key"] for r in first.rows]
    assert by_key(results.read_rows(tmp_path / "w.jsonl")) == by_key(results.read_rows(path))
    assert summary.summary_markdown(run.rows) == summary.summary_markdown(first.rows)


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


def test_row_sink_appends_only_where_this_process_writes(tmp_path):
    """run_tasks hands each task's rows to a RowSink: a lost task's rows are error rows with the
    run's common fields; a process that does not write (not process 0 under jax.distributed)
    returns the rows and leaves the file alone."""
    from remat_kit.sweep.run import RowSink

    (task,) = make_tasks(analysis_grid().points()[:1])
    path = tmp_path / "rows.jsonl"
    quiet = RowSink(path, {"sweep": "tasks"}, writes=False)
    lost = quiet.take(task, None, RuntimeError("gone"))
    assert [(r["key"], r["status"], r["sweep"]) for r in lost] == [
        (task.points[0].key, "error", "tasks")
    ]
    assert not path.exists()
    ok = [{"key": task.points[0].key, "status": "ok"}]
    assert RowSink(path).take(task, ok, None) == ok
    assert [r["key"] for r in results.read_rows(path)] == [task.points[0].key]


# -- Shards (SLURM arrays) and their merge -------------------------------------------------------

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "sweep.py"


def _cli():
    spec = importlib.util.spec_from_file_location("sweep_cli_tasks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config_file(tmp_path) -> Path:
    path = tmp_path / "grid.py"
    path.write_text(
        "from remat_kit.sweep import Grid, SweepConfig\n"
        "def get_config():\n"
        "    return SweepConfig('tasks', grids=(Grid(name='analysis', models=('tiny-gpt',),\n"
        "        policies=('no-remat',), batch_sizes=(2,), seq_lens=(32, 64),\n"
        "        overrides={'num_layers': 1}, measure=False),))\n"
    )
    return path


def test_shards_then_merge_give_the_serial_rows_summary_and_figures(tmp_path, serial, capsys):
    """--shard 0/2 and --shard 1/2 write their own part files (no summary), --merge joins
    them into --out: the serial run's rows by key (timings aside), its summary table, the
    figures and the report."""
    first, path = serial
    cli = _cli()
    cfg, out = str(_config_file(tmp_path)), tmp_path / "s" / "sweep.jsonl"
    base = ["--config", cfg, "--out", str(out), "--no-progress"]
    for i in (1, 0):  # in either order
        assert cli.main([*base, "--shard", f"{i}/2"]) == 0
        said = capsys.readouterr().out
        assert f"part {i}/2: 1 point(s) run" in said and "--merge" in said, said
    parts = [tmp_path / "s" / f"sweep.part-{i}-of-2.jsonl" for i in (0, 1)]
    assert [len(results.read_rows(p)) for p in parts] == [1, 1]
    assert [results.read_rows(p)[0]["seq_len"] for p in parts] == [32, 64]
    assert not out.exists() and not (out.parent / "summary.md").exists()
    assert cli.main([*base, "--merge"]) == 0
    merged = results.read_rows(out)
    assert [r["key"] for r in merged] == [r["key"] for r in first.rows]
    assert by_key(merged) == by_key(results.read_rows(path))
    written = (out.parent / "summary.md").read_text()
    assert summary.summary_markdown(first.rows) in written
    assert (out.parent / "pareto_analysis.png").stat().st_size > 0
    assert (out.parent / "report.html").stat().st_size > 0
    assert "2 point(s) run" in capsys.readouterr().out
    # merging again (the parts unchanged) gives the same file
    data = out.read_bytes()
    assert cli.main([*base, "--merge", "--no-plot"]) == 0
    assert out.read_bytes() == data
    # a part missing: one line naming it, exit 2, the merged file untouched
    parts[1].unlink()
    assert cli.main([*base, "--merge", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sweep.part-1-of-2.jsonl missing" in err, err
    assert out.read_bytes() == data
    # the parts named: a merge of part 0 alone says which part to resume, exit 1
    other = tmp_path / "t" / "sweep.jsonl"
    named = ["--config", cfg, "--out", str(other), "--merge", str(parts[0]), "--no-plot"]
    assert cli.main(named) == 1
    said = capsys.readouterr().out
    assert "1 of 2 points are in no file yet (part 1/2 (1 left)" in said, said
    assert len(results.read_rows(other)) == 1


@pytest.mark.parametrize("value", ["2/2", "0/0", "-1/2", "1", "a/b", "1/2/3", ""])
def test_a_bad_shard_is_one_line_naming_the_value_and_the_form(tmp_path, capsys, value):
    argv = ["--config", "quick", "--out", str(tmp_path / "o.jsonl"), f"--shard={value}"]
    with pytest.raises(SystemExit) as exit_:  # argparse's, before anything is loaded
        _cli().main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("sweep.py: error: "), err
    assert "argument --shard: expected I/N (part I of N, 0 <= I < N" in err
    assert f"got {value!r}" in err, err


def test_shard_merge_and_engine_refuse_what_they_cannot_go_with(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    cli = _cli()
    base = ["--config", "quick", "--out", str(tmp_path / "o.jsonl")]
    cases = [
        (
            ["--engine", "ray"],
            "--engine ray needs Ray, which is not installed: pip install 'remat-kit[ray]'",
        ),
        (["--address", "10.0.0.1:6379"], "--address: only with --engine ray"),
        (["--engine", "ray", "--workers", "2"], "--workers: not with --engine ray"),
        (["--shard", "0/2", "--merge"], "--shard and --merge: one or the other"),
        (["--merge", "--resume"], "--merge: not with --resume"),
        (["--merge", "--workers", "2"], "--merge: not with --workers"),
        (["--merge"], "no part files o.part-I-of-N.jsonl in"),
    ]
    for extra, message in cases:
        assert cli.main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("sweep.py: error: ") and err.count("\n") == 1, err
        assert message in err, err
    model = ["--model", "remat_kit.examples.plain_jax:program", "--shard", "0/2"]
    assert cli.main(model) == 2
    assert "--shard: not with --model" in capsys.readouterr().err


def test_shard_points_are_contiguous_disjoint_and_cover_the_points():
    points = analysis_grid(policies=("no-remat", "save-nothing", "save-dots")).points()
    for count in (1, 2, 4, 7):
        parts = [shard_points(points, Shard(i, count)) for i in range(count)]
        assert [p for part in parts for p in part] == points
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parse_shard(" 3/4 ") == Shard(3, 4) and str(Shard(3, 4)) == "3/4"
    with pytest.raises(ValueError, match="expected I/N"):
        Shard(4, 4)
