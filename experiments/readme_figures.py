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

The "(from ...)" part of the opening marker is rewritten too. To add one, in
``experiments/readme_sections.py``: write ``def my_table(r: Results) -> str`` returning the
markdown (ending in a newline; ``r.json("sub/file.json")`` reads a results file), add
``Section("my-table", ("sub/file.json",), my_table)`` to ``SECTIONS``, and put the two markers
(with an empty body) where it belongs in README.md; then run the script. To check figures in prose
instead: write ``def my_claims(r: Results) -> list[str]`` returning the exact words the file must
contain and add ``Claims("README.md", ("sub/file.json",), my_claims)`` to ``CLAIMS`` (any file
under the repository root, e.g. an experiment's docstring). ``experiments/readme_format.py``
holds the reader and the number formats (``pct``, ``span``, ``sci``, ``table``, ``wrap``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path

from readme_format import RESULTS, ROOT, Results  # noqa: E402
from readme_sections import CLAIMS, SECTIONS  # noqa: E402

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
    new = rewrite(old, results)
    files = {c.path: (args.root / c.path).read_text() for c in CLAIMS if c.path != "README.md"}
    failures = failed_claims({**files, "README.md": new}, results)
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
