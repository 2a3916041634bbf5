"""The docs: the site builds strictly, every ```python block of README.md and docs/ runs as
written, and the generated tables and quoted figures match the committed results.

Code blocks: each file's ```python blocks run in order in one fresh namespace per file (like a
doctest session), in an empty working folder; a block right after a ``<!-- no-run -->`` line is
skipped (it needs a GPU, or takes long). A failure names the file and the line of the block.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS = [p for p in DOCS if "figures" not in p.relative_to(ROOT).parts]
NO_RUN = "<!-- no-run -->"

sys.path.insert(0, str(ROOT / "experiments" / "tables"))
import registry  # noqa: E402

sys.path.remove(str(ROOT / "experiments" / "tables"))

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line, source, runs)`` for each ```python block: ``line`` is the 1-based line of its
    first code line; ``runs`` is False when the line before the fence is ``<!-- no-run -->``."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        start, indent = i, len(m["indent"])
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        if m["lang"] == "python":
            runs = not (start > 0 and lines[start - 1].strip() == NO_RUN)
            out.append((start + 2, "\n".join(body) + "\n", runs))
        i += 1
    return out


class BlockError(AssertionError):
    pass


def run_blocks(path: Path) -> int:
    """Run ``path``'s python blocks in one namespace; the number run. Raises :class:`BlockError`
    naming the file and line of the failing block, with its traceback."""
    # A real module, as a script would have: a dataclass (an Equinox module) defined in a block
    # looks its module up in sys.modules.
    module = types.ModuleType(f"docs_{path.stem.replace('-', '_')}")
    namespace: dict = module.__dict__
    sys.modules[module.__name__] = module
    ran = 0
    for line, source, runs in python_blocks(path.read_text()):
        if not runs:
            continue
        # Padded so the traceback's line numbers are the file's own.
        code = compile("\n" * (line - 1) + source, str(path), "exec")
        try:
            exec(code, namespace)
        except Exception as err:
            tb = traceback.format_exc(limit=-3)
            raise BlockError(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: "
                f"the python block starting here fails: {type(err).__name__}: {err}\n{tb}"
            ) from None
        ran += 1
    return ran


WITH_BLOCKS = [p for p in DOCS if any(runs for _, _, runs in python_blocks(p.read_text()))]


@pytest.mark.parametrize("path", WITH_BLOCKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_as_written(path, tmp_path, monkeypatch):
    """The pages compile the same tiny programs again and again (a reader running them one after
    another would too), and programs the other tests compile (tiny-gpt at b=2, s=64 on the CPU):
    they read and write the run's compile cache (tests/conftest.py), shared by the xdist workers
    and every test, as a user's ~/.cache/remat-kit would be."""
    monkeypatch.chdir(tmp_path)
    assert os.environ["REMAT_KIT_CACHE_DIR"] and not os.environ["REMAT_KIT_NO_CACHE"]
    assert run_blocks(path) > 0


def test_readme_has_runnable_blocks():
    assert ROOT / "README.md" in WITH_BLOCKS


def test_block_failure_names_file_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\ntext\n\n<!-- no-run -->\n```python\nraise SystemError\n"
        "```\n\n```python\ny = x + 1\nundefined_name\n```\n"
    )
    blocks = python_blocks(page.read_text())
    assert [(line, runs) for line, _, runs in blocks] == [(4, True), (11, False), (15, True)]
    with pytest.raises(BlockError, match=r"page.md:15: .*NameError: name 'undefined_name'"):
        run_blocks(page)


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)  # relative links, not URLs
    assert links, "README.md links to the docs"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == [], f"README.md links to missing files: {missing}"


def test_site_builds_strictly(tmp_path):
    """Without ``-q``: mkdocs counts the warnings ``--strict`` aborts on only where it logs
    them, so ``-q`` lets a docstring mkdocstrings cannot read pass."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "api" / "policies" / "index.html").exists()


# ---------------------------------------------------------------- generated tables and claims


def test_generated_tables_and_claims_match_committed_results(capsys):
    rc = registry.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, f"docs or an experiment docstring differ from experiments/results:\n{out}"


def test_every_registered_table_is_in_the_docs():
    text = "\n".join(p.read_text() for p in DOCS)
    for name in registry.TABLES:
        assert f'<!-- [[[cog table("{name}") ]]] -->' in text, name
        assert registry.Tables().render(name).endswith("\n")
    with pytest.raises(ValueError, match="unknown table 'no-such'; registered: sweep-cpu"):
        registry.Tables().render("no-such")


@pytest.fixture
def results_copy(tmp_path):
    """A copy of experiments/results without the figures, to tamper with."""
    dest = tmp_path / "results"
    shutil.copytree(RESULTS, dest, ignore=shutil.ignore_patterns("*.png"))
    return dest


def _edit_jsonl(path: Path, edit) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(r)) + "\n" for r in rows))


def test_tampered_table_source_fails_the_check(results_copy, capsys):
    # Like the stale per-layer figure issue 20 found: the llama3-8b no-remat compiled bytes set
    # to half the textbook figure.
    seen = {}

    def stale(row):
        if (row["block"], row["target"], row["policy"]) == ("llama3-8b", "h100-sxm", "no-remat"):
            seen.update(row)
            row["compiled_bytes"] = row["textbook_bytes"] // 2
        return row

    _edit_jsonl(results_copy / "analyze" / "per_layer.jsonl", stale)
    rc = registry.main(["--check", "--results", str(results_copy)])
    out = capsys.readouterr().out
    assert rc == 1
    textbook, compiled = (round(seen[k] / 2**20) for k in ("textbook_bytes", "compiled_bytes"))
    assert f"-| llama3-8b, b=1, s=8192 (MiB) | {textbook} / {compiled} |" in out
    assert f"+| llama3-8b, b=1, s=8192 (MiB) | {textbook} / {round(textbook / 2)} |" in out
    # The prose sentence about which side of the formula llama3-8b falls is a claim: it fails too.
    assert "llama3-8b (SwiGLU, GQA, no dropout) keeps less" in out


def test_tampered_claim_source_fails_the_check(results_copy, capsys):
    path = results_copy / "recommend" / "h100_default.json"
    rec = json.loads(path.read_text())
    rec["compiles"] = 13
    path.write_text(json.dumps(rec))
    assert registry.main(["--check", "--results", str(results_copy)]) == 1
    out = capsys.readouterr().out
    assert "experiments/bench_recommend.py: lacks '13 compiles (12 named programs" in out
