"""experiments/gpu_check.py: the CPU mode end to end (same code path as on a GPU), the budget,
timeouts and error rows, so the script cannot rot between the times an H200 is available."""

import json
import sys
from pathlib import Path

import jax
import pytest

from remat_kit import policies as RP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import gpu_check  # noqa: E402
import gpu_check_report  # noqa: E402
import gpu_check_worker  # noqa: E402


def _rows(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "gpu_check.jsonl").read_text().splitlines())}


#: The default suite's CPU run: every kind of point, one ``measure`` (no-remat: the time table's
#: baseline, so its row has every column); the full CPU mode measures both policies (slow).
QUICK = {**gpu_check.MODES["cpu"], "measure": ["no-remat"]}


def test_cpu_mode_runs_every_point(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.MODES, "cpu", QUICK)
    rows = _check_cpu_run(tmp_path)
    assert "measure/save-nothing" not in rows  # predicted, recommended, not measured


@pytest.mark.slow
def test_full_cpu_mode_runs_every_point(tmp_path):
    _check_cpu_run(tmp_path)


def _check_cpu_run(tmp_path):
    """``--cpu`` end to end under ``MODES["cpu"]``: every point ok, and the summary's tables."""
    mode = gpu_check.MODES["cpu"]
    measured = mode.get("measure", mode["policies"])
    assert gpu_check.main(["--cpu", "--out", str(tmp_path), "--budget-s", "900"]) == 0
    rows = _rows(tmp_path)
    expected = {"versions", "preflight", "predict/h200", "recommend/h200", "grads"}
    expected |= {f"measure/{p}" for p in measured}
    assert expected <= set(rows)
    assert {rows[k]["status"] for k in expected} == {"ok"}, {k: rows[k] for k in expected}
    for policy in measured:
        m = rows[f"measure/{policy}"]
        assert m["step_time_s"] > 0 and len(m["step_times_s"]) == 2
        assert all(x > 0 for x in m["losses"])
        # What a CPU cannot give is None with a note, never 0.
        assert (
            m["measured_peak_bytes"] is None and "no peak_bytes_in_use" in m["measured_peak_note"]
        )
        assert m["mfu"] is None and m["mfu_note"]
        assert m["predicted_local"]["peak_bytes"] > 0 and m["compiled_peak_bytes"] > 0
        # the roofline's estimate recorded beside the measured step
        assert m["predicted_local"]["step_time_s"] > 0
        assert m["predicted_local"]["step_time"]["figures"]
    preds = rows["predict/h200"]["predictions"]
    assert all(p["step_time_s"] > 0 for p in preds.values())
    assert preds["no-remat"]["peak_bytes"] > preds["save-nothing"]["peak_bytes"] > 0
    rec = rows["recommend/h200"]
    # The budget excludes no-remat (largest predicted peak), so the pick is the other policy.
    assert (
        preds["save-nothing"]["peak_bytes"] < rec["budget_bytes"] < preds["no-remat"]["peak_bytes"]
    )
    assert rec["pick"] == "save-nothing"
    custom = gpu_check_report.label(gpu_check.CUSTOM)
    assert rows["grads"]["policies"][custom]["equal"] is True
    # Every row says which remat implementation and JAX it ran under (issue 31): the same
    # gradients under jax_remat3, and what the offloading custom spec runs as there.
    assert (rows["grads"]["remat_impl"], rows["grads"]["jax_version"]) == (
        "classic",
        jax.__version__,
    )
    again = rows["grads/remat3"]
    assert again["status"] == "ok" and again["remat_impl"] == "remat3"
    assert again["policies"][custom]["equal"] is True
    assert rows["grads"]["policies"][custom]["runs_as"] is None  # as named under classic
    under_remat3 = RP.policy_effect(gpu_check.CUSTOM, "remat3")
    assert again["policies"][custom]["runs_as"] == (
        None if under_remat3.as_named else under_remat3.runs_as
    )
    assert all(rows[k]["remat_impl"] == "classic" for k in expected - {"versions"})
    summary = (tmp_path / "summary.md").read_text()
    assert f"| {measured[0]} |" in summary and "pick **save-nothing**" in summary
    assert "- none" in summary  # no point failed
    assert "## Estimated vs measured step time" in summary
    section = summary.split("## Estimated vs measured step time")[1].split("Goals")[0]
    (row,) = [line for line in section.splitlines() if line.startswith(f"| {measured[0]} | ")]
    assert "| - |" not in row  # measured, local and h200 estimates, and their errors
    return rows


def test_budget_is_kept_points_skipped_not_started(tmp_path):
    gpu_check.main(["--cpu", "--out", str(tmp_path), "--budget-s", "1"])
    rows = _rows(tmp_path)
    points = [r for r in rows.values() if r["kind"] != "versions"]
    assert len(points) >= 6
    assert {r["status"] for r in points} == {"skipped"}
    assert all("left of the budget" in r["error"] for r in points)


def test_timeout_is_a_row(tmp_path):
    mode = {**gpu_check.MODES["cpu"], "timeout_s": {"preflight": 0.2}}
    runner = gpu_check.Runner(gpu_check.Results(tmp_path, mode, False), mode, 60.0, cpu=True)
    row = runner.run("preflight", "preflight", {})
    assert row["status"] == "timeout" and "killed after" in row["error"]
    assert _rows(tmp_path)["preflight"]["status"] == "timeout"


def test_worker_error_is_a_result_not_a_crash():
    result = gpu_check_worker.run("predict", {"model": "no-such-model", "seq_len": 8,
                                              "batch_size": 1, "target": "h200", "policies": []})  # fmt: skip
    assert result["status"] == "error" and "no-such-model" in result["error"]
    assert gpu_check_worker.classify("XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory") == "oom"


def test_version_warnings_and_budget_choice():
    found = {**gpu_check.TESTED, "jax": "0.11.2", "flax": "0.12.8"}
    assert gpu_check.version_warnings(found) == [
        "jax 0.11.2 was not tested (tested: 0.10.2); results may differ"
    ]
    pred = {"status": "ok", "predictions": {"a": {"peak_bytes": 100}, "b": {"peak_bytes": 20}}}
    assert gpu_check_report.choice_budget(pred, ["a", "b"]) == 60
    assert gpu_check_report.choice_budget({"status": "error"}, ["a", "b"]) is None


def test_bad_budget_exits_2(tmp_path, capsys):
    assert gpu_check.main(["--cpu", "--out", str(tmp_path), "--budget-s", "0"]) == 2
    assert "--budget-s must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [b"x\xffy", "text", None])
def test_text_of_captured_streams(stream):
    assert isinstance(gpu_check._text(stream), str)
