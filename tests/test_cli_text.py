"""What the CLI prints is intact: data is never read as rich markup, tables fit the terminal
(``COLUMNS``) with every cell whole, ``--json`` stays JSON, and ``--policy`` takes one per-tag
syntax on every command (:func:`remat_kit.policies.parse_policy_arg`)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import remat_kit
from remat_kit import cli, targets
from remat_kit.cli.analyze import buffer_table
from remat_kit.cli.console import console
from remat_kit.policies import custom_spec, parse_policy_arg

_REPO = Path(__file__).resolve().parents[1]
_WS = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _WS.sub(" ", text).strip()


def _squash(text: str) -> str:
    return _WS.sub("", text)


def _column(out: str, index: int) -> str:
    """The text of one table column, its wrapped pieces joined, without whitespace (a word
    longer than the column folds mid-word; rich's box characters split the cells)."""
    pieces = []
    for line in out.splitlines():
        cells = line.split("│")
        if len(cells) > index + 1:
            pieces.append(cells[index + 1].strip())
    return _squash("".join(pieces))


@pytest.mark.parametrize("columns", [80, 120])
def test_policies_fit_the_width_with_every_description_whole(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    descriptions = _column(out, 2)
    for spec in remat_kit.policy_specs().values():
        assert _squash(spec.description) in descriptions, spec.name
    assert "[seq,seq]" in descriptions  # rich would drop it as a markup tag


def test_targets_print_every_description_whole(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["targets"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    descriptions = _column(out, 5)
    for name in targets.target_names():
        if targets.get_target(name).tpu is None:  # TPU slices: one row per generation
            assert _squash(targets.get_target(name).description) in descriptions, name
    for chip in targets.CHIPS.values():
        assert _squash(chip.description) in descriptions, chip.generation


def test_json_ignores_the_width(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "20")
    assert cli.main(["policies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["description"] for r in rows] == [
        s.description for s in remat_kit.policy_specs().values()
    ]


def _printed(renderable, width: int = 200) -> str:
    out = console()
    out.width = width
    with out.capture() as cap:
        out.print(renderable)
    return cap.get()


def test_buffer_table_keeps_shapes_intact():
    """Real shapes from a compiled step, and bracketed text that rich would take as markup."""
    (report,) = remat_kit.analyze_policies(
        remat_kit.preset("tiny-gpt", 1, 8), ["save-nothing"], target="cpu", top_k=5
    )
    fake = SimpleNamespace(nbytes=2**30, shape="f32[1,8,8192,8192]", kind="[batch, seq, d_model]",
                           phase="[seq, seq]", op_name="jit(step)/[bold]dot_general",
                           memory="host")  # fmt: skip
    report = SimpleNamespace(policy="[b, s]", peak_buffers=[*report.peak_buffers, fake])
    out = _printed(buffer_table(report))
    for b in report.peak_buffers:
        for field in (b.shape, b.kind, b.phase, b.op_name[-70:]):
            assert field in out, field
    assert "([b, s])" in out
    assert "[batch, seq, d_model] (host)" in out  # a host buffer says so


def test_parse_policy_arg_forms():
    want = custom_spec({"query_proj": "offload", "out_proj": "save"})
    assert parse_policy_arg("query_proj=offload,out_proj=save") == want
    assert parse_policy_arg(" query_proj = offload , out_proj=save ") == want
    assert parse_policy_arg('{"query_proj": "offload", "out_proj": "save"}') == want
    assert parse_policy_arg("save-dots") is remat_kit.get_policy_spec("save-dots")


@pytest.mark.parametrize(
    "text, mapping",
    [
        ('{"": "save"}', {"": "save"}),
        ("query_proj=keep", {"query_proj": "keep"}),
        ('{"query_proj": "offlod"}', {"query_proj": "offlod"}),
    ],
)
def test_parse_policy_arg_fails_as_custom_spec_does(text, mapping):
    with pytest.raises(ValueError) as expected:
        custom_spec(mapping)
    with pytest.raises(ValueError) as got:
        parse_policy_arg(text)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("save-dot", "unknown policy 'save-dot'"),
        ("query_proj=save,query_proj=offload", "given twice"),
        ('{"query_proj": "save", "query_proj": "offload"}', "given twice"),
        ("query_proj=save,", "tag=action pairs"),
        ("{query_proj: save}", "as JSON"),
        ('{"query_proj": 1}', "maps checkpoint names"),
    ],
)
def test_parse_policy_arg_bad_text_is_one_line(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        parse_policy_arg(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["analyze", "doctor", "recommend"])
def test_every_policy_option_documents_the_per_tag_syntax(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "query_proj=offload,out_proj=save" in _norm(capsys.readouterr().out)


@pytest.mark.parametrize("command", ["analyze", "doctor", "recommend"])
def test_bad_per_tag_policy_is_one_line_exit_2(capsys, command):
    args = [command, "--model", "tiny-gpt", "--seq", "8", "--policy", "query_proj=ofload"]
    assert cli.main(args + (["--batch", "1"] if command == "analyze" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "remat-kit: error: argument --policy: tag 'query_proj': unknown action 'ofload'"
    )
    assert "valid: save, offload, recompute" in err and "\n" not in err


def test_analyze_takes_a_per_tag_policy(capsys):
    args = ["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "8", "--target", "cpu"]
    assert cli.main([*args, "--policy", "query_proj=save,out_proj=save", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["reports"]
    assert report["policy"] == "custom: out_proj=save, query_proj=save"
    assert report["peak_bytes"] > 0
    assert cli.main([*args, "--policy", "query_proj=save", "--per-layer", "--json"]) == 0
    (layer,) = json.loads(capsys.readouterr().out)["per_layer"]
    assert layer["policy"] == "custom: query_proj=save"  # was: unknown policy 'custom'


def test_analyze_says_small_estimated_steps_are_least_trustworthy(capsys):
    args = ["analyze", "--model", "tiny-gpt", "--batch", "1", "--seq", "8", "--target", "local"]
    assert cli.main([*args, "--policy", "save-nothing"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table view wraps long lines
    assert "small steps (estimated" in out and "docs/time-model.md" in out


def test_the_library_never_imports_the_cli():
    for path in (_REPO / "remat_kit").rglob("*.py"):
        if "cli" in path.relative_to(_REPO / "remat_kit").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            assert not any(n == "remat_kit.cli" or n.startswith("remat_kit.cli.") for n in names), (
                path
            )
