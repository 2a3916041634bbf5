"""The results reader and the number formats of the generated tables."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from remat_kit.sweep.results import read_rows

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
GIB = 2**30
MIB = 2**20
MINUS = "\u2212"  # the docs print negative changes with a typographic minus


class Results:
    """Read-only access to a results folder (``experiments/results`` or a copy of it)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._cache: dict[str, Any] = {}

    def text(self, rel: str) -> str:
        if rel not in self._cache:
            self._cache[rel] = (self.root / rel).read_text()
        return self._cache[rel]

    def json(self, rel: str) -> Any:
        return json.loads(self.text(rel))

    def jsonl(self, rel: str) -> list[dict[str, Any]]:
        """The rows of a JSONL file, as :func:`remat_kit.sweep.results.read_rows` reads them."""
        path = self.root / rel
        if not path.is_file():  # read_rows takes a missing file as no rows; a table needs it
            raise FileNotFoundError(f"no results file {path}")
        return read_rows(path, timelines=False)


# ---------------------------------------------------------------- formatting


def pct(new: float, base: float, minus: str = MINUS) -> str:
    """Change of ``new`` against ``base`` in whole percent: ``-43%``, ``0%``, ``+3%``."""
    p = round(100 * (new / base - 1))
    return f"{minus}{-p}%" if p < 0 else (f"+{p}%" if p > 0 else "0%")


def span(values: Iterable[float], fmt: str = "{:.2f}", dash: str = "\u2013") -> str:
    """``1.23`` when all values print alike, else ``lo–hi``."""
    texts = sorted({fmt.format(v) for v in values}, key=float)
    return texts[0] if len(texts) == 1 else f"{texts[0]}{dash}{texts[-1]}"


def sci(x: float) -> str:
    """``7.2e-7`` (two significant digits, no zero-padded exponent)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def order_of(x: float) -> str:
    """The power of ten at or above ``x``: ``7.2e-7`` -> ``1e-6``."""
    return f"1e{math.ceil(math.log10(x))}" if x > 0 else "0"


def table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def wrap(paragraph: str, bullet: bool = False) -> str:
    """``paragraph`` wrapped at 100 columns as the docs' prose is (bullets indented by 2)."""
    return textwrap.fill(
        paragraph,
        100,
        subsequent_indent="  " if bullet else "",
        break_on_hyphens=False,
        break_long_words=False,
    )


def joined(words: list[str]) -> str:
    """``a, b and c``."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
