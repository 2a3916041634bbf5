"""The ``remat-kit`` command: bad input fails in one line with exit code 2, through
``cli.main`` and, for two inputs, in a ``python -m remat_kit.cli`` subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remat_kit import cli

_REPO = Path(__file__).resolve().parents[1]
_ANALYZE = ["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "8", "--target", "cpu"]

#: (arguments, text the one-line error must contain)
BAD_INPUTS = [
    (["analyze", "--model", "llama9-8b", "--batch", "1", "--seq", "8"], "unknown preset"),
    ([*_ANALYZE[:-1], "h100"], "unknown target 'h100'"),
    ([*_ANALYZE, "--policy", "save-everything"], "unknown policy 'save-everything'"),
    (["analyze", "--model", "tiny-gpt", "--batch", "0", "--seq", "8"], "positive integer"),
    (["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "-5"], "positive integer"),
    ([*_ANALYZE, "--budget", "eighty"], "cannot read 'eighty' as a size"),
    # a value starting with "-" that is not a plain number still reaches the check naming it
    ([*_ANALYZE, "--budget", "-5GiB"], "'-5GiB'"),
    ([*_ANALYZE, "--seq", "4096"], "raise max_seq_len: --set max_seq_len=4096"),
    ([*_ANALYZE, "--policy", "save-nothing", "--all-policies"], "not both"),
    (["analyse"], "invalid choice"),
]


def _run(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(_REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "remat_kit.cli", *args],
        cwd=_REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


#: The bad inputs also run as ``python -m remat_kit.cli`` processes (what a fresh interpreter
#: writes besides the error: nothing; each process pays JAX's import, ~3 CPU seconds): one
#: refused by the argument parser, one by the model's config after the preset is built.
IN_A_PROCESS = ("invalid choice", "raise max_seq_len: --set max_seq_len=4096")


@pytest.fixture(scope="module")
def bad_runs():
    """The bad inputs of :data:`IN_A_PROCESS`, run at once: {needle: (code, stdout, stderr)}."""
    procs = [(needle, _run(args)) for args, needle in BAD_INPUTS if needle in IN_A_PROCESS]
    results = {}
    for needle, proc in procs:
        out, err = proc.communicate(timeout=180)
        results[needle] = (proc.returncode, out, err)
    return results


def _main_in_this_process(args: list[str], capfd) -> tuple[int, str, str]:
    """``cli.main(args)``: exit code (argparse's SystemExit too), stdout, stderr (file
    descriptors 1 and 2: what C++ code writes as well)."""
    try:
        code = cli.main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=[n for _, n in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(bad_runs, case, capfd):
    args, needle = BAD_INPUTS[case]
    runs = [_main_in_this_process(args, capfd)]
    if needle in IN_A_PROCESS:
        runs.append(bad_runs[needle])
    for returncode, out, err in runs:
        lines = [line for line in err.splitlines() if line.strip()]
        assert returncode == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("remat-kit: error: "), err
        assert needle in lines[0] and "Traceback" not in err, err
        assert out == ""


def test_a_program_file_python_cannot_parse_is_one_line_exit_2(tmp_path, capfd):
    """A user's file with a syntax error printed a traceback through remat-kit's loader and
    exited 1 (an Equinox user's trial): it is bad input, said where, in one line."""
    broken = tmp_path / "broken.py"
    broken.write_text("import jax\ndef program(:\n    pass\n")
    for command in ("analyze", "doctor"):
        code, out, err = _main_in_this_process([command, "--model", f"{broken}:program"], capfd)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("remat-kit: error: cannot load ")
        assert f"SyntaxError in {broken}, line 2" in lines[0]


def test_a_sequence_over_max_seq_len_says_how_to_raise_it_where_it_was_set():
    """The message once said "override max_seq_len", not how: each entry says it in its own
    terms (the command line's through SeqLenError.with_how, tested above)."""
    import remat_kit
    from remat_kit.sweep import Grid, SweepConfig, validate

    how = {
        'get_config("tiny-gpt", max_seq_len=4096)': lambda: remat_kit.preset("tiny-gpt", 1, 4096),
        "overrides={'max_seq_len': 4096} in the grid": lambda: validate(SweepConfig(
            "s", (Grid("g", models=("tiny-gpt",), policies=("no-remat",),
                       batch_sizes=(1,), seq_lens=(4096,)),))),
    }  # fmt: skip
    for fix, make in how.items():
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value).endswith(f"use a shorter sequence or raise max_seq_len: {fix}")
    config = remat_kit.get_config("tiny-gpt")
    tokens = __import__("jax").numpy.zeros((1, 4096), "int32")
    with pytest.raises(ValueError, match=r"raise max_seq_len: config.replace\(max_seq_len=4096\)"):
        remat_kit.Transformer(config).init(__import__("jax").random.key(0), tokens)


@pytest.mark.parametrize("command", ["analyze", "doctor", "recommend"])
def test_an_unknown_target_is_one_short_line_on_every_command(command, capfd):
    """It listed every TPU slice size (~450 characters): now the GPU and CPU targets, the TPU
    generations with example slices, and the closest name."""
    code, out, err = _main_in_this_process(
        [command, "--model", "tiny-gpt", "--seq", "8", "--target", "h100"], capfd
    )
    (line,) = err.splitlines()
    assert code == 2 and out == "" and len(line) < 250, line
    assert line.startswith("remat-kit: error: argument --target: unknown target 'h100'; valid: ")
    assert "h100-sxm, h200, a100-80gb" in line and "v5p-N, v6e-N (e.g. v5p-8, v6e-256" in line
    assert line.endswith("Did you mean 'h100-sxm'?") and "17920" not in line


def test_every_process_case_is_a_bad_input():
    assert set(IN_A_PROCESS) <= {needle for _, needle in BAD_INPUTS}


@pytest.mark.parametrize("text", ["80GB", "80GiB", "8e10", "512 MiB", "1.5TB", "100"])
def test_budget_sizes_accepted(text):
    expected = {
        "80GB": 80 * 10**9, "80GiB": 80 * 2**30, "8e10": 8 * 10**10, "512 MiB": 512 * 2**20,
        "1.5TB": 15 * 10**11, "100": 100,
    }  # fmt: skip
    assert cli.parse_bytes(text) == expected[text]


@pytest.mark.parametrize("text", ["eighty", "80XB", "-5GB", "0", "GiB", ""])
def test_budget_sizes_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_bytes(text)


@pytest.mark.parametrize("n", [4_112_192, 3 * 2**20, 3 * 2**20 + 1, 2**30 - 1, 1023, 1023.5, 77])
def test_a_size_offered_as_a_budget_is_rounded_up_and_holds_it(n):
    """A peak offered as a budget ("a budget of X fits it") is rounded up at the digits shown,
    so that copying it fits: 4,112,192 B printed "3.92 MiB" (4,110,417 B, 1.7 KiB short)."""
    from remat_kit.units import format_bytes, parse_bytes

    offered = format_bytes(n, up=True)
    assert parse_bytes(offered.replace(" ", "")) >= n
    assert parse_bytes(offered.replace(" ", "")) - n < max(0.01 * n, 1)  # no more than shown
    assert format_bytes(4_112_192, up=True) == "3.93 MiB" and format_bytes(4_112_192) == "3.92 MiB"


@pytest.mark.parametrize(("text", "fix"), [("4Mb", "4MB or 4MiB"), ("40Gib", "40GB or 40GiB"),
                                           ("1Tb", "1TB or 1TiB")])  # fmt: skip
def test_a_size_in_bits_is_refused_naming_the_bytes(text, fix):
    """``4Mb`` is megabits by convention: refused with the byte spellings (it was read as 4 MB);
    all-lowercase ``40gib`` and ``4kb`` stay bytes (nothing capitalised says bits)."""
    with pytest.raises(argparse.ArgumentTypeError, match=f"lowercase b .* is bits; write {fix}"):
        cli.parse_bytes(text)
    assert cli.parse_bytes("40gib") == 40 * 2**30 and cli.parse_bytes("4kb") == 4000


@pytest.mark.parametrize("text", ["-5GB", "-1", "0", "-0.5MiB"])
def test_a_size_that_is_not_positive_is_told_so(text):
    """A negative size is read as a number and said to be not positive (it was 'cannot read
    '-5MiB' as a size', as if the syntax were wrong)."""
    with pytest.raises(argparse.ArgumentTypeError, match=f"size must be positive, got '{text}'"):
        cli.parse_bytes(text)


def test_analyze_json_and_budget_through_the_cli():
    proc = _run([*_ANALYZE, "--policy", "save-nothing", "--budget", "1MiB", "--json"])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    data = json.loads(out)
    (report,) = data["reports"]
    assert report["policy"] == "save-nothing" and report["target"] == "cpu"
    assert report["budget_bytes"] == 2**20 and report["fits"] == (report["peak_bytes"] <= 2**20)
    assert data["errors"] == []


def test_policies_and_targets_list_what_exists(capsys):
    import remat_kit
    from remat_kit import targets

    assert cli.main(["policies", "--json"]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)]
    assert names == remat_kit.policy_names()
    assert cli.main(["targets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == targets.target_names()
    assert cli.main(["targets"]) == 0 and "h100-sxm" in capsys.readouterr().out


def test_compile_failure_is_one_line_exit_1(monkeypatch, capsys, fresh_compile_cache):
    from remat_kit.memory import xla_compile as mc

    def fail(lowered, platform, what, fast=True, options=None):
        raise mc.CompileError(what, "INTERNAL: ptxas exited with status 1")

    monkeypatch.setattr("remat_kit.memory.runner.compile_with_dump", fail)
    code = cli.main([*_ANALYZE, "--policy", "save-dots"])
    err = capsys.readouterr().err
    assert code == 1
    assert (
        "remat-kit: error: policy 'save-dots' of 'tiny-gpt' on target 'cpu' failed to compile: "
        "INTERNAL: ptxas exited with status 1"
    ) in err


_REFUSED = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (26.05G) exceeds available HBM (15.75G)."
)


def test_a_step_refused_as_over_memory_is_a_row_that_does_not_fit(monkeypatch, capsys):
    """XLA:TPU refuses a step over HBM where a GPU target compiles it and reports a peak over
    memory: it is the same answer, a row with fits False (peak null, never 0), exit 0, in the
    JSON and the table; another failure stays an error (exit 1). The analysis is faked: a real
    refusal takes ~10 s (tiny-gpt, d_model 1024, b=1024, s=128 on v5e-1), tracing alone ~3 s."""
    from remat_kit.memory import CompileError

    def refuse(program, specs, **kwargs):
        return [
            CompileError(
                f"policy {s.name!r}", _REFUSED if s.name == "no-remat" else "INTERNAL: boom"
            )
            for s in specs
        ]

    monkeypatch.setattr("remat_kit.cli.analyze.analyze_policies", refuse)
    argv = [*_ANALYZE, "--policy", "no-remat"]
    assert cli.main([*argv, "--json"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    ((row,),) = [out["reports"]]
    assert out["labels"] == ["no-remat"] and out["errors"] == [] and printed.err == ""
    assert row["fits"] is False and row["peak_bytes"] is None and row["flops"] is None
    assert row["policy"] == "no-remat" and row["name"] == "tiny-gpt b=1 s=8"
    assert row["warnings"] == [
        "does not fit: XLA refused to compile the step (26.05G of HLO temporaries against "
        f"15.75G of HBM): {_REFUSED}"
    ]
    from remat_kit.memory.report import MemoryReport

    assert set(row) == {f.name for f in __import__("dataclasses").fields(MemoryReport)}
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "over memory" in printed.out and printed.err == ""
    assert "no-remat: does not fit cpu: XLA refused to compile it (26.05G of HLO temporaries" in (
        " ".join(printed.out.split())
    )
    assert cli.main([*argv, "--policy", "save-nothing", "--json"]) == 1  # a failure
    printed = capsys.readouterr()
    assert [e["error"] for e in json.loads(printed.out)["errors"]] == ["INTERNAL: boom"]


def test_doctor_compile_failure_is_one_line_exit_1(monkeypatch, capsys, fresh_compile_cache):
    """XLA failing to compile the step is said in one line by the doctor too (no traceback)."""
    from remat_kit.memory import xla_compile as mc

    def fail(lowered, platform, what, fast=True, options=None):
        raise mc.CompileError(what, "INTERNAL: Couldn't find output tile sizes")

    monkeypatch.setattr("remat_kit.memory.runner.compile_with_dump", fail)
    code = cli.main(["doctor", "--model", "tiny-gpt", "--batch", "1", "--seq", "16",
                     "--target", "cpu", "--policy", "save-nothing"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("remat-kit: error: ") and "output tile sizes" in err[0]


@pytest.mark.parametrize(
    ("command", "says"),
    [("doctor", ["(presets; default 2)", "(presets; default 64)"]),
     ("analyze", ["sequences per step (presets; required for them)",
                  "tokens per sequence (presets; required for them)"])],
)  # fmt: skip
def test_help_says_what_a_preset_gets_without_batch_and_seq(command, says, capsys):
    """The doctor checks a preset at batch 2, seq 64 when not given; its help said both were
    required (newcomer trial). analyze does require them."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(s in text for s in says), text


def test_buffers_says_it_shows_one_policy(capsys):
    """``--buffers 6`` with two policies printed nothing and ``--help`` did not say why (s20
    user trial): the table is one policy's; with several it now says so."""
    code = cli.main([*_ANALYZE, "--policy", "save-dots", "--policy", "save-nothing",
                     "--buffers", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "--buffers shows the buffers of one policy: give one --policy (analysed 2)" in out
    assert cli.main([*_ANALYZE, "--policy", "save-dots", "--buffers", "3"]) == 0
    one = capsys.readouterr().out
    assert "largest buffers live at XLA's peak (save-dots)" in one and "--buffers shows" not in one


def test_analyze_header_gives_the_shape_of_a_preset_from_a_factory(tmp_path, monkeypatch, capsys):
    """A factory returning a preset printed "batch=None seq=None" (newcomer trial): the header
    read the flags, which a program does not take; it reads the program's own shape."""
    (tmp_path / "mymodel.py").write_text(
        "import remat_kit\n\ndef make():\n    return remat_kit.preset('tiny-gpt', 2, 32)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["analyze", "--model", "mymodel.py:make", "--policy", "save-nothing"]) == 0
    assert "tiny-gpt, batch=2 seq=32, on local" in " ".join(capsys.readouterr().out.split())
