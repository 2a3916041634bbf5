"""``remat-kit analyze`` over a grid (remat_kit/cli/grid.py): several --seq and --policy values
run as the sweep's tasks give the same rows by key serially, on 2 worker processes, and as
two shards merged; a resume keeps the rows already written byte for byte; bad input is one
line, exit 2, with nothing written lost."""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest

from remat_kit import cli
from remat_kit.sweep.results import read_rows

#: tiny-gpt x s in {32, 64} x 2 policies: 4 points, 2 tasks (one per sequence length).
GRID = ["analyze", "--model", "tiny-gpt", "--batch", "2", "--seq", "32", "--seq", "64",
        "--policy", "no-remat", "--policy", "save-nothing"]  # fmt: skip


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*GRID, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _figures(row: dict) -> dict:
    """A row without what differs from run to run: when it was made, seconds spent, the name
    of the file the run kept its calibration in (the step-time estimate's source says it)."""
    out = {k: v for k, v in row.items() if k not in ("time", "point_s", "analysis_compile_s")}
    report = dict(row.get("report") or {})
    for k in ("compile_s", "compile_cached"):
        report.pop(k, None)
    step = report.get("step_time")
    if step and step.get("figures"):
        figures = re.sub(r"kept for this run in \S+", "kept for this run", step["figures"])
        report["step_time"] = {**step, "figures": figures}
    out["report"] = report
    return out


def _by_key(path) -> dict:
    return {r["key"]: _figures(r) for r in read_rows(path)}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The grid run serially (this process) into a results file."""
    path = tmp_path_factory.mktemp("grid") / "serial.jsonl"
    assert cli.main([*GRID, "--out", str(path)]) == 0
    return path


def test_a_grid_runs_as_tasks_and_prints_one_table(serial, capsys, tmp_path):
    rows = read_rows(serial)
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert {(r["seq_len"], r["policy"]) for r in rows} == {
        (s, p) for s in (32, 64) for p in ("no-remat", "save-nothing")
    }
    assert all(r["sweep"] == "analyze" and r["measure"] is False for r in rows)


def test_without_out_a_grid_prints_one_table_fitted_to_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    argv = ["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "16", "--seq", "32"]
    code = cli.main(argv)  # no --out: the rows in a folder removed at the end
    out, err = capsys.readouterr()
    assert code == 0, err
    words = " ".join(out.split())
    assert words.count("analyze grid on local") == 1 and "2 points, 2 rows," in words
    assert "[0:00:0" in err and "2/2] done" in err  # the driver's progress, cut to 60
    assert max(len(line) for line in out.splitlines()) <= 60


def test_two_workers_and_two_shards_merged_give_the_serial_rows(serial, capsys, tmp_path):
    workers = tmp_path / "workers.jsonl"
    code, _, err = _main(capsys, "--out", str(workers), "--grid-workers", "2")
    assert code == 0, err
    # the driver's progress, its counts kept where a line is cut to the width
    assert "running" in err and "[4 done, 0 running, 0 left]" in err, err
    assert _by_key(workers) == _by_key(serial)
    merged = tmp_path / "merged.jsonl"
    for i in (0, 1):
        code, _, err = _main(capsys, "--out", str(merged), "--shard", f"{i}/2")
        assert code == 0, err
        assert len(read_rows(tmp_path / f"merged.part-{i}-of-2.jsonl")) == 2  # one seq each
    assert not merged.exists()
    code, out, err = _main(capsys, "--out", str(merged), "--merge")
    assert code == 0, err
    assert "merged 4 rows" in err and out.count("analyze grid") == 1
    assert _by_key(merged) == _by_key(serial)


def test_resume_keeps_the_rows_written_byte_for_byte(serial, capsys, tmp_path):
    path = tmp_path / "resumed.jsonl"
    lines = serial.read_bytes().splitlines(keepends=True)
    first = b"".join(lines[:2])  # the s=32 task's rows
    path.write_bytes(first + lines[2][:40])  # and a torn line, as a kill mid-write leaves
    shutil.copy(
        serial.with_name("serial.timelines.jsonl"), path.with_name("resumed.timelines.jsonl")
    )
    code, _, err = _main(capsys, "--out", str(path), "--resume")
    assert code == 0, err
    assert "2 kept" in err
    data = path.read_bytes()
    assert data.startswith(first)
    assert _by_key(path) == _by_key(serial)
    assert len(data.splitlines()) == 4


def test_bad_input_is_one_line_exit_2_and_nothing_written_is_lost(serial, capsys, tmp_path):
    path = tmp_path / "kept.jsonl"
    shutil.copy(serial, path)
    before = path.read_bytes()
    cases = [
        (["--out", str(path), "--shard", "3/2"], "'3/2'"),
        (["--model", "tiny-gpz", "--out", str(path), "--resume"], "tiny-gpz"),
        (["--out", str(path)], "--resume"),  # rows there: resume or overwrite
        (["--html", "r.html"], "--html"),
        (["--resume"], "--out"),
        (["--shard", "0/2", "--merge", "--out", str(path)], "one or the other"),
        (["--engine", "local", "--address", "x:1", "--out", str(path)], "--address"),
        (["--engine", "rayy", "--out", str(path), "--resume"], "local, ray, got 'rayy'"),
    ]
    for argv, named in cases:
        code, out, err = _main(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and named in err and "Traceback" not in err, (argv, err)
        assert path.read_bytes() == before
    # an unknown model among several names the valid presets
    code, _, err = _main(capsys, "--model", "nope", "--out", str(path), "--resume")
    assert code == 2 and "nope" in err and "tiny-gpt" in err


def test_one_point_with_out_writes_its_rows(capsys, tmp_path):
    path = tmp_path / "one.jsonl"
    code = cli.main(["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "32",
                     "--out", str(path)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = read_rows(path)
    assert len(rows) == 1 and rows[0]["policy"] == json.loads(json.dumps(rows[0]["policy"]))
    assert "1 point, 1 row," in out


def test_the_table_shows_meshes_short_and_a_failed_point_by_its_status():
    from rich.console import Console

    from remat_kit.cli.grid import grid_table

    base = {"model": "tiny-gpt", "batch_size": 2, "seq_len": 32, "policy": "no-remat",
            "status": "ok", "peak_bytes": 3 * 2**20, "activation_bytes": 2**20,
            "recompute_ratio": 1.0, "fits": True, "predicted_step_time_s": 1e-3}  # fmt: skip
    rows = [
        {**base, "mesh": "dp=1,fsdp=2,tp=1"},
        {**base, "mesh": "dp=2,fsdp=1,tp=2", "status": "oom", "peak_bytes": None},
    ]
    out = Console(width=80, record=True, file=io.StringIO())
    out.print(grid_table(rows, "h100-sxm"))
    text = out.export_text()
    assert "fsdp=2" in text and "dp=2,tp=2" in text and "tp=1" not in text
    assert "oom" in text and "3.00" in text and "yes" in text
    assert max(len(line) for line in text.splitlines()) <= 80
