"""Option grids (experiments/configs/options.py): one row per option value, the options figure
and table from rows (null step times included), and a tiny option sweep end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from measured import summary

from remat_kit import plots, sweep
from remat_kit.models import get_config
from remat_kit.sweep import Grid, SweepConfig, results

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ROOT / "experiments" / "configs" / "options.py"
COMMITTED = ROOT / "experiments" / "results" / "options" / "sweep.jsonl"


def test_option_config_points_are_distinct_per_option_value():
    config = sweep.load_config(OPTIONS)
    points = config.points()
    keys = [p.key for p in points]
    assert len(set(keys)) == len(keys)
    by_grid = {}
    for p in points:
        by_grid.setdefault(p.grid, []).append(p)
    layers = {g: dict(ps[0].overrides).get("remat_layers") for g, ps in by_grid.items()}
    assert layers["measured:remat_layers=0"] == 0 and layers["measured:remat_layers=6"] == 6
    assert dict(by_grid["measured:loss_chunk_size=64"][0].overrides)["loss_chunk_size"] == 64
    # Same model, shape and policy, only the overrides differ: distinct keys and groups.
    same = [p for p in points if p.grid.startswith("measured:") and p.policy == "save-nothing"]
    assert len({p.key for p in same}) == len({p.group for p in same}) == len(same) == 7
    assert {get_config(p.model, **p.changes).remat_layers for p in same} == {None, 0, 2, 4, 6}


def test_committed_option_rows_record_their_options():
    rows = results.read_rows(COMMITTED)
    assert len({r["key"] for r in rows}) == len(rows)
    config_grids = {g["name"]: g for g in rows[0]["sweep_config"]["grids"]}
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["overrides"] == config_grids[r["grid"]]["overrides"]
        for field, value in r["overrides"].items():
            assert r["model_fields"][field] == value


def _row(option: dict, policy: str, peak, **extra) -> dict:
    return {
        "model": "m", "target": "h100-sxm", "batch_size": 1, "seq_len": 8,
        "remat_group_size": 1, "mesh": None, "status": "ok", "policy": policy,
        "overrides": {"scan_layers": True, **option}, "peak_bytes": peak,
        "model_fields": {"attention": option.get("attention", "xla")},
        "recompute_ratio": 1.0, "flops_no_remat": 100.0, "step_time_s": None,
        "step_cpu_s": None, **extra,
    }  # fmt: skip


def test_option_figure_and_table_keep_missing_figures_null(tmp_path):
    rows = [
        _row({}, "no-remat", 1000),
        _row({}, "save-nothing", 400, recompute_ratio=1.25),
        _row({"remat_layers": 1}, "save-nothing", 700, recompute_ratio=1.125),
        _row({"attention": "cudnn"}, "save-nothing", 300, flops_no_remat=80.0, recompute_ratio=1.2),
        _row({"loss_chunk_size": 4}, "no-remat", None, status="oom", recompute_ratio=None),
        {**_row({}, "no-remat", 500), "target": "local", "step_time_s": 0.5},  # no option set
    ]
    recs = results.option_records(rows)
    assert [r["option"] for r in recs] == [
        "plain", "plain", "remat_layers=1", "attention=cudnn", "loss_chunk_size=4",
    ]  # fmt: skip
    assert all(r["step_time_s"] is None for r in recs)  # analysis only: null, never 0
    assert recs[3]["flops_ratio"] == pytest.approx(1.2 * 80 / 100)  # on the XLA baseline
    assert recs[4]["peak_bytes"] is None and recs[4]["flops_ratio"] is None
    fig = plots.option_effects(rows, path=tmp_path / "options.png")
    assert (tmp_path / "options.png").stat().st_size > 0
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count(" n/a") == 4 and " oom" in texts
    table = results.option_markdown(rows)
    assert "| remat_layers=1 | save-nothing | 0.00 | -30% | - | 1.125 | - | - |" in table
    assert "no-remat (oom) | - | - | - | - | - | - |" in table
    with pytest.raises(ValueError, match="no option set"):
        plots.option_effects(rows[-1:])


def test_tiny_option_sweep_end_to_end(tmp_path):
    shape = dict(models=("tiny-gpt",), batch_sizes=(2,), seq_lens=(32,), measure=False)
    base = {"scan_layers": True}
    config = SweepConfig(
        "tiny-options",
        grids=(
            Grid("plain", policies=("no-remat", "save-nothing"), overrides=base, **shape),
            Grid("remat_layers=1", policies=("save-nothing",),
                 overrides={**base, "remat_layers": 1}, **shape),
        ),
    )  # fmt: skip
    out = tmp_path / "sweep.jsonl"
    run = sweep.run_sweep(config, out, progress=False)
    assert [r["status"] for r in run.rows] == ["ok"] * 3, [r["error"] for r in run.rows]
    recs = {(r["option"], r["policy"]): r for r in results.option_records(run.rows)}
    half, full = recs[("remat_layers=1", "save-nothing")], recs[("plain", "save-nothing")]
    plain = recs[("plain", "no-remat")]
    assert 1.0 < half["flops_ratio"] < full["flops_ratio"]  # one of two layers recomputed
    assert full["peak_bytes"] <= half["peak_bytes"] <= plain["peak_bytes"]
    assert half["step_time_s"] is None
    assert "options.png" in [p.name for p in plots.save_figures(run.rows, tmp_path)]
    titles = [t for t, _, _ in summary.summary_lines(run.rows)]
    assert len(titles) == 2 and any('"remat_layers":1' in t for t in titles)
    again = sweep.run_sweep(config, out, resume=True, progress=False)
    assert again.new_rows == [] and again.skipped == 3
    json.dumps(run.rows)
