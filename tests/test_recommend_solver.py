"""The per-tag solver's compile decisions (:func:`remat_kit.recommend.search.verify_choices`) on
user-style tags (``attn_in``: a segment input, no FLOPs saved; ``mlp_up`` and ``qkv_out``:
matmul outputs), with a stand-in compiler whose peaks differ from the additive model's, as
XLA's do (the NNX GPT of the trial: save mlp_up predicted over the budget, compiled under it).
Nothing is compiled: the whole file runs in well under a second."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from remat_kit import targets as T
from remat_kit.memory.calibration import figures_for
from remat_kit.policies import custom_spec, get_policy_spec
from remat_kit.recommend.api import DEFAULT_MARGIN
from remat_kit.recommend.search import (
    SOLVE_VERIFY,
    ChoiceModel,
    fixed_program_advice,
    model_error,
    verify_choices,
)
from remat_kit.recommend.session import Candidate, TagCost, Variant, given_by, to_candidate

MIB = 2**20
TARGET = T.get_target("h100-sxm")
US = 1e-6 * TARGET.peak_flops_bf16  # matmul FLOPs of one microsecond at peak
PEAK0, FLOPS0 = 17 * MIB, 2.7 * US  # save-nothing: 17 MiB, 2.7 us
ATTN_IN = TagCost(tag="attn_in", nbytes=2 * MIB, base_bytes=2 * MIB, flops_saved=0.0)
MLP_UP = TagCost(tag="mlp_up", nbytes=4 * MIB, base_bytes=0, flops_saved=0.2 * US)
QKV_OUT = TagCost(tag="qkv_out", nbytes=3 * MIB, base_bytes=0, flops_saved=0.1 * US)
ACTIONS = ("save", "recompute")


def _candidate(saved: list[str], peak: int, budget: int, costs) -> Candidate:
    flops = FLOPS0 - sum(tc.flops_saved for tc in costs if tc.tag in saved)
    step = flops / figures_for(TARGET).peak_flops["bf16"]  # the time model's own rate
    return Candidate(
        policy="custom" if saved else "save-nothing",
        actions={t: "save" for t in saved} if saved else None, remat_group_size=None,
        batch_size=None, seq_len=None, peak_bytes=peak, host_bytes=0, flops=flops,
        flops_no_remat=0.8 * FLOPS0, compute_s=step, transfer_s=0.0, step_time_s=step,
        tokens_per_s=None, fits=peak <= budget, found_by="solve",
    )  # fmt: skip


class Compiler:
    """ "Compiles" a per-tag spec to ``PEAK0 + true_bytes[tag]`` summed over its saved tags;
    records the specs, and counts down ``room``."""

    def __init__(self, budget: int, costs, true_bytes: dict[str, int], room: int = 10):
        self.budget, self.costs, self.true, self.left = budget, costs, true_bytes, room
        self.compiled: list[set[str]] = []

    def __call__(self, specs):
        self.left -= len(specs)
        self.compiled += [set(s.save) for s in specs]
        return [
            _candidate(sorted(s.save), PEAK0 + sum(self.true[t] for t in s.save), self.budget,
                       self.costs)
            for s in specs
        ]  # fmt: skip

    def room(self) -> int:
        return max(0, self.left)


def _solve(costs, budget: int, true_bytes: dict[str, int], room: int = 10, named=()):
    save_nothing = _candidate([], PEAK0, budget, costs)
    named = [(get_policy_spec("save-nothing"), save_nothing, None), *named]
    model = ChoiceModel.around(TARGET, costs, ACTIONS, save_nothing, FLOPS0)
    compiler, notes = Compiler(budget, costs, true_bytes, room), []
    summary = verify_choices(model, named, budget, compiler, compiler.room, notes)
    return summary, compiler, notes


def test_a_faster_choice_predicted_over_budget_is_compiled_and_picked():
    """The trial's fault: save mlp_up predicted at 21 MiB (budget 20 MiB) compiles to 19 MiB.
    With only save-nothing compiled the model's error is unmeasured, so it is compiled: it fits
    and beats save-nothing. Recompute-all (= save-nothing) is not compiled again."""
    summary, compiler, notes = _solve([ATTN_IN, MLP_UP], 20 * MIB, {"mlp_up": 2 * MIB})
    assert compiler.compiled == [{"mlp_up"}]
    (c,) = summary.verified
    assert c.fits and c.peak_bytes == 19 * MIB and c.predicted_peak_bytes == 21 * MIB
    # save-nothing's FLOPs over the time model's rate: 3.36 µs; saving mlp_up beats it
    assert c.step_time_s < 3.36e-6 and c.predicted_step_time_s == c.step_time_s
    assert summary.peak_slack_bytes == 2 * MIB  # the error it measured
    assert summary.combinations == 2 and summary.predicted_fit == 2 and not notes


def test_a_compiled_choice_over_budget_is_returned_unfit():
    summary, compiler, notes = _solve([ATTN_IN, MLP_UP], 18 * MIB, {"mlp_up": 4 * MIB})
    (c,) = summary.verified
    assert compiler.compiled == [{"mlp_up"}] and not c.fits and c.peak_bytes == 21 * MIB
    assert summary.peak_slack_bytes == 0 and summary.predicted_fit == 1 and not notes


def test_the_observed_error_rules_choices_out():
    """A named per-tag policy measures the error (0.5 MiB): qkv_out (predicted 20 MiB, faster)
    is compiled; mlp_up + qkv_out (predicted 24 MiB, 3.5 MiB past the error) is not, nor
    mlp_up again."""
    costs = [ATTN_IN, MLP_UP, QKV_OUT]
    mlp = _candidate(["mlp_up"], 20 * MIB + MIB // 2, 20 * MIB, costs)
    named = [(custom_spec({"mlp_up": "save"}), mlp, None)]
    true = {"mlp_up": 3 * MIB + MIB // 2, "qkv_out": 3 * MIB}
    summary, compiler, notes = _solve(costs, 20 * MIB, true, named=named)
    assert compiler.compiled == [{"qkv_out"}] and not notes
    assert summary.calibration[1] == ("custom", 21 * MIB, 20 * MIB + MIB // 2)
    assert summary.verified[0].fits and summary.peak_slack_bytes == MIB // 2
    points = [(("recompute", "save"), 2.5e-6, 21 * MIB, 2.6e-6, 20 * MIB)]
    assert model_error(points) == (MIB, pytest.approx(0.1 / 2.5))
    assert model_error([(("recompute", "recompute"), 1.0, 5, 1.0, 5)]) == (None, 0.0)


def test_unmeasured_error_rules_out_choices_adding_bytes_when_save_nothing_does_not_fit():
    summary, compiler, notes = _solve([ATTN_IN, MLP_UP], 16 * MIB, {"mlp_up": 2 * MIB})
    assert compiler.compiled == [] and summary.verified == () and not notes


def test_the_choices_left_are_named_with_the_reason():
    summary, compiler, notes = _solve([ATTN_IN, MLP_UP], 20 * MIB, {"mlp_up": 2 * MIB}, room=0)
    assert summary.verified == () and compiler.compiled == []
    (note,) = notes
    assert "1 per-tag choice(s) that could still beat the pick" in note
    assert (
        "were not compiled (compile cap reached): [save mlp_up] predicted 21.00 MiB, 3.112 µs"
        in note
    )


def test_rounds_compile_the_fastest_first():
    costs = [ATTN_IN, MLP_UP, QKV_OUT]
    true = {"mlp_up": 2 * MIB, "qkv_out": 2 * MIB}
    summary, compiler, _ = _solve(costs, 20 * MIB, true)
    assert compiler.compiled[0] == {"mlp_up", "qkv_out"}  # 2.4 us predicted: tried first
    assert len(compiler.compiled) <= SOLVE_VERIFY
    best = min((c for c in summary.verified if c.fits), key=lambda c: c.step_time_s)
    assert best.actions == {"mlp_up": "save"} and best.peak_bytes == 19 * MIB


def test_found_by_says_what_a_given_policy_is():
    assert given_by(get_policy_spec("save-dots")) == "named"
    assert given_by(custom_spec({"mlp_up": "save"})) == "per-tag"
    assert given_by(custom_spec({"mlp_up": "save"}, name="mine")) == "given"


def test_found_by_on_a_compiled_report():
    report = SimpleNamespace(flops=2.0 * US, flops_no_remat=US, host_bytes=0, peak_bytes=MIB,
                             warnings=(), step_time=None)  # fmt: skip
    for spec, label in [
        (get_policy_spec("save-nothing"), "named"),
        (custom_spec({"mlp_up": "save"}), "per-tag"),
    ]:
        c = to_candidate(report, spec, 2 * MIB, [], "named")
        assert c.found_by == label
    solved = to_candidate(report, custom_spec({"mlp_up": "save"}), 2 * MIB, [], "solve")
    assert solved.found_by == "solve"


def _advice(target: str, budget: int, least_peak: int) -> list[str]:
    session = SimpleNamespace(
        program=SimpleNamespace(name="make_loss"), target=T.get_target(target), budget=budget,
        margin=DEFAULT_MARGIN,
    )  # fmt: skip
    least = dataclasses.replace(_candidate([], least_peak, budget, [MLP_UP]), found_by="named")
    return fixed_program_advice(session, [least])


def test_program_advice_suggests_only_what_works_on_a_program():
    """No preset-only command (analyze --devices/--mesh refuses a program): a budget that
    fits, the factory's shapes, sharding inside the step; a larger GPU when the target's own
    memory cannot hold the least-memory configuration."""
    for target, budget, peak in [("h100-sxm", 12 * MIB, 19 * MIB), ("l4", 20 * 2**30, 40 * 2**30)]:
        advice = _advice(target, budget, peak)
        text = " ".join(advice)
        assert "remat-kit analyze" not in text and "--devices" not in text and "--mesh" not in text
        assert "a budget of" in advice[0] and "its factory" in advice[1]
        assert "inside the program's own step" in advice[-1]
    assert not any("more memory" in a for a in _advice("h100-sxm", 12 * MIB, 19 * MIB))
    (bigger,) = [a for a in _advice("l4", 20 * 2**30, 40 * 2**30) if "more memory" in a]
    assert "more memory: h100-sxm, a100-80gb, h200 (" in bigger and "--target h100-sxm" in bigger


def test_a_refused_compile_note_names_the_structure_probed():
    """A failed structural probe (``remat_layers=40`` on a TPU slice) names its options, so the
    note is not read as the pick's own configuration failing."""
    from remat_kit.memory.xla_compile import CompileError

    notes: list[str] = []
    refused = CompileError("step", "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.")
    spec = get_policy_spec("offload-layer-inputs")
    probed = Variant(group=1, batch=256, seq_len=8192, structure=(("remat_layers", 40),))
    assert to_candidate(refused, spec, 1, notes, "structure", probed) is None
    assert notes[0].startswith("offload-layer-inputs (group 1, batch 256, remat_layers=40): ")
    to_candidate(refused, spec, 1, notes, "named", Variant(1, 256, 8192))
    assert notes[1].startswith("offload-layer-inputs (group 1, batch 256): ")


def test_a_pick_the_time_model_cannot_tell_from_the_next_is_called_close():
    """A pick whose estimate leads the next fitting configuration by under CLOSE_CALL says so
    (the outside trial's pick led save-nothing by 0.2% and measured slower); a clear lead, a
    rival that does not fit, or the same program under another spec says nothing."""
    from remat_kit.recommend.session import CLOSE_CALL, close_call

    budget = 20 * MIB
    pick = _candidate(["mlp_up"], 18 * MIB, budget, [MLP_UP])
    near = dataclasses.replace(pick, policy="save-nothing", actions=None,
                               step_time_s=pick.step_time_s * (1 + CLOSE_CALL / 2))  # fmt: skip
    far = dataclasses.replace(near, step_time_s=pick.step_time_s * (1 + 2 * CLOSE_CALL))
    note = close_call(pick, [pick, near], auto=False)
    assert note is not None and "save-nothing" in note and f"{CLOSE_CALL / 2:.1%}" in note
    assert close_call(pick, [pick, far], auto=False) is None
    assert close_call(pick, [pick, dataclasses.replace(near, fits=False)], auto=False) is None
    assert close_call(pick, [pick, dataclasses.replace(pick, step_time_s=near.step_time_s)],
                      auto=False) is None  # fmt: skip
    assert close_call(None, [near], auto=False) is None
    # another label compiled to the same program (save-out-proj and custom: out_proj=save on a
    # program tagging out_proj only): not a rival, whatever its label
    one = dataclasses.replace(pick, program_sha256="abc")
    assert close_call(one, [one, dataclasses.replace(near, program_sha256="abc")], False) is None
    assert close_call(one, [one, dataclasses.replace(near, program_sha256="def")], False)
    # auto: the lead in tokens per second of each policy's largest batch
    fast = dataclasses.replace(pick, tokens_per_s=1000.0)
    assert close_call(fast, [fast, dataclasses.replace(near, tokens_per_s=990.0)], auto=True)
    assert close_call(fast, [fast, dataclasses.replace(near, tokens_per_s=800.0)], True) is None
