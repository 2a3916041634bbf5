"""What the CLI prints is intact: data is never read as rich markup, tables fit the terminal
(``COLUMNS``) with every cell whole, ``--json`` stays JSON, and ``--policy`` takes one per-tag
syntax on every command (:func:`remat_kit.policies.parse_policy_arg`)."""

from __future__ import annotations

import ast
import dataclasses
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


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_policies_fit_the_width_with_every_description_whole(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    descriptions = _column(out, 2)
    for spec in remat_kit.policy_specs().values():
        assert _squash(spec.description) in descriptions, spec.name
    assert "[seq,seq]" in descriptions  # rich would drop it as a markup tag


@pytest.mark.parametrize("columns", [80, 100])
def test_targets_print_every_description_whole(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["targets"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
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


# -- 100 columns: every command's terminal output, notes said once ----------------------------

_WIDTH = 100


def _fits(out: str, width: int = _WIDTH) -> None:
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= width, widest


def _whole_in_column(out: str, names) -> None:
    """Each name whole in the first column of a boxed table (not folded onto two lines)."""
    cells = {line.split("│")[1].strip().removeprefix("* ") for line in out.splitlines()
             if line.startswith("│")}  # fmt: skip
    assert set(names) <= cells, set(names) - cells


@pytest.fixture(scope="module")
def swept():
    """The committed CPU sweep's reports by table: gpt-10m on the CPU (13 policies, three that
    offload on a target that does not) and llama3-8b on an H100 (XLA's remat pass gives up)."""
    from remat_kit.memory.report import MemoryReport
    from remat_kit.sweep import results

    rows = results.read_rows(_REPO / "experiments" / "results" / "cpu" / "sweep.jsonl", False)
    tables: dict = {}
    for r in rows:
        if r["status"] == "ok":
            tables.setdefault((r["model"], r["target"], r["seq_len"]), []).append(r)
    return {
        key: ([r["policy"] for r in group], [MemoryReport.from_dict(r["report"]) for r in group])
        for key, group in tables.items()
    }


@pytest.mark.parametrize("key", [("gpt-10m", "local", 128), ("llama3-8b", "h100-sxm", 4096)])
def test_analyze_fits_100_columns_with_each_note_once(monkeypatch, capsys, swept, key):
    """Rendered as the terminal gets it at COLUMNS=100 (analyze printed policy names folded,
    the same sentence three times and XLA's 530-character warnings whole)."""
    from remat_kit.cli.analyze import print_reports

    monkeypatch.setenv("COLUMNS", str(_WIDTH))
    labels, reports = swept[key]
    model, target, seq = key
    program = remat_kit.preset(model, reports[0].batch_size, seq)
    args = SimpleNamespace(batch=reports[0].batch_size, seq=seq, budget=None, buffers=None)
    specs = [remat_kit.get_policy_spec(label) for label in labels]
    print_reports(program, targets.get_target(target), args, reports, [], specs)
    out = capsys.readouterr().out
    _fits(out)
    _whole_in_column(out, labels)
    flat = _norm(out)
    if target == "local":  # three offloading policies, one sentence
        assert flat.count("does not offload") == 1
        assert "offload-to-host, offload-layer-inputs, offload-qkv-proj: target 'local'" in flat
    else:  # XLA's message in one line (the report keeps it whole)
        assert any("Can't reduce memory use below" in w for r in reports for w in r.warnings)
        assert "Can't reduce" not in flat
        assert "XLA's remat pass missed its own 62.37GiB target (its scheduler's planning" in flat
        assert flat.count("missed its own 62.37GiB target") == 1  # said once, for every policy


def test_doctor_fits_100_columns_and_says_a_shared_cause_once(monkeypatch, capsys):
    from remat_kit.cli.doctor import _print
    from remat_kit.doctor.findings import Finding

    monkeypatch.setenv("COLUMNS", str(_WIDTH))
    cause = "XLA:CPU compiles offloads as plain copies (host memory is device memory)."
    fix = "analyze offload policies on a GPU target (e.g. --target h100-sxm)."
    labels = remat_kit.policy_names()
    findings = [
        [Finding("offload-ignored", "info", f"target 'local' ignores host offload: the 32.00 KiB "
                 f"that policy {p!r} offloads are counted as device memory.", cause, fix)]
        if p.startswith("offload") else []
        for p in labels
    ]  # fmt: skip
    _print(SimpleNamespace(json=False), labels, findings, ["a note"])
    out = capsys.readouterr().out
    _fits(out)
    flat = _norm(out)
    assert flat.count(cause) == 1 and flat.count("[cause 1]") == 3
    assert f"no finding: {', '.join(p for p in labels if not p.startswith('offload'))}" in flat
    assert flat.count("error:") == 0 and "note: a note" in flat


def test_recommend_fits_100_columns_with_candidate_names_whole(monkeypatch, capsys):
    from remat_kit.cli.recommend import print_recommendation
    from remat_kit.recommend import Recommendation
    from remat_kit.recommend.session import Candidate

    monkeypatch.setenv("COLUMNS", str(_WIDTH))
    names = remat_kit.policy_names()

    def candidate(i, policy, **kw):
        return Candidate(
            policy=policy, actions=None, remat_group_size=1, batch_size=2, seq_len=64,
            peak_bytes=(4 + i % 5) * 2**20, host_bytes=2**20 if "offload" in policy else 0,
            flops=1e9, flops_no_remat=1e9, compute_s=1.4e-3, transfer_s=1e-5, step_time_s=1.41e-3,
            tokens_per_s=90_000.0, fits=i % 5 < 2, found_by="named", model="tiny-gpt", **kw,
        )  # fmt: skip

    cands = [candidate(i, p) for i, p in enumerate(names)]
    cands += [candidate(0, "save-dots-except-mlp", remat_layers=3)]  # found by partial-layers
    cands[-1] = dataclasses.replace(cands[-1], found_by="partial-layers")
    rec = Recommendation(
        model="tiny-gpt", target="h100-sxm", seq_len=64, batch_size=2, optimizer="adamw",
        budget_bytes=6 * 2**20, budget_note="given", arguments={"params": 2**20},
        pick=cands[-1], candidates=tuple(cands), largest_batch=(), compiles=14, reused=0,
        wall_s=1.0, advice=(), notes=("a note " * 30,), solve=None, peak_flops=1e15,
        host_link_bytes_per_s=64e9, host_link="64 GB/s",
    )  # fmt: skip
    print_recommendation(rec)
    out = capsys.readouterr().out
    code = rec.line().partition("  # ")[0]
    _fits(out.replace(code, ""))  # the code to paste stays one line, whatever its length
    assert code in out.splitlines()
    _whole_in_column(out, names)
