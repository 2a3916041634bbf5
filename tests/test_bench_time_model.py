"""The time-model benchmark's own arithmetic: the split-half reliability of measured steps."""

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_time_model  # noqa: E402


def test_split_half_is_one_when_both_halves_rank_alike():
    # Three policies, steps alternating around 1 s, 2 s, 3 s: odd and even halves agree.
    steps = pd.Series([[1.0, 1.1, 0.9, 1.0], [2.0, 2.2, 2.1, 1.9], [3.0, 3.1, 2.9, 3.2]])
    assert bench_time_model.split_half_spearman(steps) == pytest.approx(1.0)


def test_split_half_is_minus_one_when_the_halves_disagree():
    # Odd steps rank the policies 1 < 2 < 3, even steps the reverse: noise, not signal.
    steps = pd.Series([[1.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], [3.0, 1.0, 3.0, 1.0]])
    assert bench_time_model.split_half_spearman(steps) == pytest.approx(-1.0)


def test_split_half_is_null_with_a_single_timed_step():
    steps = pd.Series([[1.0, 1.1], [2.0], [3.0, 3.1]])
    assert bench_time_model.split_half_spearman(steps) is None


def test_kernel_benchmark_finds_profiler_events_for_the_compiled_kernels():
    """bench_kernels.py reads XLA:CPU's profiler events by HLO instruction name: a jax whose
    events stop naming instructions would leave every kernel unmeasured."""
    import bench_kernels

    result = bench_kernels.one_policy("tiny-gpt", 2, 32, "save-dots", steps=1)
    measured = [k for k in result["kernels"] if k["measured_s"] is not None]
    assert len(measured) >= len(result["kernels"]) // 2, "most kernels found no event"
    assert 0 < result["measured_kernels_s"] and result["step_s"] > 0
    assert all(k["measured_s"] > 0 and k["predicted_s"] >= 0 for k in measured)
    assert all(k["completed_s"] >= k["measured_s"] for k in measured)
    assert "| compute |" in bench_kernels.markdown({
        "model": "tiny-gpt", "batch": 2, "steps": 1, "command": "x", "policies": [result],
        "environment": {"cpu_count": 2, "cpu_model": "cpu", "backend": "cpu", "jax": "0"},
    })  # fmt: skip


def test_ratios_against_the_median_and_the_fastest_step():
    # no-remat's steps: median 4 s, fastest 2 s (one undisturbed step); a remat policy's: 3 s
    # and 3 s. The model predicts 0.75 of no-remat's time: 0% off the medians' ratio (3/4),
    # -50% off the fastest steps' ratio (3/2 = 1.5).
    frame = pd.DataFrame([
        {"model": "m", "target": "local", "batch_size": 1, "seq_len": 8, "policy": "no-remat",
         "step_times_s": [4.0, 2.0, 4.0, 5.0, 4.0], "step_time_s": 4.0,
         "predicted_step_time_s": 4.0},
        {"model": "m", "target": "local", "batch_size": 1, "seq_len": 8, "policy": "save-dots",
         "step_times_s": [3.0, 3.0, 3.0, 3.0, 3.0], "step_time_s": 3.0,
         "predicted_step_time_s": 3.0},
        {"model": "m", "target": "local", "batch_size": 1, "seq_len": 8, "policy": "minimal",
         "step_times_s": [3.5, 3.5, 3.5, 3.5, 3.5], "step_time_s": 3.5,
         "predicted_step_time_s": 3.6},
    ])  # fmt: skip
    (group,) = bench_time_model.compare(frame)
    by = {p["policy"]: p for p in group["policies"]}
    assert by["save-dots"]["error"] == pytest.approx(0.0)
    assert by["save-dots"]["fastest_ratio"] == pytest.approx(1.5)
    assert by["save-dots"]["fastest_error"] == pytest.approx(0.75 / 1.5 - 1)
    # the remat policies' ratios are judged, not no-remat's own 1 (always "within")
    assert group["policies_n"] == 2
    assert group["within_goal"] == 2 and group["fastest"]["within_goal"] == 0
    assert group["fastest"]["max_abs_error"] == pytest.approx(0.5)
    assert "fastest timed step" in bench_time_model.markdown([group])


def test_kernel_spans_run_from_launch_to_completion_marker():
    """A kernel whose work finishes on other threads completes after its launch event: the
    i-th launch pairs with the i-th completion marker; none ends before its launch event."""
    import bench_kernels

    # launches [0, 2) and [10, 11); completions at 7 and 10.5 (the second finished inline,
    # its marker inside the event); a third launch [20, 21) cut off before its marker.
    got = bench_kernels.kernel_spans([(10, 11), (0, 2), (20, 21)], [10.5, 7])
    assert got == [(0, 7), (10, 11), (20, 21)]


def test_kernel_concurrency_from_event_spans():
    """Busy time is the union of the kernels' events, side-by-side time where two overlap."""
    import bench_kernels

    # [0, 10) and [5, 12) overlap on [5, 10); [20, 25) alone; [21, 22) inside it.
    spans = [(0, 10), (5, 12), (20, 25), (21, 22)]
    got = bench_kernels.concurrency(spans)
    assert got["busy_s"] == pytest.approx(17e-9)
    assert got["side_by_side_s"] == pytest.approx(6e-9)
    assert bench_kernels.concurrency([]) == {"busy_s": 0.0, "side_by_side_s": 0.0}
