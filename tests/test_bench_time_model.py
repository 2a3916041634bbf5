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
    assert "| compute |" in bench_kernels.markdown({
        "model": "tiny-gpt", "batch": 2, "steps": 1, "command": "x", "policies": [result],
        "environment": {"cpu_count": 2, "cpu_model": "cpu", "backend": "cpu", "jax": "0"},
    })  # fmt: skip
