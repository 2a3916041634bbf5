"""``analyze`` on a user's own program (tests/user_models/plain_jax.py, tags attn_in, attn_out,
mlp_hidden): the default policy set acts on its own tags, policies that act the same compile
once and are reported as the same program, the offload comparison only where an emitted tag is
offloaded, residuals by its tags in the text output, XLA's remat said once, a short repr."""

import argparse
import contextlib
import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import pytest

import remat_kit
from remat_kit import Program, targets
from remat_kit.cli import analyze as cli_analyze
from remat_kit.cli import main as cli_main
from remat_kit.memory import runner
from remat_kit.memory.programs import program_policies
from remat_kit.memory.report import same_program_as
from remat_kit.policies import get_policy_spec, policy_label
from remat_kit.units import MIB, in_unit
from tests.conftest import needs_cuda_plugin
from tests.user_models import plain_jax

REF = "tests/user_models/plain_jax.py:program"
SKIPPED = ("save-layer-inputs", "save-qkv-proj", "save-out-proj", "save-qkv-out-proj",
           "save-dots-except-mlp", "minimal", "offload-to-host", "offload-layer-inputs",
           "offload-qkv-proj")  # fmt: skip


@contextlib.contextmanager
def counting_compiles():
    """Yields the list of compiles the engine runs meanwhile (one per distinct program)."""
    seen = []
    real = runner.compile_with_dump

    def counting(lowered, platform, what, *args, **kwargs):
        seen.append(what)
        return real(lowered, platform, what, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "compile_with_dump", counting)
        yield seen


def test_default_set_acts_on_the_programs_own_tags():
    program = plain_jax.program()
    chosen = program_policies(program, "h100-sxm")
    assert chosen.tags == frozenset(plain_jax.TAGS)
    assert [policy_label(s) for s in chosen.specs] == [
        "no-remat", "save-nothing", "save-dots", "save-dots-no-batch",
        "custom: attn_in=save", "custom: attn_out=save", "custom: mlp_hidden=save",
        "custom: attn_in=save, attn_out=save, mlp_hidden=save",
        "custom: attn_in=offload, attn_out=offload, mlp_hidden=offload",
    ]  # fmt: skip
    skipped = [n for n in chosen.notes if n.startswith("not compiled on")]
    assert len(skipped) == 1 and all(name in skipped[0] for name in SKIPPED)
    # No host offload on the CPU: no offloading spec; two single-tag specs at most: said.
    cpu = program_policies(program, "cpu", max_single=2)
    assert not any(s.offloads for s in cpu.specs)
    assert any("does not offload" in n for n in cpu.notes)
    assert [policy_label(s) for s in cpu.specs[4:6]] == ["custom: attn_in=save",
                                                        "custom: attn_out=save"]  # fmt: skip
    assert any("first 2 only" in n and "mlp_hidden" in n for n in cpu.notes)
    # Asked policies are kept as asked.
    assert program_policies(program, "cpu", ["minimal"]).specs == (get_policy_spec("minimal"),)


def test_a_program_without_tags_gets_the_kind_based_policies_and_a_note():
    def make_loss(policy):
        body = (lambda w, x: jnp.tanh(x @ w)) if policy is None else jax.checkpoint(
            lambda w, x: jnp.tanh(x @ w), policy=policy)  # fmt: skip
        return lambda w, x: body(w, x).sum()

    program = Program.from_loss(make_loss, jnp.ones((4, 4)), jnp.ones((2, 4)), name="untagged")
    chosen = program_policies(program, "h100-sxm")
    assert [s.name for s in chosen.specs] == [
        "no-remat",
        "save-nothing",
        "save-dots",
        "save-dots-no-batch",
    ]
    assert any("emits no checkpoint_name tags" in n for n in chosen.notes)


def test_specs_equal_on_the_emitted_tags_lower_to_one_program():
    """The ground for compiling them once: the same StableHLO text."""
    program = plain_jax.program()

    def text(name):
        pure = program.step(get_policy_spec(name))
        return jax.jit(pure.fn).lower(*pure.args).as_text()

    assert text("minimal") == text("save-nothing") == text("offload-to-host")


@pytest.fixture(scope="module")
def default_run():
    program = plain_jax.program()
    chosen = program_policies(program, "h100-sxm")
    with counting_compiles() as compiled:
        results = remat_kit.analyze_policies(program, target="h100-sxm", top_k=0)
    return program, chosen, results, compiled


@needs_cuda_plugin
def test_default_analyze_compiles_each_distinct_program_once(default_run):
    _, chosen, results, compiled = default_run
    assert [r.policy for r in results] == [s.name for s in chosen.specs]
    # 9 programs; the offloading one's on-device twin is the every-name=save one: no compile.
    assert len(compiled) == 9, compiled
    assert len({r.program_sha256 for r in results}) == len(results) == 9
    assert same_program_as(results) == [None] * 9
    offloaders = [r for r in results if r.peak_bytes_without_offload is not None]
    assert [r.host_bytes > 0 for r in offloaders] == [True]


@needs_cuda_plugin
def test_text_output_of_a_program_at_80_columns(default_run, monkeypatch, capsys):
    program, chosen, results, _ = default_run
    monkeypatch.setenv("COLUMNS", "80")
    args = argparse.Namespace(budget=None, buffers=0)
    cli_analyze.print_reports(program, targets.get_target("h100-sxm"), args, results, [],
                              chosen.specs, chosen)  # fmt: skip
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "same program" not in out and out.count("not compiled on") == 1
    assert "runs as save-nothing" not in out
    assert out.count("offloading lowers") + out.count("offloading does not") == 1
    # Residuals by the program's own tags, in the text: the mlp_hidden=save row keeps
    # mlp_hidden (float32 [batch, seq, d_ff] per layer) on device, the offload row on host.
    table = out[out.index("residuals by checkpoint name") :]
    assert "bytes in MiB" in table
    for header in (*plain_jax.TAGS, "untagged"):
        assert header in table
    own = results[6]
    kept = sum(t.nbytes for t in own.residuals if t.tag == "mlp_hidden")
    assert kept == plain_jax.L * 2 * 32 * plain_jax.F * 4
    row = next(line for line in table.splitlines() if "custom: mlp_hidden=save" in line)
    untagged = sum(t.nbytes for t in own.residuals if t.tag not in plain_jax.TAGS)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells == ["custom: mlp_hidden=save", "-", "-", in_unit(kept, MIB, 2),
                     in_unit(untagged, MIB, 2)]  # fmt: skip
    assert "host" in next(line for line in table.splitlines() if "every name=offload" in line)


def test_cli_program_with_asked_policies_json(capsys):
    argv = ["analyze", "--model", REF, "--policy", "save-nothing", "--policy", "minimal",
            "--target", "cpu", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    nothing, minimal = out["reports"]
    assert out["checkpoint_names"] == sorted(plain_jax.TAGS) and out["notes"] == []
    assert minimal["program_sha256"] == nothing["program_sha256"] is not None
    assert minimal["policy"] == "minimal" and out["labels"] == ["save-nothing", "minimal"]


@needs_cuda_plugin
def test_xla_remat_said_once():
    """A 3 MB H100: XLA's own remat pass fires; one sentence says what it recomputed (with the
    policy's own figures), not two."""
    small = dataclasses.replace(
        targets.get_target("h100-sxm"), name="h100-3mb", memory_bytes=3_000_000
    )
    (r,) = remat_kit.analyze_policies(plain_jax.program(), ["no-remat"], target=small, top_k=0)
    assert r.policy_only is not None
    said = [w for w in r.warnings if "instruction" in w and "recomputed" in w]
    assert len(said) == 1 and said[0].startswith("XLA recomputed"), r.warnings


def test_program_repr_is_short():
    text = repr(plain_jax.program())
    assert len(text) < 200, text
    assert text.startswith("Program('plain-jax'") and "tokens: int32[2, 33]" in text
    assert "params: (6 arrays float32" in text and "donate_argnums=(0, 1)" in text
    assert "loss=yes" in text and "ShapeDtypeStruct" not in text


@needs_cuda_plugin
def test_residual_table_splits_many_tags_to_fit_80_columns(default_run):
    """Seven tags and untagged: two tables of four columns, each within 80 columns."""
    from rich.console import Console

    from remat_kit.walker import TagResiduals

    tags = frozenset(f"tag_number_{i}" for i in range(7))
    rows = tuple(TagResiduals(t, 1, (4, 1024), "float32", "device", (i + 1) * 2**20)
                 for i, t in enumerate(sorted(tags)))  # fmt: skip
    report = dataclasses.replace(default_run[2][0], residuals=rows)
    tables = cli_analyze.residual_tag_tables([report], ["mine"], tags)
    assert [len(t.columns) for t in tables] == [5, 5]  # policy + 4 columns each
    console = Console(width=80, record=True, file=io.StringIO())
    for t in tables:
        console.print(t)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "tag_number_6" in text and "7.00" in text and "(2/2)" in text
