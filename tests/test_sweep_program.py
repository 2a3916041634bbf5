"""experiments/sweep.py --model FILE.py:FACTORY: the sweep of a user's own Program.

One program (tests/user_models/plain_jax.py, its own tags attn_in / attn_out / mlp_hidden), three
policies, one warm-up and two timed steps: run through the command line, resumed (nothing added),
resumed with one more policy that fails (an error row, the rest kept), and bad input (exit 2,
nothing in the results file lost). Real compiles and runs on the CPU; nothing is patched but the
injected failure.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
from pathlib import Path

import jax
import measured
import pytest
from measured import steps as programs
from measured import summary
from measured.steps import time_runs
from rich.console import Console

import remat_kit
from remat_kit import Program, load_program, sweep
from remat_kit.policies import get_policy_spec
from remat_kit.sweep import results
from remat_kit.sweep.output import warning_lines
from remat_kit.trace import trace_step
from tests.user_models import plain_jax

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = ROOT / "experiments" / "sweep.py"
MODEL = "tests/user_models/plain_jax.py:program"
POLICIES = ("no-remat", "save-nothing", "attn_in=save")


def _cli():
    spec = importlib.util.spec_from_file_location("sweep_cli_program", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _argv(out: Path, *extra: str) -> list[str]:
    policies = [a for p in POLICIES for a in ("--policy", p)]
    return ["--model", MODEL, "--out", str(out), *policies, "--warmup-steps", "1",
            "--timed-steps", "2", "--no-progress", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The sweep run once through the command line (with figures), then resumed."""
    folder = tmp_path_factory.mktemp("program_sweep")
    out = folder / "sweep.jsonl"
    cli = _cli()
    assert cli.main(_argv(out)) == 0
    first = results.read_rows(out)
    summary = (folder / "summary.md").read_text()
    (folder / "summary.md").unlink()
    assert cli.main(_argv(out, "--resume", "--no-plot")) == 0
    return out, first, summary


def test_rows_measured_on_the_cpu(swept):
    out, rows, _ = swept
    assert [r["policy"] for r in rows] == list(POLICIES)
    assert jax.default_backend() == "cpu"
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["model"] == "plain-jax" and r["program"] == MODEL
        assert r["program_tags"] == sorted(plain_jax.TAGS)
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["step_cpu_s"] > 0 and r["compile_s"] > 0
        assert r["compile_reused"] is True  # the analyzer's executable ran: compiled once
        assert r["step_order"] == "interleaved"  # no peak to keep apart on the CPU
        assert r["measured_peak_bytes"] is None  # the CPU backend reports no peak
        assert "reports no peak_bytes_in_use" in r["measured_peak_note"]
        assert r["peak_bytes"] > 0 and r["recompute_ratio"] > 0
        # from_loss: (params, opt_state, loss); the state fed back, the loss read every step
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][0]  # AdamW steps on the fed-back state
        assert sorted(r["fed_back"]) == ["opt_state", "params"] and r["recopied"] == []
        assert r["arguments"] == "materialised" and "jax.random.key(0)" in r["arguments_note"]
        for field in ("batch_size", "seq_len", "model_fields", "tokens_per_s", "mfu",
                      "model_flops_per_step"):  # fmt: skip
            assert r[field] is None, field
    by = {r["policy"]: r for r in rows}
    assert "attn_in" in by["attn_in=save"]["residual_bytes_by_tag"]
    assert "attn_in" not in by["save-nothing"]["residual_bytes_by_tag"]
    assert by["save-nothing"]["peak_bytes"] < by["no-remat"]["peak_bytes"]
    assert by["save-nothing"]["recompute_ratio"] > by["no-remat"]["recompute_ratio"]


def test_summary_and_figures_from_program_rows(swept):
    out, _, summary = swept
    assert "plain-jax on local" in summary and "None" not in summary
    # labelled as analyze labels them (a per-tag spec: "custom: attn_in=save")
    assert all(f"| {p} |" in summary for p in ("no-remat", "save-nothing", "custom: attn_in=save"))
    assert "run on its arguments: materialised" in summary
    assert (out.parent / "pareto.png").stat().st_size > 0
    assert (out.parent / "memory_breakdown.png").stat().st_size > 0
    html = (out.parent / "report.html").read_text()
    labels = ("no-remat", "save-nothing", "custom: attn_in=save")
    assert "<!DOCTYPE html>" in html and all(json.dumps(p) in html for p in labels)
    # the resumed run rebuilt summary.md from the rows it kept
    assert "3 kept from earlier runs" in (out.parent / "summary.md").read_text()


def test_resume_adds_nothing_then_one_failing_policy(swept):
    out, first, _ = swept
    assert results.read_rows(out) == first  # the resumed command line added no row

    def fail(label):
        if label == "save-dots":
            raise RuntimeError("injected")

    run = measured.run_program_sweep(
        load_program(MODEL), out, policies=(*POLICIES, "save-dots"), warmup_steps=1,
        timed_steps=2, resume=True, progress=False, before_policy=fail,
    )  # fmt: skip
    assert run.skipped == 3 and [r["policy"] for r in run.new_rows] == ["save-dots"]
    bad = run.new_rows[0]
    assert bad["status"] == "error" and bad["error"] == "RuntimeError: injected"
    assert bad["step_time_s"] is None and bad["peak_bytes"] is None
    assert results.read_rows(out) == [*first, bad]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "tests/user_models/plain_jax.py:nope"], "nope"),
        (["--model", "no_such_module_xyz:program"], "cannot import module"),
        (["--model", "tests/user_models/plain_jax.py:abstract_args"], "not a remat_kit.Program"),
        (["--model", MODEL, "--config", "quick"], "--config: not with --model"),
        # --resume: without it the file's row is refused first (before the banner)
        (["--model", MODEL, "--policy", "nope=save", "--resume"], "not emitted"),
        (["--model", "tiny-gpt"], "presets are swept with --config"),
        (["--config", "quick", "--warmup-steps", "1"], "only with --model"),
        (["--model", MODEL, "--timed-steps", "0"], "--timed-steps: expected a positive integer"),
        (["--model", MODEL, "--warmup-steps", "-1"], "--warmup-steps: expected 0 or a positive"),
        # a bad count is refused as the arguments are read, before the program is looked for
        (["--model", "no_such.py:f", "--timed-steps", "x"], "expected a positive integer, got 'x'"),
        (["--model", "no_such.py:f", "--policy", "save-dots-no-bach"], "'save-dots-no-batch'?"),
    ],
)
def test_bad_input_exits_2_and_keeps_the_file(tmp_path, capsys, extra, message):
    out = tmp_path / "sweep.jsonl"
    out.write_text('{"key": "k", "config_fingerprint": "f"}\n')
    try:
        code = _cli().main([*extra, "--out", str(out), "--no-progress"])
    except SystemExit as exit_:  # argparse refused an argument's value: the same exit 2
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep.py: error: ") and err.count("\n") == 1 and message in err, err
    assert out.read_text() == '{"key": "k", "config_fingerprint": "f"}\n'


def test_feedback_matches_donated_arguments_to_the_outputs():
    # from_loss: step(opt_state, params, tokens) -> (opt_state, (params,), loss), 0 and 1 donated
    pure = load_program(MODEL).step(get_policy_spec("no-remat"))
    host = programs.host_arguments(pure)
    out = jax.eval_shape(pure.fn, *host.values)
    paths = programs.feedback_paths(host.values, out, (0, 1))
    assert paths == {0: (0,), 1: (1, 0)}  # opt_state <- out[0], params <- out[1][0]
    assert programs.loss_path(out, list(paths.values())) == (2,)


def test_nnx_program_with_concrete_arguments(tmp_path):
    """An idiomatic NNX step (mutates its model and nnx.Optimizer, returns the loss): its
    concrete arguments are used as given and the merged NNX state is fed back."""
    from flax import nnx

    from remat_kit import Program
    from tests.user_models import nnx_lm

    def make_step(policy):
        def step(model, optimizer, tokens):
            model.policy = policy
            return nnx_lm.train_step(model, optimizer, tokens)

        return step

    model = nnx_lm.make_model()
    tokens = jax.numpy.zeros((2, 17), "int32")
    program = Program.from_step(make_step, model, nnx_lm.make_optimizer(model), tokens)
    before = nnx.state(model, nnx.Param)
    run = measured.run_program_sweep(
        program, tmp_path / "s.jsonl", policies=["save-nothing"], warmup_steps=0, timed_steps=2,
        progress=False,
    )  # fmt: skip
    (row,) = run.rows
    assert row["status"] == "ok", row["error"]
    assert row["arguments"] == "concrete" and row["arguments_note"] is None
    assert row["fed_back"] == ["model+optimizer"] and row["step_time_s"] > 0
    assert len(row["losses"]) == 2 and row["losses"][1] < row["losses"][0]
    assert row["program_tags"] == [] and row["residual_bytes_by_tag"] is not None
    # the program's own objects are left as they were (the run works on copies)
    after = nnx.state(model, nnx.Param)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), before, after))


def test_arguments_materialised_by_kind_and_copied_per_policy():
    from remat_kit.pure import Pure

    f32, keys = jax.ShapeDtypeStruct((64,), "float32"), jax.random.key(0, impl="rbg").dtype
    args = (f32, jax.ShapeDtypeStruct((2,), "int32"), jax.ShapeDtypeStruct((3,), keys),
            jax.numpy.full((2,), 7.0))  # fmt: skip
    host = programs.host_arguments(Pure(None, args, ("w", "t", "k", "c"), None))
    assert host.source == "partly materialised" and "zeros" in host.note
    assert host.note.startswith("w, t, k filled in: ")  # by name: c is the caller's own
    first, second = programs.device_arguments(host.values), programs.device_arguments(host.values)
    w, t, k, c = first
    assert w.dtype == "float32" and 0 < float(w.max()) < 0.2 and float(w.min()) >= 0
    assert t.tolist() == [0, 0] and k.shape == (3,) and k.dtype == keys and c.tolist() == [7, 7]
    sig = programs.argument_signature(host)
    assert sig[0] == [[64], "float32"] and sig[2][1].startswith("key<") and len(sig) == 4
    c.delete()  # a step donating its copy leaves the host values and the next copy intact
    assert second[3].tolist() == [7, 7] and host.values[3].tolist() == [7, 7]


def test_concrete_params_give_the_optimizers_own_state_and_the_users_first_loss():
    """Program.from_loss on concrete arrays: the optimizer state is the optimizer's own init
    (not materialised), the arguments are all concrete, and the first loss the sweep reads is
    the user's own loss on those arrays."""
    params = plain_jax.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, plain_jax.V)
    program = Program.from_loss(plain_jax.make_loss, params, tokens, optimizer="adamw")
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(program.args[0]))
    pure = program.step(get_policy_spec("save-nothing"))
    host = programs.host_arguments(pure)
    assert host.source == "concrete" and host.note is None
    local = remat_kit.get_target("local")
    _, stage = trace_step(program, get_policy_spec("save-nothing"), program.place(local))
    run = programs.ProgramRun(program, pure, stage.lower().compile(), host, 0, 2)
    (result,) = time_runs([lambda: run], interleave=False)
    own = float(plain_jax.make_loss(None)(params, tokens))
    assert result["losses"][0] == pytest.approx(own, rel=1e-5)
    assert result["losses"][1] < result["losses"][0]


def _table_rows(rows, label):
    """The swept rows with the per-tag policy renamed to a long label."""
    return [
        {**r, "policy": label, "policy_label": label} if r["policy"] == "attn_in=save" else r
        for r in rows
    ]


@pytest.mark.parametrize("width", [40, 80, 200])
def test_terminal_table_never_cuts_a_figure(swept, width):
    label = ",".join(f"{t}=save" for t in ("attn_in", "attn_out", "mlp_hidden", "qkv_out_long"))
    rows = _table_rows(swept[1], label)
    console = Console(width=width, record=True, file=io.StringIO())
    summary.print_summary(rows, console)
    text = console.export_text()
    assert "…" not in text
    ((_, header, body),) = summary.summary_lines(rows)
    # optional columns left out for the width, the caption says which
    caption = "".join(t for t in text.splitlines() if "left out for the width" in t)
    gone = [h for h in summary.OPTIONAL_COLUMNS if h in caption.partition(":")[2]]
    kept = [i for i, h in enumerate(header) if h not in gone]
    for line in body:  # every figure whole, on the line where its policy starts
        start = next(t for t in text.splitlines() if t.strip().startswith(line[0][:12]))
        figures = [line[i] for i in kept[1:]]
        assert start.split()[-len(figures) :] == figures, (start, line)
    if width >= 80:
        assert max(len(t) for t in text.splitlines()) <= width
    if width >= 200:
        assert not gone


def test_warnings_of_every_policy_printed_once(swept, tmp_path):
    """Each policy's analysis warnings in the terminal and summary.md: one every policy shares
    once, a cause several give once."""
    rows = [dict(r) for r in swept[1]]
    cause = "XLA:CPU honours remat only inside lax.scan"
    for r in rows:
        r["warnings"] = ["shared note"]
    rows[1]["warnings"] += [f"policy 'save-nothing' undid. Cause: {cause}"]
    rows[2]["warnings"] += [f"policy 'custom: attn_in=save' undid. Cause: {cause}"]
    assert warning_lines(rows) == [
        "all policies: shared note",
        "save-nothing: policy 'save-nothing' undid. [cause 1]",
        "attn_in=save: policy 'custom: attn_in=save' undid. [cause 1]",
        f"cause 1: {cause}",
    ]
    run = sweep.SweepRun(tmp_path / "sweep.jsonl", rows, rows, 0, 1.0)
    args = _cli().build_parser().parse_args(["--model", MODEL, "--no-plot"])
    console = Console(width=80, record=True, file=io.StringIO())
    _cli()._write_outputs(run, run.path, args, [], console)
    printed, summary = console.export_text(), (tmp_path / "summary.md").read_text()
    for line in warning_lines(rows):
        assert f"- {line}" in summary
        assert " ".join(line.split()) in " ".join(printed.split())
    assert printed.count("shared note") == 1 and summary.count("shared note") == 1


def test_ctrl_c_prints_one_line_keeps_the_rows_and_exits_130(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sweep.jsonl"

    def interrupted(program, path, **kwargs):
        results.append_row(path, {"key": "a", "policy": "no-remat"})  # one finished row
        raise KeyboardInterrupt

    monkeypatch.setattr(measured, "run_program_sweep", interrupted)
    assert _cli().main(_argv(out)) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted: 1 rows kept in {out}; --resume continues\n"
    assert results.read_rows(out) == [{"key": "a", "policy": "no-remat"}]


def test_interleaved_program_steps_are_each_policys_own():
    """Two policies' steps of one program timed interleaved compute what each computes alone
    (each run feeds back its own donated state): the losses are bitwise equal."""
    program = load_program(MODEL)
    local = remat_kit.get_target("local")
    makers = []
    for name in ("no-remat", "save-nothing"):
        spec = get_policy_spec(name)
        pure, stage = trace_step(program, spec, program.place(local))
        host = programs.host_arguments(pure)
        compiled = stage.lower().compile()
        makers.append(
            lambda p=pure, c=compiled, h=host: programs.ProgramRun(program, p, c, h, 1, 2)
        )
    alone = time_runs(makers, interleave=False)
    mixed = time_runs(makers, interleave=True)
    for a, b in zip(alone, mixed, strict=True):
        assert (a["step_order"], b["step_order"]) == ("alone", "interleaved")
        assert a["losses"] == b["losses"] and len(a["losses"]) == 3


def test_from_loss_with_an_nnx_module_trains_and_donates_like_its_state(tmp_path):
    """``Program.from_loss`` given an ``nnx.Module`` as the parameters: the step updates the
    module (its NNX state out is fed to the next step) and donates the optimizer state beside
    it, as the same loss on the module's ``nnx.split`` state does: the same losses, bitwise,
    and the same aliased bytes (before: the module never changed, the optimizer state was not
    donated)."""
    from flax import nnx

    from tests.user_models import nnx_lm

    def make_loss(policy):
        def loss(model, tokens):
            model.policy = policy
            return nnx_lm.loss_fn(model, tokens)

        return loss

    model = nnx_lm.make_model()
    graphdef, state = nnx.split(model)

    def make_state_loss(policy):
        def loss(state, tokens):
            return make_loss(policy)(nnx.merge(graphdef, state), tokens)

        return loss

    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, nnx_lm.VOCAB)
    rows, alias = [], []
    for program in (
        Program.from_loss(make_loss, model, tokens, optimizer="adamw"),
        Program.from_loss(make_state_loss, state, tokens, optimizer="adamw"),
    ):
        run = measured.run_program_sweep(
            program, tmp_path / f"{len(rows)}.jsonl", policies=["save-nothing"], warmup_steps=1,
            timed_steps=2, progress=False,
        )  # fmt: skip
        rows.append(run.rows[0])
        alias.append(run.rows[0]["report"]["alias_bytes"])  # the analysed program that ran
    module, split = rows
    assert module["status"] == split["status"] == "ok", (module["error"], split["error"])
    assert module["losses"] == split["losses"] and module["losses"][2] < module["losses"][0]
    assert sorted(module["fed_back"]) == ["model", "opt_state"] and module["recopied"] == []
    assert alias[0] == alias[1] > 0


def test_a_point_failing_with_an_error_exits_1_the_rows_kept(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep.jsonl"
    real = measured.run_program_sweep

    def failing(*a, **kw):  # the injected failure of one point, the rest run as ever
        def fail(label):
            if label == "save-nothing":
                raise RuntimeError("injected")

        return real(*a, **kw, before_policy=fail)

    monkeypatch.setattr(measured, "run_program_sweep", failing)
    argv = ["--model", MODEL, "--out", str(out), "--policy", "no-remat", "--policy",
            "save-nothing", "--warmup-steps", "0", "--timed-steps", "1", "--no-progress",
            "--no-plot"]  # fmt: skip
    assert _cli().main(argv) == 1
    rows = {r["policy"]: r for r in results.read_rows(out)}
    assert rows["no-remat"]["status"] == "ok" and rows["save-nothing"]["status"] == "error"
    assert "RuntimeError: injected" in capsys.readouterr().out
