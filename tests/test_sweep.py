"""Tests for remat_kit.sweep / results / plots and experiments/sweep.py.

Compiling a train step costs seconds on 2 CPU cores whatever the model, so the end-to-end tests
use the ``quick`` config's shapes (tiny-gpt, three policies, two steps) and as few points as
cover the behaviour: a sweep killed in a subprocess after its first row and resumed (the quick
config end to end through the command line), and an in-process sweep with an injected failure.
Bad input is checked through ``main()`` with the analysis patched to fail the test if reached.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from measured import TextMeasurer, summary
from measured import steps as measure

import remat_kit
from remat_kit import plots, sweep
from remat_kit.memory import analyze_policies
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import get_policy_spec
from remat_kit.sweep import Grid, SweepConfig, results
from remat_kit.zoo import preset

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
        measure=True,
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


def test_timelines_go_beside_the_rows_and_come_back(tmp_path):
    path = tmp_path / "sweep.jsonl"
    side = results.timelines_path(path)
    assert side.name == "sweep.timelines.jsonl"
    timeline = {"length": 3, "device_bytes": {"params": [1, 2, 3]}}
    results.append_row(path, {"key": "a", "report": {"policy": "p", "timeline": timeline}})
    results.append_row(path, {"key": "b", "report": {"policy": "q", "timeline": None}})
    results.append_row(path, {"key": "c", "status": "error", "report": None})
    assert "device_bytes" not in path.read_text() and "device_bytes" in side.read_text()
    rows = results.read_rows(path)
    assert [r["key"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["report"]["timeline"] == timeline and rows[1]["report"]["timeline"] is None
    assert results.read_rows(path, timelines=False)[0]["report"]["timeline"] is None
    # A kill between the timeline and its row: a timeline no row names (ignored), torn too.
    with open(side, "a") as f:
        f.write('{"key": "d", "timeline": {"len')
    assert len(results.read_rows(path)) == 3
    assert results.repair(path) == 0 and side.read_text().endswith("}\n")
    # The point run again writes its timeline again: the last one is read.
    newer = {**timeline, "length": 4}
    results.append_row(path, {"key": "a", "report": {"policy": "p", "timeline": newer}})
    assert results.read_rows(path)[0]["report"]["timeline"] == newer
    results.truncate(path)
    assert path.read_text() == side.read_text() == "" and results.read_rows(path) == []


def test_summary_legend_names_only_the_columns_the_tables_have():
    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    measured = [r for r in rows if r.get("step_time_s") is not None]
    analysed = [r for r in rows if r.get("step_time_s") is None]
    for subset in (rows, measured, analysed):
        headers = {c for _, header, _ in summary.summary_lines(subset) for c in header}
        legend = summary.summary_legend(subset)
        for column, text in summary.COLUMN_LEGEND.items():
            has = column in headers or (column == "peak" and any(
                c.startswith("peak ") and c != "peak Δ" for c in headers))  # fmt: skip
            assert (text in legend) == has, (column, sorted(headers))
    assert "tok/s" not in summary.summary_legend(analysed)
    # the step's spread: its own timed steps, (max - min) / median, shown as ± half of it
    (record,) = [r for r in results.summarize(measured) if r["policy"] == "minimal"
                 and r["seq_len"] == 128]  # fmt: skip
    (row,) = [r for r in measured if r["policy"] == "minimal" and r["seq_len"] == 128]
    times = sorted(row["step_times_s"])
    assert record["step_spread"] == pytest.approx((times[-1] - times[0]) / times[len(times) // 2])
    ((_, header, body), *_) = summary.summary_lines(measured)
    line = body[[b[0] for b in body].index("minimal")]
    ms = 1e3 * row["step_time_s"]
    digits = f"{ms:,.0f}" if ms >= 100 else f"{ms:#.3g}"  # 6.36 ms is not "6"
    mark = "*" if record["noisy"] else ""
    assert line[header.index("step ms")] == f"{digits}±{50 * record['step_spread']:.0f}%{mark}"
    # the estimate beside the step it predicts, with its error
    est = row["predicted_step_time_s"]
    assert header.index("est. ms") == header.index("step ms") + 1
    assert line[header.index("est. err")] == f"{100 * (est / row['step_time_s'] - 1):+.0f}%"
    assert "est. ms" in summary.summary_legend(measured)
    assert summary.summary_legend([]) == ""
    # gpt-10m's peaks (hundreds of MiB) keep one decimal; a small model's (under 10 MiB) two,
    # so 4.38 and 4.50 MiB do not both read 4.4-4.5
    peak = header.index("peak MiB")
    assert line[peak] == f"{row['peak_bytes'] / 2**20:,.1f}"
    small = [{**r, "peak_bytes": r["peak_bytes"] // 64} for r in measured]
    ((_, header, body), *_) = summary.summary_lines(small)
    line = body[[b[0] for b in body].index("minimal")]
    assert line[header.index("peak MiB")] == f"{row['peak_bytes'] // 64 / 2**20:,.2f}"


def test_a_policy_compiled_to_an_earlier_ones_program_is_labelled_so():
    """A user's program swept: a cut-down policy compiled to save-out-proj's program measured
    -25% against save-out-proj's -9%, noise the table showed as a real difference; analyze and
    recommend label such rows "same program as". Another sequence length is its own group."""
    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    measured = [r for r in rows if r.get("step_time_s") is not None]
    by = {(r["policy"], r["seq_len"]): r for r in measured}
    twin = {**by["save-qkv-out-proj", 128]}
    twin["report"] = {**twin["report"], "program_sha256": by["save-out-proj", 128]["report"][
        "program_sha256"]}  # fmt: skip
    other_seq = {**by["save-qkv-out-proj", 256]}  # same sha, other group: no label
    other_seq["report"] = twin["report"]
    rows = [r if r is not by["save-qkv-out-proj", 128] else twin for r in measured]
    rows = [r if r is not by["save-qkv-out-proj", 256] else other_seq for r in rows]
    records = {(r["policy"], r["seq_len"]): r for r in results.summarize(rows)}
    assert records["save-qkv-out-proj", 128]["same_program_as"] == "save-out-proj"
    assert records["save-qkv-out-proj", 256]["same_program_as"] is None
    assert records["save-out-proj", 128]["same_program_as"] is None
    ((_, _, body), *_) = summary.summary_lines(rows)
    labels = [line[0] for line in body]
    assert "save-qkv-out-proj (same program as save-out-proj)" in labels
    assert labels.count("save-qkv-out-proj") == 1  # the s=256 row


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
    assert results.pareto_frontier([1.0, 1.25, 1.1], [100, 40, 120]) == [0, 1]
    # a noisy timing is neither on the frontier nor pushes a point off it
    assert results.pareto_frontier([1.0, 1.25, 1.1], [100, 40, 120], left_out={1}) == [0]
    assert results.pareto_frontier([0.9, 1.0, 1.25], [50, 100, 40], left_out={0}) == [1, 2]


@pytest.mark.parametrize(
    ("times", "noisy", "cell"),
    [([0.50, 0.52, 0.51], False, "510±2%"), ([0.40, 0.55, 0.61], True, "550±19%*"),
     ([0.50], False, "500"), ([0.46, 0.50, 0.55], False, "500±9%")],
)  # fmt: skip
def test_a_noisy_timing_is_marked_where_it_is_shown(times, noisy, cell):
    """A step whose own timed steps spread beyond NOISY_SPREAD carries a * in the table and
    `noisy` in its record."""
    import statistics

    base = {"model": "m", "target": "local", "batch_size": 1, "seq_len": 8, "status": "ok",
            "peak_bytes": 1000}  # fmt: skip
    row = {**base, "policy": "save-nothing", "step_times_s": times,
           "step_time_s": statistics.median(times)}  # fmt: skip
    rows = [{**base, "policy": "no-remat", "step_time_s": 0.4}, row]
    assert results.is_noisy(row) is noisy
    (rec,) = [r for r in results.summarize(rows) if r["policy"] == "save-nothing"]
    assert rec["noisy"] is noisy
    ((_, header, body),) = summary.summary_lines(rows)
    assert body[1][header.index("step ms")] == cell


# -- Bad input: one line, exit 2, nothing compiled ------------------------------------------------


def _config_file(tmp_path, **grid):
    fields = {
        "name": "'measured'",
        "measure": "True",
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


class _Compiled(BaseException):
    """Raised by the compile engine in tests of bad input (no ``except Exception`` eats it)."""


@pytest.fixture
def no_compile(monkeypatch):
    def fail(*args, **kwargs):
        raise _Compiled("bad input must be caught before anything compiles")

    # Every compile of the sweep (analysis and measured steps) goes through the engine.
    monkeypatch.setattr(CompileEngine, "compile_all", fail)


@pytest.mark.parametrize(
    "grid, message",
    [
        ({"models": "('gpt-10n',)"}, "unknown preset 'gpt-10n'.*Did you mean 'gpt-10m'"),
        ({"policies": "('save-dot',)"}, "unknown policy 'save-dot'"),
        ({"policies": "('query_proj=keep',)"}, "tag 'query_proj': unknown action 'keep'"),
        ({"seq_lens": "(0,)"}, r"seq_lens\[0\] must be a positive integer, got 0"),
        ({"seq_lens": "(4096,)"}, "exceeds max_seq_len=128"),
        ({"remat_group_sizes": "(3,)"}, "remat_group_size=3 does not divide"),
        ({"targets": "('h100',)"}, "unknown target 'h100'"),
        ({"overrides": "{'d_modle': 8}"}, "unknown ModelConfig field 'd_modle'"),
        # the same wording as a program sweep's --warmup-steps (validation.nonnegative_int)
        ({"warmup_steps": "-1"}, "warmup_steps must be 0 or a positive integer, got -1"),
        ({"warmup_steps": "True"}, "warmup_steps must be 0 or a positive integer, got True"),
    ],
)
def test_bad_config_exits_2_before_compiling(tmp_path, capsys, no_compile, grid, message):
    cfg = _config_file(tmp_path, **grid)
    code = _cli().main(["--config", str(cfg), "--out", str(tmp_path / "o.jsonl"), "--no-plot"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("sweep.py: error: ") and err.count("\n") == 1, err
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
        (
            ["--config", "qiuck"],
            "valid: cpu, gpu, options, quick, tpu, or a path to a .py file. Did you mean 'quick'?",
        ),
    ]
    (tmp_path / "bin").write_bytes(b"\x00\x01\x02" * 100)
    for extra, message in cases:
        argv = ["--config", cfg, "--no-plot", *extra]
        assert cli.main(argv) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("sweep.py: error: ") and message in err and err.count("\n") == 1, err


def test_resume_onto_another_config_exits_2(tmp_path, capsys, no_compile):
    out = tmp_path / "o.jsonl"
    results.append_row(out, {"key": "x", "config_fingerprint": "0123456789abcdef"})
    before = out.read_bytes()
    cfg = str(_config_file(tmp_path))
    cli = _cli()
    assert cli.main(["--config", cfg, "--out", str(out), "--resume", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "different sweep config" in err and err.count("\n") == 1, err
    assert cli.main(["--config", cfg, "--out", str(out), "--no-plot"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert out.read_bytes() == before  # nothing overwritten


@pytest.mark.parametrize("model", [False, True])
def test_a_full_results_file_is_refused_before_the_banner(tmp_path, capsys, no_compile, model):
    """Run again into a file that holds rows: one line, exit 2, and nothing on stdout before it
    (the banner once came first), for a config and for a program (--model)."""
    out = tmp_path / "o.jsonl"
    results.append_row(out, {"key": "x"})
    if model:
        argv = ["--model", "tests/user_models/plain_jax.py:program", "--out", str(out)]
    else:
        argv = ["--config", str(_config_file(tmp_path)), "--out", str(out), "--no-plot"]
    assert _cli().main(argv) == 2
    printed = capsys.readouterr()
    assert printed.out == "", printed.out
    assert printed.err == (
        f"sweep.py: error: {out} already holds 1 row(s); pass --resume to continue that sweep, "
        "--overwrite to start again, or --out for a new file\n"
    )


def test_first_difference_names_the_field():
    a = _tiny().identity()
    b = _tiny(timed_steps=2).identity()
    assert results.first_difference(a, b) == "grids[0].timed_steps: 1 in the file, 2 now"
    assert results.first_difference(a, a) == ""
    assert results.first_difference({"x": 1}, {}) == 'x: 1 in the file, "(absent)" now'
    row = {"config_fingerprint": results.fingerprint(a), "sweep_config": a}
    with pytest.raises(ValueError, match=r"grids\[0\].timed_steps: 1 in the file, 2 now"):
        results.check_resumable([row], results.fingerprint(b), "f.jsonl", b)
    with pytest.raises(ValueError, match="not sweep rows"):
        results.check_resumable([{"a": 1}], results.fingerprint(b), "f.jsonl", b)


# -- End to end -----------------------------------------------------------------------------------

QUICK = ROOT / "experiments" / "configs" / "quick.py"
# Child process: the real command line on the quick config, killed (SIGKILL, by itself) in the
# middle of writing its second row: half the line is on disk, as if the kill hit the write.
_CHILD = r"""
import os, runpy, signal, sys
from pathlib import Path
from remat_kit.sweep import results
real = results.append_row
calls = []
def append_and_die(path, row):
    calls.append(1)
    if len(calls) < 2:
        return real(path, row)
    scratch = Path(f"{path}.scratch")
    real(scratch, row)
    line = scratch.read_bytes()
    with open(path, "ab") as f:
        f.write(line[: len(line) // 2])
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
results.append_row = append_and_die
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _sweep_cmd(out: Path, *extra: str) -> list[str]:
    return [str(SCRIPT), "--config", "quick", "--out", str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def killed_child(tmp_path_factory):
    """The child sweep, started once per module: it runs while the in-process test does."""
    out = tmp_path_factory.mktemp("quick") / "sweep.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *_sweep_cmd(out, "--no-plot")],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    yield proc, out
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_injected_failure_gives_an_error_row_and_the_rest_complete(
    tmp_path, killed_child, fresh_compile_cache
):
    def fail(point):
        if point.policy == "save-nothing":
            raise RuntimeError("injected failure\nsecond line")

    import io

    from rich.console import Console

    out, log = tmp_path / "r.jsonl", io.StringIO()
    run = sweep.run_sweep(_tiny(), out, before_point=fail, console=Console(file=log, width=200),
                          measurer=TextMeasurer())  # fmt: skip
    rows = {r["policy"]: r for r in results.read_rows(out)}
    # progress as it happens: a line per compile and per timed round, not one per stage
    lines = log.getvalue().splitlines()
    assert sum("compiles done" in line for line in lines) >= 2, lines
    assert any(re.search(r"timing .*: round 2 of 2 done", line) for line in lines), lines
    assert [r["policy"] for r in run.rows] == list(POLICIES)
    assert rows["save-nothing"]["status"] == "error"
    assert rows["save-nothing"]["error"] == "RuntimeError: injected failure"
    assert rows["save-nothing"]["peak_bytes"] is None and rows["save-nothing"]["losses"] is None
    for policy in ("no-remat", "save-dots-no-batch"):
        r = rows[policy]
        assert r["status"] == "ok", r["error"]
        assert r["peak_bytes"] > 0 and r["report"]["policy"] == policy
        assert r["step_time_s"] > 0 and len(r["losses"]) == 2 and r["tokens_per_s"] > 0
        assert r["compile_reused"] is True  # the analyzer's executable ran: compiled once
        assert r["measured_peak_bytes"] is None
        assert "no peak_bytes_in_use" in r["measured_peak_note"]
        assert r["step_order"] == "interleaved"  # no peak to keep apart on the CPU
        assert len(r["load_average"]) == 3  # what else ran on the cores when it was timed
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
    again = sweep.run_sweep(_tiny(), out, resume=True, progress=False, measurer=TextMeasurer())
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
    assert "save-nothing" in summary.summary_markdown(run.rows)
    json.dumps(run.rows)


def test_killed_sweep_resumes_without_duplicates(tmp_path, killed_child, capsys, monkeypatch):
    """The quick config end to end: killed mid-write of its second row, resumed by the command
    line (the torn line dropped, every point once, the finished row kept byte for byte), then
    in this process (the same main, without another interpreter importing JAX): resumed again
    (nothing run, summary and figures rebuilt from the rows), and refused onto another config."""
    proc, out = killed_child
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    torn = out.read_bytes()
    before = results.read_rows(out)
    assert len(before) == 1 and not torn.endswith(b"\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def cli(*extra):
        cmd = [sys.executable, *_sweep_cmd(out, *extra)]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)

    done = cli("--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    data = out.read_bytes()
    assert data.startswith(torn[: torn.rindex(b"\n") + 1]) and data.endswith(b"\n")
    rows = results.read_rows(out)
    keys = [r["key"] for r in rows]
    assert sorted(keys) == sorted(p.key for p in sweep.load_config(QUICK).points())
    assert len(set(keys)) == len(keys) == 3 == len(data.splitlines())
    assert rows[0] == before[0]
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert "1 skipped" in done.stdout
    # the table (piped: 80 columns, so headers may wrap: "step" over "ms")
    assert "no-remat" in done.stdout and "save-nothing" in done.stdout and "step" in done.stdout
    summary = out.parent / "summary.md"
    assert (out.parent / "pareto.png").stat().st_size > 0
    assert "| save-nothing |" in summary.read_text()
    # As if killed after its last row, before the summary: a resume runs nothing, rebuilds both.
    summary.unlink()
    (out.parent / "pareto.png").unlink()
    main = _cli().main
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # main would set it for good
    capsys.readouterr()
    assert main(_sweep_cmd(out, "--resume")[1:]) == 0
    again = capsys.readouterr()
    assert "0 point(s) run, 3 skipped" in again.out, again.out + again.err
    assert out.read_bytes() == data
    assert "| save-nothing |" in summary.read_text()
    assert (out.parent / "pareto.png").stat().st_size > 0
    # Another config onto these rows: one line naming the field, exit 2, nothing touched.
    other = tmp_path / "quick.py"
    other.write_text(QUICK.read_text().replace("timed_steps=1", "timed_steps=2"))
    assert main(["--config", str(other), "--out", str(out), "--resume"]) == 2
    refused = capsys.readouterr().err
    assert refused.count("\n") == 1, refused
    assert "grids[0].timed_steps: 1 in the file, 2 now" in refused
    assert out.read_bytes() == data
    assert out.read_bytes() == data


def test_per_tag_policy_on_the_sweep_command_line(tmp_path, capsys, no_compile):
    """--policy takes the command line's one per-tag syntax; a valid spec reaches the compile
    (stopped here by no_compile), a bad one exits 2 before it."""
    cfg = _config_file(tmp_path)
    out = str(tmp_path / "o.jsonl")
    with pytest.raises(SystemExit) as refused:  # refused as the arguments are read
        _cli().main(["--config", str(cfg), "--out", out, "--no-plot", "--policy", "query_prj=sve"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "tag 'query_prj': unknown action 'sve'" in err
    assert err.startswith("sweep.py: error: argument --policy: ") and err.count("\n") == 1
    with pytest.raises(_Compiled):
        _cli().main(
            [
                "--config",
                str(cfg),
                "--out",
                out,
                "--no-plot",
                "--policy",
                "query_proj=offload,out_proj=save",
            ]
        )


def _executables(points, engine):
    """The analysed group's reports and the executables its measured steps run."""
    p0 = points[0]
    program = preset(p0.model, p0.batch_size, p0.seq_len, **p0.changes)
    reports = dict(zip(
        (p.key for p in points),
        analyze_policies(program, [p.policy for p in points], "local", fast_compile=False,
                         engine=engine),
        strict=True,
    ))  # fmt: skip
    specs = {p.key: get_policy_spec(p.policy) for p in points}
    return program, specs, reports


def test_interleaved_steps_are_each_policys_own(tmp_path):
    """Timing the policies' steps interleaved changes nothing they compute: each point's losses
    are bitwise those of its steps run alone, and a failing run fails alone."""
    from trainer.data import load_corpus

    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    corpus = load_corpus(tmp_path / "text.txt")
    points = _tiny(policies=("no-remat", "save-nothing"), timed_steps=2).points()
    cache: dict = {}
    with CompileEngine() as engine:
        program, specs, reports = _executables(points, engine)
        held = measure.run_executables(program, specs, reports, engine)
    compiled = [held[p.key][0] for p in points]

    def timed(executables, interleave):
        makers = [
            functools.partial(measure.PresetRun, p, c, corpus, measure.host_state(p, cache))
            for p, c in zip(points, executables, strict=True)
        ]
        return measure.time_runs(makers, interleave)

    alone, both = timed(compiled, False), timed(compiled, True)
    for a, b in zip(alone, both, strict=True):
        assert a["step_order"] == "alone" and b["step_order"] == "interleaved"
        assert len(b["losses"]) == 3 and b["losses"] == a["losses"]
        assert len(b["step_times_s"]) == 2 and b["step_time_s"] > 0

    def broken(state, batch):
        raise RuntimeError("injected")

    broken.input_shardings = compiled[0].input_shardings
    out = timed([broken, compiled[1]], True)
    assert isinstance(out[0], RuntimeError) and out[1]["losses"] == alone[1]["losses"]


def test_the_step_that_runs_is_the_analysed_program_traced_once(monkeypatch, fresh_compile_cache):
    """On one device the sweep's run step, lowered on its own, is the program its analysis
    compiled (same sha256: the engine compiles it once), so the run takes the analysis's
    executable by its ``program_sha256`` without tracing the step again. An empty compile cache: a
    compile read from the cache has no executable to hand over (the run then compiles it)."""
    points = _tiny(policies=("no-remat", "save-nothing", "minimal")).points()
    with CompileEngine() as engine:
        program, specs, reports = _executables(points, engine)
        lowered = measure.run_executables(  # traced and lowered again
            program, specs, reports, engine, lower=lambda key: measure.trace_step(
                program, specs[key], program.place(remat_kit.get_target("local")))[1].lower()
        )  # fmt: skip
        assert all(reused for _, _, reused in lowered.values())  # the same programs
        monkeypatch.setattr(measure, "trace_step", lambda *a: pytest.fail("traced again"))
        held = measure.run_executables(program, specs, reports, engine)
        for p in points:
            key = reports[p.key].program_sha256
            assert held[p.key][0] is lowered[p.key][0] is engine.executable(key).compiled


def test_local_estimates_say_which_calibration_they_came_from():
    """The local rows' estimates name the device figures they used (on a CPU the cached
    calibration, when and at what load it was timed): a newcomer's estimates came from one
    timed under load and nothing said so. Analysis-only GPU rows are not the local one."""
    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    source = summary.local_estimate_source(rows)
    (first,) = [r for r in rows if r["target"] == "local"][:1]
    assert source == first["report"]["step_time"]["figures"]
    assert source.startswith("local cpu") and "calibrated on this machine" in source
    gpu = [r for r in rows if r["target"] != "local"]
    assert gpu and summary.local_estimate_source(gpu) is None
    assert summary.local_estimate_source([]) is None


def _calibrated(load: float, share: float | None = None, contended: bool = False) -> dict:
    """A local row whose estimate's calibration was timed at ``load`` (and ``share``)."""
    calibration = {"others_share": share, "load_average": load, "contended": contended}
    step_time = {"figures": "local cpu: calibrated on this machine", "calibration": calibration}
    return {"target": "local", "report": {"step_time": step_time}}


def test_steps_timed_on_a_busier_machine_than_the_calibration_are_said_so(monkeypatch, tmp_path):
    """A newcomer's sweep timed at load average 5 against a calibration taken at 1.2 read every
    estimate 68-76% low with nothing said (session 16): the summary now says why. The
    calibration's state is read from the rows' fields, never parsed back from prose."""
    load_note = summary.load_note

    busy = [{"load_average": [5.07, 4.0, 3.0]}, {"load_average": [5.62, 4.0, 3.0]}]
    note = load_note([_calibrated(1.22), *busy])
    assert note.startswith("the steps were timed at load average 5.07-5.62") and "1.22" in note
    # a load the sweep's own steps make is not a busier machine (an idle AMD EPYC VM: load
    # average 1.50 while the sweep's 2 threads kept 1.8 cores busy; calibrated at 0.22)
    own = [{"load_average": [1.5, 2.3, 2.5], "step_cpu_s": 0.405, "step_time_s": 0.223}]
    assert load_note([_calibrated(0.22), *own]) is None
    others = [{"load_average": [4.5, 2.3, 2.5], "step_cpu_s": 0.405, "step_time_s": 0.223}]
    # one timed row, or equal loads: one figure, not a range of one value ("3.61-3.61")
    assert "other work about 2.68 of it" in load_note([_calibrated(0.22), *others])
    assert "at load average 4.50 (" in load_note([_calibrated(0.22), *others])
    assert load_note([_calibrated(1.22), {"load_average": [1.5, 1.0, 1.0]}]) is None  # close
    assert load_note(busy) is None and load_note([_calibrated(1.22), {}]) is None  # not known
    # a calibration file that does not record its load (written before it was a field): the
    # busy steps are still said (a newcomer's 70% errors went unexplained)
    unknown = load_note([_calibrated(None), *busy])
    assert unknown.startswith("the steps were timed at load average 5.07-5.62")
    assert "does not record its load" in unknown
    # the other way round: a calibration timed beside other work (its rates low: estimates high)
    quiet = [{"load_average": [2.8, 2.0, 2.0]}]
    note = load_note([_calibrated(4.54, 0.62, True), *quiet])
    assert note.startswith("the local device was calibrated while other processes used 62%")
    assert "load average" not in note  # the steps were not timed on a busier machine
    # the folder to delete is this machine's cache (a newcomer's $REMAT_KIT_CACHE_DIR was
    # named as ~/.cache/remat-kit in the summary while the console named the right one)
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(tmp_path / "cache"))
    got = load_note([_calibrated(4.54, 0.62, True), *quiet])
    assert f"delete {tmp_path / 'cache' / 'calibration'} and run" in got
    assert load_note([_calibrated(4.54, 0.03, False), *quiet]) is None


def test_rows_from_before_the_calibration_fields_are_read_from_their_source_line():
    """The committed CPU sweep's rows carry the calibration in their figures' text only."""
    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    got = summary.local_calibration(rows)
    source = summary.local_estimate_source(rows)
    assert got is not None and f"load average {got['load_average']:.2f}" in source
    assert got["contended"] is ("; contended" in source)


def test_progress_in_a_log_or_pipe_is_one_plain_line_per_step():
    """A newcomer piping the sweep to a file saw nothing for 7 minutes (rich's bar draws only on
    a terminal): a log now gets one line per stage and per finished point."""
    import io
    import re

    from rich.console import Console

    from remat_kit.sweep.output import progress

    buf = io.StringIO()
    with progress(True, Console(file=buf, width=200), 2) as advance:
        advance(None, "analysing gpt-10m b=4 s=128 (2 policies)")
        advance(1, "gpt-10m b=4 s=128 save-dots")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\[0:00:\d\d 0/2\] analysing gpt-10m b=4 s=128 \(2 policies\)", lines[0])
    assert re.fullmatch(r"\[0:00:\d\d 1/2\] done: gpt-10m b=4 s=128 save-dots", lines[1])
    narrow = io.StringIO()  # COLUMNS=100: a long description is cut, never wrapped
    with progress(True, Console(file=narrow, width=100), 2) as advance:
        advance(None, "analysing " + '{"mlpwi": "offload", "query_proj": "device"} ' * 4)
    (line,) = narrow.getvalue().splitlines()
    assert len(line) == 100 and line.endswith("…")


def test_cpu_config_says_when_its_gpu_analysis_rows_are_left_out(monkeypatch):
    """Without JAX's CUDA plugin the cpu config drops its h100-sxm analysis grids; its
    description (the sweep's first log line) says so instead of listing them as analysed."""
    from remat_kit import targets
    from remat_kit.sweep.config import load_config

    cpu = ROOT / "experiments" / "configs" / "cpu.py"
    monkeypatch.setattr(targets, "cuda_plugin_module", lambda: None)
    left = load_config(cpu)
    assert len(left.grids) == 1 and "left out" in left.description
    assert "remat-kit[cuda12]" in left.description and "analysed for" not in left.description
    monkeypatch.setattr(targets, "cuda_plugin_module", lambda: "jax_plugins.xla_cuda12")
    full = load_config(cpu)
    assert len(full.grids) == 4 and "analysed for h100-sxm" in full.description


def test_small_local_steps_carry_the_same_caveat_as_analyze_and_recommend():
    """A user's small program swept on the CPU: every estimate 49-61% under its step, and the
    sweep alone of the tools said nothing (analyze and recommend print the small-step note)."""
    calibrated = {"step_time": {"measured_figures": True}}
    timed = [{"target": "local", "report": calibrated, "predicted_step_time_s": 0.0027,
              "step_time_s": 0.0066}]  # fmt: skip
    note = summary.small_step_note(timed)
    assert note.startswith("small steps (estimated 2.7 ms and up)")
    assert note.endswith("go by the measured steps beside them")
    analysed = [{**timed[0], "step_time_s": None}]
    assert summary.small_step_note(analysed).endswith("(experiments/sweep.py)")
    # datasheet figures (a GPU model compiled without a GPU) and large steps: no caveat
    datasheet = [{**timed[0], "target": "h100-sxm", "report": {"step_time": {}}}]
    assert summary.small_step_note(datasheet) is None
    assert summary.small_step_note([{**timed[0], "predicted_step_time_s": 0.3}]) is None


@pytest.mark.parametrize("n", range(1, 10))
def test_interleaved_rounds_balance_position_and_predecessor(n):
    """Williams design: every run in every position equally often and after every other run
    equally often (a run that always followed the same executable measured 3-5% faster)."""
    round_order = measure.round_order

    rows = [round_order(n, i) for i in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(r) == list(range(n)) for r in rows)
    positions = collections.Counter((x, p) for r in rows for p, x in enumerate(r))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    pairs = collections.Counter((r[k], r[k + 1]) for r in rows for k in range(n - 1))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
    assert round_order(n, len(rows)) == rows[0]  # cyclic over its rows


def test_no_run_follows_the_same_run_in_every_round():
    """The sweep's default: 13 policies, 5 timed steps. Rotating the order kept each policy
    behind the same one in every round; the design's rounds give each a new predecessor."""
    round_order = measure.round_order

    before = collections.defaultdict(set)
    for i in range(5):
        r = round_order(13, i)
        for a, b in zip(r, r[1:], strict=False):
            before[b].add(a)
    assert all(len(v) >= 4 for v in before.values())
    with pytest.raises(ValueError, match="n >= 1"):
        round_order(0, 0)


def test_a_null_measured_peak_is_said_in_the_summary():
    """The CPU reports no peak: every timed row records null with why, and the summary says so
    (it was in the JSONL alone)."""
    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    note = summary.measured_peak_note(rows)
    assert note.startswith("measured peak: null on every timed row (the cpu backend reports")
    timed = [r for r in rows if r.get("step_time_s") is not None]
    assert summary.measured_peak_note([{**timed[0], "measured_peak_bytes": 5}, *timed]) is None
    assert summary.measured_peak_note([r for r in rows if r.get("step_time_s") is None]) is None


def test_the_terminal_says_the_load_and_why_remat_timed_faster_on_the_cpu(tmp_path):
    """Where the timings are printed: the machine's load while they were timed (it was only in
    summary.md) and why remat policies measured faster than no-remat on the CPU. The committed
    CPU run, its load raised as a busy machine's."""
    import io

    from rich.console import Console

    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    for r in rows:
        if r.get("load_average"):
            r["load_average"] = [9.0, 9.0, 9.0]
    load = summary.load_note(rows)
    fast = summary.cpu_faster_note(rows)
    assert load and "timed at load average 9.00" in load
    assert fast == (
        "remat ran faster than no-remat on the CPU in 24 row(s): XLA:CPU faults in each step's "
        "fresh temp buffer page by page, and no-remat's is 2.0-4.2x theirs (docs/time-model.md)"
    )
    run = sweep.SweepRun(tmp_path / "sweep.jsonl", rows, [], 0, 1.0)
    cli = _cli()
    console = Console(width=100, record=True, file=io.StringIO())
    cli._write_outputs(run, run.path, cli.build_parser().parse_args(["--no-plot"]), [], console)
    printed = " ".join(console.export_text().split())
    assert f"note: {load}" in printed and f"note: {fast}" in printed
    assert f"- Note: {fast}" in (tmp_path / "summary.md").read_text()
    # none where no remat row beat no-remat on the CPU, nor on another backend
    slower = [{**r, "step_time_s": 1.0 if r["policy"] != "no-remat" else 0.5} for r in rows]
    gpu = [{**r, "backend": "gpu"} for r in rows]
    assert summary.cpu_faster_note(slower) is None and summary.cpu_faster_note(gpu) is None


def test_summary_says_where_no_remat_is_estimated_slower_on_a_gpu(tmp_path):
    """summary.md listed the H100 analysis rows with no-remat estimated 23-45% slower than
    save-dots-no-batch and said nothing (newcomer trial); analyze says why under its table.
    Now the summary names each such group and gives the same cause, once."""
    import io

    from rich.console import Console

    rows = results.read_rows(ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    gpu = [r for r in rows if r["target"] == "h100-sxm"]
    times = {(r["model"], r["policy"]): r["predicted_step_time_s"] for r in gpu}
    note = summary.no_remat_slower_note(rows)
    for model in {r["model"] for r in gpu}:
        if times[model, "no-remat"] > times[model, "save-dots-no-batch"]:
            assert f"{model} b=" in note
    assert note.count("the estimate charges a scanned step") == 1
    # none where no-remat is estimated fastest, nor where the group's steps were timed
    faster = [{**r, "predicted_step_time_s": 0.1 if r["policy"] == "no-remat" else 1.0}
              for r in gpu]  # fmt: skip
    timed = [{**r, "step_time_s": 1.0} for r in gpu]
    assert summary.no_remat_slower_note(faster) is None
    assert summary.no_remat_slower_note(timed) is None
    run = sweep.SweepRun(tmp_path / "sweep.jsonl", rows, [], 0, 1.0)
    cli = _cli()
    console = Console(width=100, record=True, file=io.StringIO())
    cli._write_outputs(run, run.path, cli.build_parser().parse_args(["--no-plot"]), [], console)
    assert f"- Note: {note}" in (tmp_path / "summary.md").read_text()
    assert f"note: {note}" in " ".join(console.export_text().split())
