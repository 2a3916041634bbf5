"""Tests for remat_kit.sweep / results / plots and experiments/sweep.py.

Compiling a train step costs seconds on 2 CPU cores whatever the model, so the end-to-end tests
use the ``quick`` config's shapes (tiny-gpt, three policies, two steps) and as few points as
cover the behaviour: a sweep killed in a subprocess after its first row and resumed (the quick
config end to end through the command line), and an in-process sweep with an injected failure.
Bad input is checked through ``main()`` with the analysis patched to fail the test if reached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remat_kit import plots, results, sweep
from remat_kit.sweep import Grid, SweepConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "sweep.py"
POLICIES = ("no-remat", "save-nothing", "save-dots-no-batch")


def _cli():
    spec = importlib.util.spec_from_file_location("sweep_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny(name="t", **grid):
    g = dict(
        name="measured",
        models=("tiny-gpt",),
        policies=POLICIES,
        batch_sizes=(2,),
        seq_lens=(32,),
        overrides={"scan_layers": True},
        warmup_steps=1,
        timed_steps=1,
    )
    g.update(grid)
    return SweepConfig(name, grids=(Grid(**g),))


# -- The results file ---------------------------------------------------------------------------


def test_rows_append_read_and_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    results.append_row(path, {"key": "a", "x": 1})
    results.append_row(path, {"key": "b", "x": 2})
    with open(path, "a") as f:
        f.write('{"key": "c", "x"')  # a kill mid-write
    assert [r["key"] for r in results.read_rows(path)] == ["a", "b"]
    assert results.repair(path) == len('{"key": "c", "x"')
    assert path.read_text().endswith("}\n")
    results.append_row(path, {"key": "c", "x": 3})
    assert [r["key"] for r in results.read_rows(path)] == ["a", "b", "c"]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a"}\nnot json\n{"key": "b"}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        results.read_rows(path)


def test_point_key_is_stable_and_distinct():
    points = _tiny(seq_lens=(32, 64)).points()
    keys = [p.key for p in points]
    assert len(set(keys)) == len(keys) == 6
    assert keys == [p.key for p in _tiny(seq_lens=(32, 64)).points()]
    assert _tiny().fingerprint() != _tiny(timed_steps=2).fingerprint()
    assert _tiny().fingerprint() != _tiny().fingerprint(data="/some/text")


def test_summarize_against_no_remat():
    base = dict(
        model="m",
        target="local",
        batch_size=1,
        seq_len=8,
        remat_group_size=1,
        overrides={},
        status="ok",
    )
    rows = [
        {
            **base,
            "policy": "no-remat",
            "peak_bytes": 100,
            "activation_bytes": 80,
            "step_time_s": 1.0,
        },
        {
            **base,
            "policy": "save-nothing",
            "peak_bytes": 40,
            "activation_bytes": 8,
            "step_time_s": 1.25,
        },
        {**base, "policy": "save-dots", "status": "oom", "peak_bytes": None},
    ]
    recs = {r["policy"]: r for r in results.summarize(rows)}
    assert recs["save-nothing"]["peak_saved"] == pytest.approx(0.6)
    assert recs["save-nothing"]["activation_saved"] == pytest.approx(0.9)
    assert recs["save-nothing"]["slowdown"] == pytest.approx(0.25)
    assert recs["save-dots"]["peak_saved"] is None
    assert plots.pareto_frontier([1.0, 1.25, 1.1], [100, 40, 120]) == [0, 1]


# -- Bad input: one line, exit 2, nothing compiled ------------------------------------------------


def _config_file(tmp_path, **grid):
    fields = {
        "name": "'measured'",
        "models": "('tiny-gpt',)",
        "policies": "('no-remat',)",
        "batch_sizes": "(2,)",
        "seq_lens": "(32,)",
        "overrides": "{'scan_layers': True}",
    }
    fields.update(grid)
    args = ", ".join(f"{k}={v}" for k, v in fields.items())
    path = tmp_path / "cfg.py"
    path.write_text(
        "from remat_kit.sweep import Grid, SweepConfig\n"
        f"def get_config():\n    return SweepConfig('bad', grids=(Grid({args}),))\n"
    )
    return path


@pytest.fixture
def no_compile(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("bad input must be caught before anything compiles")

    monkeypatch.setattr(sweep, "_analyze_group", fail)
    monkeypatch.setattr(sweep, "measure_point", fail)
    monkeypatch.setattr(sweep, "compile_steps", fail)


@pytest.mark.parametrize(
    "grid, message",
    [
        ({"models": "('gpt-10n',)"}, "unknown preset 'gpt-10n'.*Did you mean 'gpt-10m'"),
        ({"policies": "('save-dot',)"}, "unknown policy 'save-dot'"),
        ({"seq_lens": "(0,)"}, "seq_lens must hold positive integers"),
        ({"seq_lens": "(4096,)"}, "exceeds max_seq_len=128"),
        ({"remat_group_sizes": "(3,)"}, "remat_group_size=3 does not divide"),
        ({"targets": "('h100',)"}, "unknown target 'h100'"),
        ({"overrides": "{'d_modle': 8}"}, "unknown ModelConfig field 'd_modle'"),
    ],
)
def test_bad_config_exits_2_before_compiling(tmp_path, capsys, no_compile, grid, message):
    cfg = _config_file(tmp_path, **grid)
    code = _cli().main(["--config", str(cfg), "--out", str(tmp_path / "o.jsonl"), "--no-plot"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err


def test_bad_output_and_data_exit_2(tmp_path, capsys, no_compile):
    cli = _cli()
    cfg = str(_config_file(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (["--out", str(blocker / "o.jsonl")], "cannot write results"),
        (["--out", str(tmp_path / "o.jsonl"), "--data", str(tmp_path / "nope")], "does not exist"),
        (["--out", str(tmp_path / "o2.jsonl"), "--data", str(blocker.parent / "bin")], "binary"),
        (["--config", "no-such-config"], "no sweep config"),
    ]
    (tmp_path / "bin").write_bytes(b"\x00\x01\x02" * 100)
    for extra, message in cases:
        argv = ["--config", cfg, "--no-plot", *extra]
        assert cli.main(argv) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_resume_onto_another_config_exits_2(tmp_path, capsys, no_compile):
    out = tmp_path / "o.jsonl"
    results.append_row(out, {"key": "x", "config_fingerprint": "0123456789abcdef"})
    cfg = str(_config_file(tmp_path))
    cli = _cli()
    assert cli.main(["--config", cfg, "--out", str(out), "--resume", "--no-plot"]) == 2
    assert "different sweep config" in capsys.readouterr().err
    assert cli.main(["--config", cfg, "--out", str(out), "--no-plot"]) == 2
    assert "pass --resume" in capsys.readouterr().err


# -- End to end -----------------------------------------------------------------------------------

QUICK = ROOT / "experiments" / "configs" / "quick.py"
# Child process: the quick config, stalled in its second point's measurement so that the test can
# kill it mid-way deterministically (one row written, the next point in progress).
_CHILD = r"""
import sys, time
from remat_kit import sweep
measure = sweep.measure_point
calls = []
def stalled(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        time.sleep(600)
    return measure(*args, **kwargs)
sweep.measure_point = stalled
sweep.run_sweep(sweep.load_config(sys.argv[1]), sys.argv[2], progress=False)
"""


@pytest.fixture(scope="module")
def killed_child(tmp_path_factory):
    """The child sweep, started once per module: it runs while the in-process test does."""
    out = tmp_path_factory.mktemp("quick") / "sweep.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(QUICK), str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    yield proc, out
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_for_rows(path: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(results.read_rows(path)) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"sweep exited ({proc.returncode}) before writing {n} row(s)")
        time.sleep(0.05)
    pytest.fail(f"no {n} row(s) in {path} after {timeout} s")


def test_injected_failure_gives_an_error_row_and_the_rest_complete(tmp_path, killed_child):
    def fail(point):
        if point.policy == "save-nothing":
            raise RuntimeError("injected failure\nsecond line")

    out = tmp_path / "r.jsonl"
    run = sweep.run_sweep(_tiny(), out, progress=False, before_point=fail)
    rows = {r["policy"]: r for r in results.read_rows(out)}
    assert [r["policy"] for r in run.rows] == list(POLICIES)
    assert rows["save-nothing"]["status"] == "error"
    assert rows["save-nothing"]["error"] == "RuntimeError: injected failure"
    assert rows["save-nothing"]["peak_bytes"] is None and rows["save-nothing"]["losses"] is None
    for policy in ("no-remat", "save-dots-no-batch"):
        r = rows[policy]
        assert r["status"] == "ok", r["error"]
        assert r["peak_bytes"] > 0 and r["report"]["policy"] == policy
        assert r["step_time_s"] > 0 and len(r["losses"]) == 2 and r["tokens_per_s"] > 0
        assert r["measured_peak_bytes"] is None
        assert "no peak_bytes_in_use" in r["measured_peak_note"]
        assert r["mfu"] is None  # the CPU has no known peak FLOP/s
        for field in ("jax", "jaxlib", "flax", "device_kind", "time", "data_fingerprint"):
            assert r[field], field
    assert set(rows["save-nothing"]) == set(rows["no-remat"])  # every row has every field
    # Same data, same initial state: remat does not change the losses beyond float tolerance.
    assert rows["no-remat"]["losses"] == pytest.approx(
        rows["save-dots-no-batch"]["losses"], rel=1e-4
    )
    assert rows["save-dots-no-batch"]["peak_bytes"] < rows["no-remat"]["peak_bytes"]
    # A resumed run with nothing left to do writes nothing.
    again = sweep.run_sweep(_tiny(), out, resume=True, progress=False)
    assert again.new_rows == [] and again.skipped == 3
    # Every figure draws from the rows alone.
    written = plots.save_figures(run.rows, tmp_path)
    assert [p.name for p in written] == [
        "pareto.png",
        "slowdown_vs_flops.png",
        "memory_breakdown.png",
    ]
    plots.memory_breakdown(run.rows, path=tmp_path / "breakdown.png")
    plots.predicted_vs_measured(run.rows, path=tmp_path / "pvm.png")
    plots.slowdown_vs_flops(run.rows, path=tmp_path / "slow.png")
    assert "save-nothing" in results.summary_markdown(run.rows)
    json.dumps(run.rows)


def test_killed_sweep_resumes_without_duplicates(killed_child):
    """The quick config end to end: killed after its first row, resumed, every point once."""
    proc, out = killed_child
    try:
        _wait_for_rows(out, 1, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = results.read_rows(out)
    assert len(before) == 1
    with open(out, "a") as f:
        f.write('{"key": "torn')  # as if killed inside a write
    cmd = [sys.executable, str(SCRIPT), "--config", "quick", "--out", str(out), "--no-progress"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = results.read_rows(out)
    keys = [r["key"] for r in rows]
    assert sorted(keys) == sorted(p.key for p in sweep.load_config(QUICK).points())
    assert len(set(keys)) == len(keys) == 3
    assert rows[0] == before[0]  # the completed row kept as it was
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert "1 skipped" in done.stdout
    assert "no-remat" in done.stdout and "step ms" in done.stdout  # the table
    assert (out.parent / "pareto.png").stat().st_size > 0
    assert "| save-nothing |" in (out.parent / "summary.md").read_text()
