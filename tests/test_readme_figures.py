"""README figures (and experiment docstrings' "Expected: ...") agree with the committed results.

Runs experiments/readme_figures.py in-process: reads JSON and Markdown only, no JAX compile.
"""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def _load():
    spec = importlib.util.spec_from_file_location(
        "readme_figures", ROOT / "experiments" / "readme_figures.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


rf = _load()


@pytest.fixture
def results_copy(tmp_path):
    """A copy of experiments/results without the figures, to tamper with."""
    dest = tmp_path / "results"
    shutil.copytree(RESULTS, dest, ignore=shutil.ignore_patterns("*.png"))
    return dest


def _edit_jsonl(path: Path, edit) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(r)) + "\n" for r in rows))


def _edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_readme_and_docstrings_match_committed_results(capsys):
    rc = rf.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, f"README or an experiment docstring differs from experiments/results:\n{out}"
    assert out == ""


def test_every_registered_section_is_in_the_readme():
    text = (ROOT / "README.md").read_text()
    for name, section in rf.SECTIONS.items():
        assert (
            f"<!-- generated: {name} (from " in text and f"<!-- end generated: {name} -->" in text
        )
        assert section.render(rf.Results(RESULTS)).endswith("\n")


def test_tampered_table_source_fails_the_check(results_copy, capsys):
    # Like the stale per-layer figure issue 20 found (13,502 MiB where per_layer.jsonl said
    # 9,534): the llama3-8b no-remat compiled bytes set to half the textbook figure.
    seen = {}

    def stale(row):
        if (
            row["block"] == "llama3-8b"
            and row["target"] == "h100-sxm"
            and row["policy"] == "no-remat"
        ):
            seen.update(row)
            row["compiled_bytes"] = row["textbook_bytes"] // 2
        return row

    _edit_jsonl(results_copy / "analyze" / "per_layer.jsonl", stale)
    rc = rf.main(["--check", "--results", str(results_copy)])
    out = capsys.readouterr().out
    assert rc == 1
    textbook, compiled = (round(seen[k] / 2**20) for k in ("textbook_bytes", "compiled_bytes"))
    assert f"-| llama3-8b, b=1, s=8192 (MiB) | {textbook} / {compiled} |" in out
    assert f"+| llama3-8b, b=1, s=8192 (MiB) | {textbook} / {round(textbook / 2)} |" in out
    # The prose sentence about which side of the formula llama3-8b falls is a claim: it fails too.
    assert "llama3-8b (SwiGLU, GQA, no dropout) keeps less" in out


def test_tampered_claim_source_fails_the_check(results_copy, capsys):
    def more_compiles(rec):
        rec["compiles"] = 13
        return rec

    _edit_json(results_copy / "recommend" / "h100_default.json", more_compiles)
    rc = rf.main(["--check", "--results", str(results_copy)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "experiments/bench_recommend.py: lacks '13 compiles (11 named programs" in out
    # the README's span of compiles over the three runs, with h100_default's set to 13
    runs = ("h100_default", "h200_solve", "h100_adafactor_solve")
    counts = [13, *(json.loads((results_copy / "recommend" / f"{r}.json").read_text())["compiles"]
                    for r in runs[1:])]  # fmt: skip
    assert f"README.md: lacks '{min(counts)}–{max(counts)} compiles against the goal" in out


def test_rewrite_restores_a_mangled_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    good = (ROOT / "README.md").read_text()
    readme.write_text(good.replace("| 8 | 32.89 | 5.61 |", "| 8 | 30.00 | 5.61 |"))
    assert rf.main(["--check", "--readme", str(readme)]) == 1
    assert "30.00" in capsys.readouterr().out
    assert rf.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == good


def test_markers_must_match_the_registry():
    results = rf.Results(RESULTS)
    with pytest.raises(ValueError, match="'no-such-table' is not registered"):
        rf.rewrite(
            "<!-- generated: no-such-table -->\nx\n<!-- end generated: no-such-table -->\n", results
        )
    with pytest.raises(ValueError, match="has no markers for section"):
        rf.rewrite("no markers here\n", results)


def test_formatting_helpers():
    fmt = sys.modules["readme_format"]
    assert fmt.pct(57, 100) == "\u221243%" and fmt.pct(103, 100) == "+3%"
    assert fmt.pct(100.2, 100) == "0%"
    assert fmt.span([1.226, 1.231]) == "1.23" and fmt.span([1.017, 1.033]) == "1.02\u20131.03"
    assert fmt.sci(7.152557373046875e-07) == "7.2e-7" and fmt.order_of(5.4e-7) == "1e-6"
