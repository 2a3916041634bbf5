"""recommend's structure search: cuDNN attention / chunked loss / nested remat when nothing
fits, partial-layer remat when a full-remat policy fits with room (issue 17).

tiny-llama in bfloat16 (so cuDNN flash attention qualifies) at b=2, s=64 on h100-sxm,
deviceless; one shared :class:`CompileCache` (about 9 compiles in all); nested remat on
tiny-llama in float32 (no cuDNN: 3 compiles).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from remat_kit import targets as T
from remat_kit.cli.recommend import print_recommendation
from remat_kit.models import get_config
from remat_kit.recommend import CompileCache, Recommendation, partial_probes, recommend
from remat_kit.recommend.search import loss_chunk, structural_options, structure_of
from remat_kit.recommend.session import Candidate, CompileCounter, Session
from remat_kit.units import format_bytes
from remat_kit.walker import traced_flops
from remat_kit.zoo import model_residuals, preset
from tests.conftest import needs_cuda_plugin

CONFIG = get_config("tiny-llama", dtype="bfloat16", param_dtype="bfloat16")
SEQ, BATCH, TARGET = 64, 2, "h100-sxm"
KW = dict(batch_size=BATCH, policies=["no-remat", "save-nothing"], group_sizes=[1], structure=True)


@pytest.fixture(scope="module")
def cache() -> CompileCache:
    return CompileCache()


@pytest.fixture(scope="module")
def first_and_reports(cache) -> tuple[Recommendation, dict]:
    """The named policies compiled (everything fits), and the cache's reports just then."""
    rec = recommend(CONFIG, SEQ, TARGET, budget=10**9, cache=cache, **KW)
    return rec, dict(cache.reports)


@pytest.fixture(scope="module")
def first(first_and_reports) -> Recommendation:
    return first_and_reports[0]


def _options(config) -> list[str]:
    """The structural options' labels on the deviceless h100-sxm (nothing compiled)."""
    session = Session(
        program=preset(config, BATCH, SEQ), target=T.get_target(TARGET), budget=1,
        cache=CompileCache(), counter=CompileCounter(), workers=1, max_compiles=0, fixed_bytes=0,
        opt_state_bytes=0,
    )  # fmt: skip
    return [label for label, _ in structural_options(session)]


def _named(rec: Recommendation, policy: str) -> Candidate:
    return next(c for c in rec.candidates if c.policy == policy and c.found_by == "named")


# -- No compiles ----------------------------------------------------------------------------


def test_options_and_the_line_to_paste():
    assert loss_chunk(8192) == 1024 and loss_chunk(64) == 8 and loss_chunk(12) is None
    c = Candidate(
        policy="save-nothing", actions=None, remat_group_size=1, batch_size=1, seq_len=8192,
        peak_bytes=1, host_bytes=0, flops=1.0, flops_no_remat=1.0, compute_s=1.0,
        transfer_s=0.0, step_time_s=1.0, tokens_per_s=1.0, fits=True, found_by="structure",
        model="llama3-8b", attention="cudnn", loss_chunk_size=None, remat_layers=24,
    )  # fmt: skip
    assert c.code() == (
        'get_config("llama3-8b", remat_policy="save-nothing", attention="cudnn", '
        "remat_layers=24, scan_layers=True)  # batch 1, seq 8192"
    )
    assert c.options_label == "cudnn, remat 24 layers"
    nested = dataclasses.replace(c, attention="xla", remat_layers=None, nested_groups=4)
    assert nested.code() == (
        'get_config("llama3-8b", remat_policy="save-nothing", nested_remat=True, '
        "nested_groups=4, scan_layers=True)  # batch 1, seq 8192"
    )
    assert nested.options_label == "nested 4 groups"
    nest = "nested_remat=True, nested_groups=2"  # sqrt_groups(4) == 2
    assert _options(CONFIG) == [
        "attention='cudnn'", "loss_chunk_size=8", "attention='cudnn' + loss_chunk_size=8", nest,
        f"attention='cudnn' + loss_chunk_size=8 + {nest}",
    ]  # fmt: skip
    f32 = get_config("tiny-llama")  # float32: no cuDNN
    assert _options(f32) == ["loss_chunk_size=8", nest, f"loss_chunk_size=8 + {nest}"]
    assert _options(f32.replace(nested_remat=True)) == ["loss_chunk_size=8"]  # nested already
    # Secant probes, then bisection: enough to close any bracket of 1..L-1.
    assert [partial_probes(n) for n in (2, 4, 5, 32, 80)] == [3, 4, 5, 7, 9]


def test_structured_baseline_and_residuals_are_the_plain_steps():
    """The recompute baseline of a structured config is the plain no-remat step (same
    attention); its residuals come from the whole loss, between save-nothing's and no-remat's."""

    def baseline_flops(config):
        base = preset(config, BATCH, SEQ).baseline_step()
        return traced_flops(base.fn, *base.args)

    plain = baseline_flops(CONFIG)
    partial = CONFIG.replace(remat_policy="save-nothing", remat_layers=2, loss_chunk_size=8)
    assert baseline_flops(partial) == plain

    def device_bytes(config):
        return sum(r.nbytes for r in model_residuals(config, BATCH, SEQ) if r.memory == "device")

    low = device_bytes(CONFIG.replace(remat_policy="save-nothing"))
    high = device_bytes(CONFIG.replace(remat_policy="no-remat"))
    assert low < device_bytes(partial.replace(loss_chunk_size=None)) < high


# -- Compiled (deviceless h100-sxm) ---------------------------------------------------------


@needs_cuda_plugin
def test_only_a_structural_option_fits(first, cache):
    sn = _named(first, "save-nothing")
    budget = sn.peak_bytes - 1  # every plain candidate is over
    rec = recommend(CONFIG, SEQ, TARGET, budget=budget, cache=cache, **KW)
    assert not any(c.fits for c in rec.candidates if not c.options)
    pick = rec.pick
    assert pick is not None and pick.fits and pick.peak_bytes <= budget
    assert pick.found_by in ("structure", "partial-layers") and pick.options
    assert pick.attention == "cudnn" or pick.loss_chunk_size is not None
    assert all(c.fits == (c.peak_bytes <= budget) for c in rec.candidates)
    assert "made it fit" in rec.made_fit
    line = rec.line()
    assert line.startswith("config.replace(remat_policy=") and "scan_layers=True" in line
    assert ('attention="cudnn"' in line) == (pick.attention == "cudnn")


@needs_cuda_plugin
def test_room_gives_fewer_rematerialised_layers(first, cache):
    sn, nr = _named(first, "save-nothing"), _named(first, "no-remat")
    budget = (sn.peak_bytes + nr.peak_bytes) // 2  # save-nothing fits with room, no-remat not
    rec = recommend(CONFIG, SEQ, TARGET, budget=budget, cache=cache, **KW)
    pick = rec.pick
    assert pick is not None and pick.fits and pick.peak_bytes <= budget
    # the least recomputing of the candidates estimated within the model's error of the fastest
    from remat_kit.memory.roofline import estimate_error
    from remat_kit.recommend.session import recompute_key
    from remat_kit.targets import get_target

    fastest = min(c.step_time_s for c in rec.candidates if c.fits)
    near = [
        c for c in rec.candidates
        if c.fits and c.step_time_s <= fastest * (1 + estimate_error(get_target(TARGET)))
    ]  # fmt: skip
    assert pick in near and recompute_key(pick) == min(recompute_key(c) for c in near)
    # The partial-layer search ran on save-nothing (it fits with room): fewer rematerialised
    # layers, the least that fits proven by compiling k - 1 (k - 1 == 0 is no-remat).
    partial = [c for c in rec.candidates if c.found_by == "partial-layers"]
    assert partial and all(0 < c.remat_layers < CONFIG.num_layers for c in partial)
    least = min(c.remat_layers for c in partial if c.fits)
    assert all(not c.fits for c in partial if c.remat_layers < least)
    below = [c for c in partial if c.remat_layers == least - 1] or [nr]
    assert below and not below[0].fits and below[0].peak_bytes > budget
    assert not any("not shown to be the least" in n for n in rec.notes)
    assert len(partial) <= partial_probes(CONFIG.num_layers)
    if pick.found_by == "partial-layers":  # the roofline ranks it first: its options are said
        assert f"remat_layers={pick.remat_layers}" in rec.line()
        every = rf"with {re.escape(pick.policy)} on every layer \(\d+\.\d% (slower|faster)\)"
        assert re.search(every, rec.made_fit), rec.made_fit
        said = f"remat_layers={least} is the least that fits" in rec.made_fit
        assert said == (least < pick.remat_layers)


@needs_cuda_plugin
def test_partial_search_stopped_by_the_compile_cap_says_so(first_and_reports, fresh_compile_cache):
    """A compile cap that leaves one partial-layer probe: the bracket stays open, and the notes
    say where the search stopped and that k is not shown to be the least."""
    first, reports = first_and_reports
    sn, nr = _named(first, "save-nothing"), _named(first, "no-remat")
    budget = (sn.peak_bytes + nr.peak_bytes) // 2
    named = CompileCache()  # save-nothing as compiled by `first`, no probe of another test
    named.reports.update(reports)
    # save-nothing reused (no compile), then 1 compile left: the bisection's first probe, k=2
    rec = recommend(
        CONFIG, SEQ, TARGET, budget=budget, cache=named, max_compiles=1,
        **{**KW, "policies": ["save-nothing"]},
    )  # fmt: skip
    (probe,) = [c for c in rec.candidates if c.found_by == "partial-layers"]
    assert 1 < probe.remat_layers < CONFIG.num_layers - 1  # one probe cannot close 0..4 here
    note = next(n for n in rec.notes if "partial-layer search stopped" in n)
    fit = probe.remat_layers if probe.fits else CONFIG.num_layers
    assert f"at the compile cap: remat_layers={fit} of {CONFIG.num_layers} fits" in note
    assert "not shown to be the least that fits" in note
    assert rec.pick is not None and rec.pick.peak_bytes <= budget


@needs_cuda_plugin
def test_nested_remat_makes_it_fit(capsys):
    """No-remat over the budget and the chunked loss no help: nested remat (2 checkpointed
    groups of 2 layers, no remat inside: Chen et al.'s scheme) fits, and says so."""
    config = get_config("tiny-llama")  # float32: no cuDNN; options: loss chunk, nested, both
    kw = dict(batch_size=BATCH, policies=["no-remat"], group_sizes=[1], structure=True)
    cache = CompileCache()
    plain = recommend(config, SEQ, TARGET, budget=10**9, cache=cache, **kw).pick
    assert plain is not None and plain.policy == "no-remat" and not plain.options
    budget = plain.peak_bytes - 1
    rec = recommend(config, SEQ, TARGET, budget=budget, cache=cache, **kw)
    pick = rec.pick
    assert pick is not None and pick.fits and pick.peak_bytes <= budget
    assert pick.found_by == "structure" and pick.nested_groups == 2 and pick.policy == "no-remat"
    assert not any(c.fits for c in rec.candidates if c.nested_groups is None)
    config_again = config.replace(remat_policy=pick.policy, **dict(structure_of(pick)))
    assert config_again.nested_remat and config_again.outer_groups == 2
    code = (
        'get_config("tiny-llama", remat_policy="no-remat", nested_remat=True, nested_groups=2, '
        "scan_layers=True)"
    )
    comment = (
        f"batch {BATCH}, seq {SEQ}; {TARGET}: peak {format_bytes(pick.peak_bytes)} of the "
        f"{format_bytes(budget)} budget"
    )
    assert rec.line() == f"{code}  # {comment}"
    assert rec.made_fit.startswith("nested_remat=True + nested_groups=2 made it fit: no-remat on")
    with_and_without = f"peaks at {format_bytes(plain.peak_bytes)} without it, "
    assert with_and_without + f"{format_bytes(pick.peak_bytes)} with it" in rec.made_fit
    print_recommendation(rec)
    printed = capsys.readouterr().out
    assert printed.endswith(f"# {comment}\n{code}\n")  # the code whole, on a line of its own
    out = " ".join(printed.split())
    assert "options: nested_remat=True + nested_groups=2 made it fit" in out
    assert "nested 2 groups" in out
