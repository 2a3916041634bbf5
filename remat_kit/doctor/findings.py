"""The doctor's findings: one line each (what is wrong, the likely cause, the fix)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from remat_kit.units import format_bytes

Severity = Literal["error", "warning", "info"]
#: Relative tolerance when comparing two compiled figures as "the same".
SAME = 0.005


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem: ``code`` (see :mod:`remat_kit.doctor`), ``severity``, what is wrong, the
    likely cause and the fix."""

    code: str
    severity: Severity
    what: str
    cause: str
    fix: str

    def line(self) -> str:
        return f"{self.severity}: [{self.code}] {self.what} Cause: {self.cause} Fix: {self.fix}"


def has_errors(findings: Sequence[Finding]) -> bool:
    """True when any finding has severity ``error`` (``remat-kit doctor`` then exits 1)."""
    return any(f.severity == "error" for f in findings)


def nbytes(n: float | int | None) -> str:
    """A byte figure for a message, in the unit that suits it (``"1.50 MiB"``, ``"640 B"``)."""
    return format_bytes(n)


def dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.code, f.what) not in seen:
            seen.add((f.code, f.what))
            out.append(f)
    return out


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then infos (stable)."""
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])
