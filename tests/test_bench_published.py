"""The published-measurement benchmark's data and check (no compiles): every entry names a
cited source and a policy remat-kit parses, its model matches the parameter count the source
prints, and the check fails an entry whose estimate or overhead is off or out of order."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_published as B  # noqa: E402

from remat_kit.policies import parse_policy_arg  # noqa: E402


@pytest.mark.parametrize("entry", B.ENTRIES, ids=lambda e: e.id)
def test_each_entry_cites_a_source_and_names_a_policy(entry):
    assert entry.source in B.SOURCES
    for s in entry.settings:
        parse_policy_arg(s.policy)  # raises on a policy remat-kit does not know
        assert B.published_seconds(entry, s) > 0
    if entry.published_params is not None:
        assert B.param_count(entry) == entry.published_params


def _estimates(entry, seconds):
    return {s.name: {"estimate_s": seconds(s), "compiles": []} for s in entry.settings}


def test_check_passes_the_published_figures_and_fails_a_wrong_order():
    (entry,) = [e for e in B.ENTRIES if e.pairs and len(e.settings) > 2]
    exact = B.evaluate(entry, _estimates(entry, lambda s: B.published_seconds(entry, s)))
    assert exact["pass"] and all(r["ratio"] == pytest.approx(1.0) for r in exact["rows"])
    # the same times in reverse order: within the ratio bounds or not, order and overheads fail
    ranked = sorted(entry.settings, key=lambda s: B.published_seconds(entry, s))
    swapped = dict(zip([s.name for s in ranked], [s.name for s in reversed(ranked)], strict=True))
    wrong = B.evaluate(
        entry,
        _estimates(entry, lambda s: B.published_seconds(entry, entry.setting(swapped[s.name]))),
    )
    assert not wrong["pass"]
    assert any(p.startswith("order:") for p in wrong["problems"])
    assert any(p.startswith("overhead") for p in wrong["problems"])
    off = B.evaluate(entry, _estimates(entry, lambda s: 2 * B.published_seconds(entry, s)))
    assert not off["pass"] and all(not r["ok"] for r in off["rows"])  # 2x: outside 0.7-1.4
