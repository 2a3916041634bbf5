"""recommend: the fastest configuration that fits a budget, verified by compiling.

Compiled tests use tiny-llama (b=2, s=64) on the H100 target, deviceless, with budgets in bytes,
and share one :class:`CompileCache`: most calls reuse the first call's compiles. Every GPU compile
round costs a cold kernel compile (~8 s here), so the tests are ordered to reuse each other's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from remat_kit import targets
from remat_kit.cli import recommend as cli_recommend
from remat_kit.cli.recommend import add as add_parser
from remat_kit.cli.recommend import run
from remat_kit.memory.calibration import figures_for
from remat_kit.policies import custom_spec, parse_policy_arg
from remat_kit.recommend import (
    BatchBracket,
    BudgetTooSmall,
    Candidate,
    CompileCache,
    Recommendation,
    choice_time,
    host_link_source,
    parse_budget,
    recommend,
)
from remat_kit.units import format_bytes
from tests.conftest import needs_cuda_plugin

MODEL, SEQ, BATCH, TARGET = "tiny-llama", 64, 2, "h100-sxm"
POLICIES = [
    "no-remat",
    "save-nothing",
    "save-qkv-proj",
    "save-dots-no-batch",
    "offload-layer-inputs",
]


def _mid_budget(rec: Recommendation) -> int:
    """A budget between the least and most memory of the named candidates."""
    peaks = sorted(c.peak_bytes for c in rec.candidates if c.found_by == "named")
    return (peaks[0] + peaks[-1]) // 2


@pytest.fixture(scope="module")
def cache() -> CompileCache:
    return CompileCache()


@pytest.fixture(scope="module")
def first(cache) -> Recommendation:
    """Every named policy of POLICIES compiled once (group size 1), budget 1 GB."""
    return recommend(
        MODEL, SEQ, TARGET, batch_size=BATCH, budget=10**9, policies=POLICIES,
        group_sizes=[1], cache=cache,
    )  # fmt: skip


# -- No compiles ----------------------------------------------------------------------------


def test_solver_times_choices_on_the_roofline_scale():
    h100 = targets.get_target("h100-sxm")
    anchor = Candidate(
        policy="save-nothing", actions=None, remat_group_size=1, batch_size=1, seq_len=8,
        peak_bytes=1, host_bytes=0, flops=1.5e15, flops_no_remat=1.0e15, compute_s=1.5,
        transfer_s=0.0, step_time_s=1.5, tokens_per_s=None, fits=True, found_by="named",
        recompute_s=0.5,
    )  # fmt: skip
    # keeping every recomputed FLOP takes the roofline's recompute seconds off; half, half
    assert choice_time(anchor, None, 1.0, 0) == pytest.approx((1.0, 0.0))
    assert choice_time(anchor, None, 0.5, 0) == pytest.approx((1.25, 0.0))
    assert choice_time(anchor, None, 0.0, 0) == pytest.approx((1.5, 0.0))
    # without the roofline's recompute seconds: the anchor's share of recomputed FLOPs (1/3)
    blind = dataclasses.replace(anchor, recompute_s=None)
    assert choice_time(blind, None, 1.0, 0) == pytest.approx((1.0, 0.0))
    # 64 GB offloaded: 1 s each way at 64 GB/s; the forward (a third of the 1 s step without
    # recomputation) hides a third of the device->host copy, the backward the rest of the step
    compute, transfer = choice_time(anchor, 64e9, 1.0, 64 * 10**9)
    assert compute == pytest.approx(1.0) and transfer == pytest.approx(1.0)
    # Small transfers hide completely.
    assert choice_time(anchor, 64e9, 1.0, 10**9)[1] == 0.0
    assert "PCIe Gen5 x16" in host_link_source(h100)
    assert "PCIe Gen4 x16" in host_link_source(targets.get_target("a100-80gb"))
    unknown = dataclasses.replace(h100, name="mystery", peak_flops_bf16=None)
    with pytest.raises(ValueError, match="no peak FLOP/s"):
        figures_for(unknown)


def test_parse_budget():
    assert parse_budget("76GiB") == 76 * 2**30
    assert parse_budget("80GB") == 80 * 10**9
    assert parse_budget("8e10") == 8 * 10**10
    assert parse_budget(123) == 123 and parse_budget(8e10) == 8 * 10**10
    for bad in ("lots", "-1GB", 0, -5, True):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_batch_bracket_converges_on_an_affine_peak():
    """The batch search finds the exact largest batch, with few probes, for peak = a + b*x."""

    class C:  # stands in for a compiled candidate
        def __init__(self, b, budget):
            self.batch_size, self.peak_bytes = b, 1000 + 300 * b
            self.fits = self.peak_bytes <= budget

    for budget in (1300, 1350, 2000, 4000, 31_000):
        br = BatchBracket(spec=None, lo=C(1, budget), hi=None, points={1: 1300})  # type: ignore[arg-type]
        while (b := br.next_probe(budget, fixed=900)) is not None:
            br.record(C(b, budget), b)
        want = (budget - 1000) // 300
        assert br.lo.batch_size == want, (budget, br.points)
        assert br.hi == want + 1 and br.probes <= 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policies=["save-everything"]), "unknown policy"),
        (dict(seq_len=10**6), "exceeds max_seq_len"),
        (dict(target="cpu"), "has unknown memory: give a budget"),
        (dict(group_sizes=[3]), "does not divide num_layers"),
        (dict(batch_size="auto", solve=True), "solve needs a fixed batch"),
        (dict(batch_size=0), "positive integer or 'auto'"),
        (dict(budget="80 parsecs"), "cannot read"),
        (dict(margin=1.5), "margin"),
        (dict(target="h100"), "Did you mean 'h100-sxm'"),
    ],
)
def test_bad_input_raises_one_line(kwargs, message):
    args = dict(seq_len=SEQ, target=TARGET, batch_size=BATCH) | kwargs
    with pytest.raises(ValueError, match=message) as err:
        recommend(MODEL, **args)
    assert "\n" not in str(err.value)


def test_cli_parser_and_bad_input():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["recommend", "--model", MODEL, "--seq", "64", "--batch", "auto", "--budget", "76GiB"]
    )
    assert args.batch == "auto" and args.budget == 76 * 2**30 and args.func is run
    assert (
        parser.parse_args(["recommend", "--model", MODEL, "--seq", "8"]).batch is None
    )  # 1 in run
    args = parser.parse_args(
        ["recommend", "--model", MODEL, "--seq", "8", "--policy", "query_proj=offload"]
    )
    assert args.policy == [custom_spec({"query_proj": "offload"})]
    args = parser.parse_args(["recommend", "--model", MODEL, "--seq", "64", "--target", "cpu"])
    with pytest.raises(ValueError, match="has unknown memory: give a budget"):
        run(args)


def test_cli_exit_codes_as_documented(monkeypatch, capsys):
    """docs/recommend.md: 0 a pick, 1 nothing fits (a budget below the parameters and optimizer
    state included), 2 bad input (raised as ValueError; cli.main turns it into exit 2)."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["recommend", "--model", MODEL, "--seq", "64", "--budget", "1KiB", "--json"]
    )

    def too_small(*a, **k):
        raise BudgetTooSmall(f"budget {format_bytes(args.budget)} is smaller than ...")

    monkeypatch.setattr(cli_recommend, "recommend_program", too_small)
    assert run(args) == 1
    assert "nothing fits: budget 1.00 KiB is smaller" in capsys.readouterr().err
    for pick, code in ((None, 1), (object(), 0)):
        rec = argparse.Namespace(pick=pick, to_json=lambda indent: "{}")
        monkeypatch.setattr(cli_recommend, "recommend_program", lambda *a, rec=rec, **k: rec)
        assert run(args) == code


# -- Compiled -------------------------------------------------------------------------------


@needs_cuda_plugin
def test_pick_fits_and_is_the_fastest_fit(first, cache):
    budget = _mid_budget(first)
    rec = recommend(
        MODEL, SEQ, TARGET, batch_size=BATCH, budget=budget, policies=POLICIES,
        group_sizes=[1], cache=cache,
    )  # fmt: skip
    assert rec.compiles == 0 and rec.reused == len(POLICIES)  # all from the cache
    assert 1 <= first.compiles <= len(POLICIES)  # identical programs compiled once
    pick = rec.pick
    assert pick is not None and pick.fits and pick.peak_bytes <= budget
    assert_pick_rule(rec)
    assert any(not c.fits for c in rec.candidates)  # the budget does exclude something
    assert pick.step_time_s == pytest.approx(pick.compute_s + pick.transfer_s)
    assert pick.tokens_per_s == pytest.approx(BATCH * SEQ / pick.step_time_s)
    assert rec.line().startswith("nn.remat(Block, policy=remat_kit.policy(")
    assert f"batch {BATCH}" in rec.line()
    data = json.loads(rec.to_json())
    assert data["pick"]["peak_bytes"] == pick.peak_bytes and data["compiles"] == 0
    # With no budget, the target's memory less the margin: everything fits, the fastest wins.
    free = recommend(
        MODEL, SEQ, TARGET, batch_size=BATCH, policies=POLICIES, group_sizes=[1], cache=cache
    )
    memory = targets.get_target(TARGET).memory_bytes
    assert free.budget_bytes == int(memory * 0.95)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in free.budget_note
    assert_pick_rule(free)


def assert_pick_rule(rec):
    """The pick fits, is estimated within the time model's error of the fastest fitting
    candidate, and recomputes least among those (``fastest_fitting`` on a datasheet target)."""
    from remat_kit.memory.roofline import estimate_error
    from remat_kit.recommend.session import pointless_offloads, recomputes_less

    skip = pointless_offloads(rec.candidates)  # an offload an on-device peer matches
    fitting = [c for c in rec.candidates if c.fits and not any(c is s for s in skip)]
    fastest = min(c.step_time_s for c in fitting)
    near = [
        c for c in fitting
        if c.step_time_s <= fastest * (1 + estimate_error(targets.get_target(rec.target)))
    ]  # fmt: skip
    least = [c for c in near if not any(recomputes_less(d, c) for d in near)]
    assert rec.pick in least and rec.pick.step_time_s == min(c.step_time_s for c in least)


@needs_cuda_plugin
def test_each_budget_picks_by_the_rule_and_fits(first, cache):
    """From the loosest budget to the tightest, every pick fits and follows the rule (a
    tighter budget may give a faster pick: the one that recomputed less no longer fits)."""
    peaks = sorted({c.peak_bytes for c in first.candidates})
    budgets = sorted({*peaks, *(p - 1 for p in peaks[1:]), _mid_budget(first)}, reverse=True)
    times = []
    for budget in budgets:
        rec = recommend(
            MODEL, SEQ, TARGET, batch_size=BATCH, budget=budget, policies=POLICIES,
            group_sizes=[1], cache=cache,
        )  # fmt: skip
        assert rec.compiles == 0  # budgets only change the choice, not what is compiled
        for c in rec.candidates:
            assert c.fits == (c.peak_bytes <= budget)
        if rec.pick is None:
            times.append(math.inf)
            continue
        assert rec.pick.peak_bytes <= budget
        assert_pick_rule(rec)
        times.append(rec.pick.step_time_s)
    assert times[0] < math.inf  # the loosest budget fits something


@needs_cuda_plugin
def test_group_sizes_compiled_only_where_the_bound_allows(first, cache):
    sn = next(c for c in first.candidates if c.policy == "save-nothing")
    kwargs = dict(batch_size=BATCH, policies=["save-nothing"], group_sizes=[1, 2], cache=cache)
    # Fits at group size 1: a larger group only adds recomputation, nothing else is compiled.
    rec = recommend(MODEL, SEQ, TARGET, budget=sn.peak_bytes, **kwargs)
    assert rec.compiles == 0 and rec.pick.remat_group_size == 1
    # One byte short: two blocks per segment keep half the segment inputs, so it might fit.
    rec = recommend(MODEL, SEQ, TARGET, budget=sn.peak_bytes - 1, **kwargs)
    grouped = [c for c in rec.candidates if c.found_by == "group-size"]
    assert [c.remat_group_size for c in grouped] == [2]
    assert grouped[0].fits == (grouped[0].peak_bytes <= sn.peak_bytes - 1)
    assert rec.pick is None or (rec.pick is grouped[0] and rec.pick.fits)


@needs_cuda_plugin
def test_budget_below_parameters_and_optimizer_state(first, cache):
    params, opt_state = first.arguments["params"], first.arguments["opt_state"]
    with pytest.raises(ValueError) as err:
        recommend(MODEL, SEQ, TARGET, batch_size=BATCH, budget=params, policies=POLICIES,
                  cache=cache)  # fmt: skip
    msg = str(err.value)
    assert "smaller than the parameters and optimizer state alone" in msg and "\n" not in msg
    least, name = min(
        (c.peak_bytes, c.policy)
        for c in first.candidates
        if c.policy in ("save-nothing", "offload-layer-inputs")  # the usual least-memory ones
    )
    assert f"no policy fits it; {name} at batch {BATCH} peaks at {format_bytes(least)}" in msg
    assert f"({format_bytes(params + opt_state)}: params" in msg
    assert isinstance(err.value, BudgetTooSmall)  # the CLI exits 1 for it: nothing fits


@needs_cuda_plugin
def test_nothing_fits_says_what_would(first, cache):
    least = min(c.peak_bytes for c in first.candidates)
    fixed = first.arguments["params"] + first.arguments["opt_state"]
    budget = least - (least - fixed) // 8  # above the arguments, just under every policy
    rec = recommend(
        MODEL, SEQ, TARGET, batch_size=BATCH, budget=budget, policies=POLICIES,
        group_sizes=[1], cache=cache,
    )  # fmt: skip
    assert rec.pick is None and rec.line().startswith("nothing fits")
    text = " ".join(rec.advice)
    for what in ("least-memory", "smaller batch", "shorter sequence", "more devices"):
        assert what in text, rec.advice
    advised = [c for c in rec.candidates if c.found_by in ("advice", "batch-search")]
    assert advised and all(c.fits == (c.peak_bytes <= budget) for c in advised)
    assert any(c.seq_len < SEQ for c in advised)  # a shorter sequence was compiled


@needs_cuda_plugin
def test_batch_auto_finds_the_largest_batch(first, cache):
    at2 = next(c for c in first.candidates if c.policy == "save-nothing")
    budget = at2.peak_bytes + 1
    rec = recommend(
        MODEL, SEQ, TARGET, batch_size="auto", budget=budget, policies=["save-nothing"],
        cache=cache,
    )  # fmt: skip
    assert rec.batch_size is None and len(rec.largest_batch) == 1
    best = rec.largest_batch[0]
    assert best is rec.pick and best.fits and best.batch_size == 2
    # Shown not to fit one sequence more.
    over = [c for c in rec.candidates if c.batch_size == 3 and c.policy == "save-nothing"]
    assert over and not over[0].fits
    assert best.tokens_per_s == pytest.approx(2 * SEQ / best.step_time_s)


@needs_cuda_plugin
def test_solve_returns_only_verified_choices(first, cache):
    budget = _mid_budget(first)
    rec = recommend(
        MODEL, SEQ, TARGET, batch_size=BATCH, budget=budget, policies=POLICIES,
        group_sizes=[1], solve=True, cache=cache,
    )  # fmt: skip
    s = rec.solve
    assert s is not None and len(s.verified) <= 2 * 3
    if not s.verified:  # the roofline put every choice behind the pick: said, not silent
        assert any("no per-tag choice is predicted to beat" in n for n in rec.notes), rec.notes
    sizes = [1 + (t.flops_saved > 0) + (t.flops_saved > 0 or t.base_bytes > 0) for t in s.tags]
    assert s.combinations == math.prod(sizes) and s.predicted_fit <= s.combinations
    for c in s.verified:  # compiled: a real peak, judged against the budget
        assert c.found_by == "solve" and c.peak_bytes > 0 and c.fits == (c.peak_bytes <= budget)
        assert c.predicted_peak_bytes is not None and c.actions is not None
    assert rec.pick is not None and rec.pick.fits
    named_best = min(c.step_time_s for c in rec.candidates if c.fits and c.found_by == "named")
    assert rec.pick.step_time_s <= named_best
    if rec.pick.actions is not None:
        assert "remat_kit.custom_policy({" in rec.line()
    assert rec.compiles <= len(s.verified) + 1


@needs_cuda_plugin
def test_a_per_tag_policy_is_a_candidate(first, cache):
    """A per-tag spec equal to save-qkv-proj compiles to the same program (reused, no compile)
    and comes back as a custom candidate with its actions."""
    spec = parse_policy_arg("query_proj=save,key_proj=save,value_proj=save")
    rec = recommend(
        MODEL, SEQ, TARGET, batch_size=BATCH, budget=10**9, policies=[spec], group_sizes=[1],
        cache=cache,
    )  # fmt: skip
    assert rec.compiles == 0 and rec.reused == 1
    (c,) = rec.candidates
    named = next(x for x in first.candidates if x.policy == "save-qkv-proj")
    assert c.policy == "custom" and c.actions == {t: "save" for t in spec.save}
    assert c.peak_bytes == named.peak_bytes and c.step_time_s == named.step_time_s
    assert rec.pick is c and "remat_kit.custom_policy({" in rec.line()
    # the comment names the target and the budget the pick is for
    assert rec.line().endswith(
        f"; {TARGET}: peak {format_bytes(c.peak_bytes)} of the 953.67 MiB budget"
    )


def test_recommend_on_the_local_device_ranks_by_its_calibrated_estimate():
    """The local CPU has no datasheet: recommend times it with the calibration (fixed for the
    tests by tests/cpu_figures.json) instead of refusing it."""
    rec = recommend(
        "tiny-gpt", seq_len=32, target="local", batch_size=1, budget="1GiB",
        policies=["no-remat", "save-nothing"], group_sizes=[1], structure=False,
    )  # fmt: skip
    assert rec.pick is not None and len(rec.candidates) == 2
    assert all(0 < c.step_time_s < math.inf for c in rec.candidates)
    assert rec.pick.step_time_s == min(c.step_time_s for c in rec.candidates)
    assert any("calibrated on this machine" in n for n in rec.notes), rec.notes
    # tiny-gpt's steps are estimated at well under SMALL_STEP_S: said, with the smallest one
    (small,) = [n for n in rec.notes if n.startswith("small steps")]
    assert f"{min(c.step_time_s for c in rec.candidates) * 1e3:.3g} ms" in small


def test_recommend_says_what_analyze_warns_of_its_pick():
    """An unrolled model under one remat segment on the CPU frees little: analyze warns under
    the policy's row and the doctor finds it; recommend's notes say it of the pick too, with
    the cause the installed XLA:CPU gives (jax 0.10.2's undoes remat outside a scan; jax
    0.12's keeps it, and the one segment is recomputed in one piece)."""
    from remat_kit.memory.undone import cpu_undoes_remat_outside_scan
    from remat_kit.models import get_config

    layers = get_config("tiny-gpt").num_layers
    config = get_config("tiny-gpt", scan_layers=False, remat_group_size=layers)
    rec = recommend(
        config, seq_len=64, target="cpu", batch_size=2, budget=7_700_000,
        policies=["no-remat", "save-nothing"], group_sizes=[layers], structure=False,
    )  # fmt: skip
    assert rec.pick is not None and rec.pick.policy != "no-remat" and rec.pick.warnings
    said = [n for n in rec.notes if n.startswith(f"{rec.pick.label}: ")]
    cause = "outside any scan" if cpu_undoes_remat_outside_scan("cpu") else "single remat segment"
    assert said and cause in said[0], rec.notes
