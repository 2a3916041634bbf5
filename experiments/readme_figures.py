"""README figures from the committed results files: regenerate them, or check them.

Every figure README.md quotes from ``experiments/results/**`` is either inside a *generated
section*, rewritten from the results files by this script, or a *claim*: a short text rendered
from the results that must appear (whitespace-insensitive) in README.md or in an experiment's
docstring ("Expected: ..."). The results files are the truth: when a re-run changes them, run this
script and the tables follow; a claim in prose that no longer holds is reported, to be fixed by
hand.

Command::

    python experiments/readme_figures.py           # rewrite README.md's generated sections
    python experiments/readme_figures.py --check   # exit 1 and print a diff if anything differs

A generated section in README.md::

    <!-- generated: per-layer (from experiments/results/analyze/per_layer.jsonl) -->
    ...                                  (everything here is rewritten)
    <!-- end generated: per-layer -->

The "(from ...)" part of the opening marker is rewritten too.

To add a section: in ``experiments/readme_sections.py`` write ``def my_table(r: Results) -> str``
returning the markdown, ending in a newline (``r.json("sub/file.json")``, ``r.jsonl(...)`` and
``r.text(...)`` read files under the results folder); add
``Section("my-table", ("sub/file.json",), S.my_table)`` to ``SECTIONS`` below; put the two markers,
with nothing between them, where the table belongs in README.md; run this script.

To check figures in prose instead: write ``def my_claims(r: Results) -> list[str]`` returning the
exact words the file must contain, and add ``Claims(PATH, ("sub/file.json",), S.my_claims)`` to
``CLAIMS`` below; ``PATH`` is README.md or any file under the repository root (the experiments'
docstrings: their renderers are in ``experiments/readme_docstrings.py``).
``experiments/readme_format.py`` holds the reader and README's number formats (``pct``, ``span``,
``sci``, ``table``, ``wrap``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

# The sibling modules, whether this runs as a script or is loaded by path (tests); sys.path is
# left as it was, so experiments/*.py do not shadow other modules afterwards.
_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
try:
    import readme_docstrings as D
    import readme_features as F
    import readme_sections as S
    from readme_format import RESULTS, ROOT, Claims, Results, Section
finally:
    sys.path.remove(_HERE)

# ---------------------------------------------------------------- registry

#: README sections by name; see the module docstring to add one.
SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section("sweep-cpu", (S.SWEEP, S.SWEEP_SUMMARY), S.sweep_cpu),
        Section("analyze", (S.ANALYZE,), S.analyze_table),
        Section("per-layer", (S.PER_LAYER,), S.per_layer_table),
        Section("recommend", S.RECOMMEND_RUNS, S.recommend_table),
        Section("sharding", (S.SHARDING,), S.sharding_table),
        Section("train-demos", S.TRAIN, S.train_demos),
        Section("timeline", (F.TIMELINE,), F.timeline_table),
        Section("structure", F.STRUCTURE, F.structure_table),
        Section("chen", (F.CHEN,), F.chen_table),
        Section("soak", (F.SOAK,), F.soak_table),
        Section("own-model", (F.OWN_MODEL,), F.own_model_table),
        Section("recommend-structure", F.RECOMMEND_STRUCTURE, F.recommend_structure_table),
        Section("options", (F.OPTIONS,), F.options_table),
    )
}


#: Figures checked in prose, README and the experiments' docstrings.
CLAIMS: tuple[Claims, ...] = (
    Claims("README.md", (S.SWEEP, S.SWEEP_SUMMARY), S.sweep_claims_readme),
    Claims("README.md", (S.ANALYZE, S.ANALYZE_BENCH, S.ANALYZE_RUNS), S.analyze_claims),
    Claims("README.md", (S.PER_LAYER,), S.per_layer_claims),
    Claims("README.md", (*S.RECOMMEND_RUNS, S.RECOMMEND_BENCH), S.recommend_claims),
    Claims("README.md", (S.SHARDING,), S.sharding_claims),
    Claims("experiments/configs/cpu.py", (S.SWEEP, S.SWEEP_SUMMARY), D.sweep_claims_cpu_doc),
    Claims("experiments/bench_analyze.py", (S.ANALYZE, S.PER_LAYER), D.analyze_claims_doc),
    Claims("experiments/bench_recommend.py", (S.RECOMMEND_RUNS[0],), D.recommend_claims_doc),
    Claims("experiments/train_demos.py", S.TRAIN, D.train_claims_doc),
)


# ---------------------------------------------------------------- rewrite and check

MARKER = re.compile(
    r"<!-- generated: (?P<name>[\w-]+)(?: \(from [^)]*\))? -->\n"
    r"(?P<body>.*?)<!-- end generated: (?P=name) -->",
    re.DOTALL,
)


def rewrite(text: str, results: Results) -> str:
    """``text`` with every generated section re-rendered from ``results``.

    Raises:
        ValueError: a marker names no registered section, or a registered section has no marker.
    """
    found: list[str] = []

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in SECTIONS:
            raise ValueError(
                f"README section {name!r} is not registered; registered: {', '.join(SECTIONS)}"
            )
        found.append(name)
        section = SECTIONS[name]
        sources = ", ".join(f"experiments/results/{s}" for s in section.sources)
        body = section.render(results)
        return f"<!-- generated: {name} (from {sources}) -->\n{body}<!-- end generated: {name} -->"

    out = MARKER.sub(one, text)
    missing = [n for n in SECTIONS if n not in found]
    if missing:
        raise ValueError(f"README has no markers for section(s) {', '.join(missing)}")
    return out


def _squash(text: str) -> str:
    return " ".join(text.split())


def failed_claims(files: dict[str, str], results: Results) -> list[str]:
    """One line per claim whose words its file does not contain; ``files[path]`` is the text."""
    failures = []
    for claims in CLAIMS:
        text = _squash(files[claims.path])
        for words in claims.render(results):
            if _squash(words) not in text:
                failures.append(
                    f"{claims.path}: lacks {words!r} (from {', '.join(claims.sources)})"
                )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 on any difference"
    )
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--root", type=Path, default=ROOT, help="where the files with claims live")
    args = parser.parse_args(argv)
    results = Results(args.results)
    old = args.readme.read_text()
    try:
        new = rewrite(old, results)
        files = {c.path: (args.root / c.path).read_text() for c in CLAIMS if c.path != "README.md"}
        failures = failed_claims({**files, "README.md": new}, results)
    except FileNotFoundError as err:  # a results file the README quotes is missing
        print(f"error: {err.filename} is missing: re-run the experiment that writes it")
        return 1
    if new != old and args.check:
        sys.stdout.writelines(
            difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), "README.md", "generated"
            )
        )
    elif new != old:
        args.readme.write_text(new)
        print(f"rewrote {args.readme}")
    for line in failures:
        print(line)
    return 1 if failures or (args.check and new != old) else 0


if __name__ == "__main__":
    sys.exit(main())
