"""The docs' generated tables and the figures checked in prose, from the committed results.

The tables in ``docs/**/*.md`` sit between `cog <https://cog.readthedocs.io>`_ markers::

    <!-- [[[cog table("per-layer") ]]] -->
    ...                                  (everything here is rewritten by cog)
    <!-- [[[end]]] -->

Regenerate them after a re-run changed ``experiments/results``, or check them::

    python experiments/tables/registry.py           # rewrite the tables in place
    python experiments/tables/registry.py --check   # exit 1 when a table or a claim is stale

A *claim* is a short text rendered from the results that the docs (or an experiment's docstring,
"Expected: ...") must contain, whitespace-insensitive: figures quoted in prose. A claim that no
longer holds is reported, to be fixed by hand.

To add a table: write ``def my_table(r: Results) -> str`` (markdown ending in a newline) in
``sections.py`` or ``features.py``, add it to :data:`TABLES`, put the two markers where it
belongs and run this script. ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# The sibling modules, whether this runs as a script, is imported by cog (-I) or by the tests;
# sys.path is left as it was, so these short module names shadow nothing afterwards.
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
try:
    import docstrings as D
    import features as F
    import sections as S
    from fmt import RESULTS, ROOT, Results
finally:
    sys.path.remove(str(_HERE))

#: Table name (as in the cog marker) -> renderer.
TABLES: dict[str, Callable[[Results], str]] = {
    "sweep-cpu": S.sweep_cpu,
    "time-model": S.time_model_table,
    "analyze": S.analyze_table,
    "per-layer": S.per_layer_table,
    "recommend": S.recommend_table,
    "sharding": S.sharding_table,
    "train-demos": S.train_demos,
    "timeline": F.timeline_table,
    "structure": F.structure_table,
    "chen": F.chen_table,
    "soak": F.soak_table,
    "own-model": F.own_model_table,
    "recommend-structure": F.recommend_structure_table,
    "options": F.options_table,
    "policies": F.policies_table,  # from the registry, not results
    "maxtext-policies": F.maxtext_policies_table,  # from remat_kit.policies, not results
}

#: Where claims live ("docs": any page under docs/ or README.md) -> renderers of their texts.
CLAIMS: tuple[tuple[str, Callable[[Results], list[str]]], ...] = (
    ("docs", S.sweep_claims),
    ("docs", S.analyze_claims),
    ("docs", S.per_layer_claims),
    ("docs", S.recommend_claims),
    ("docs", S.sharding_claims),
    ("experiments/configs/cpu.py", D.sweep_claims_cpu_doc),
    ("experiments/bench_analyze.py", D.analyze_claims_doc),
    ("experiments/bench_recommend.py", D.recommend_claims_doc),
    ("experiments/train_demos.py", D.train_claims_doc),
)


def doc_files(root: Path = ROOT) -> list[Path]:
    """The markdown files cog reads: README.md and every page under docs/ (not the results'
    own files behind the docs/results/figures link)."""
    pages = [p for p in (root / "docs").rglob("*.md") if "figures" not in p.parts]
    return [root / "README.md", *sorted(pages)]


class Tables:
    """``Tables(results).render(name)``: the markdown of table ``name`` (what cog calls)."""

    def __init__(self, results: str | Path = RESULTS) -> None:
        self.results = Results(Path(results))

    def render(self, name: str) -> str:
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; registered: {', '.join(TABLES)}")
        return TABLES[name](self.results)


def _squash(text: str) -> str:
    return " ".join(text.split())


def failed_claims(results: str | Path = RESULTS, root: Path = ROOT) -> list[str]:
    """One line per claim whose words its file(s) do not contain."""
    r = Results(Path(results))
    docs = _squash("\n".join(p.read_text() for p in doc_files(root)))
    failures = []
    for where, render in CLAIMS:
        text = docs if where == "docs" else _squash((root / where).read_text())
        for words in render(r):
            if _squash(words) not in text:
                failures.append(f"{where}: lacks {words!r} (from {render.__name__})")
    return failures


def cog_args(results: str | Path = RESULTS, root: Path = ROOT, check: bool = False) -> list[str]:
    """The ``cog`` command line that rewrites (or, ``check``, checks) every generated table."""
    files = [str(p) for p in doc_files(root) if "[[[cog" in p.read_text()]
    return [
        "cog",
        *(["--check", "--diff"] if check else ["-r"]),
        "-I",
        str(_HERE),
        "-D",
        f"results={results}",
        "-p",
        "from registry import Tables; table = lambda name: cog.out(Tables(results).render(name))",
        *files,
    ]


def main(argv: list[str] | None = None) -> int:
    from cogapp import Cog

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root")
    args = parser.parse_args(argv)
    rc = Cog().main(cog_args(args.results, args.root, args.check))
    failures = failed_claims(args.results, args.root)
    for line in failures:
        print(line)
    return 1 if rc or failures else 0


if __name__ == "__main__":
    sys.exit(main())
