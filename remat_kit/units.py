"""Leaf unit helpers: sizes in bytes, parsed and formatted. Imports nothing from remat_kit.

Example::

    >>> parse_bytes("80GiB")
    85899345920
    >>> format_bytes(3 * 2**20)
    '3.00 MiB'
    >>> gib(None)
    '-'
    >>> format_bytes(1024), format_bytes(512)
    ('1.00 KiB', '512 B')
    >>> format_seconds(6.836e-08), format_seconds(0.5862), format_seconds(12.0)
    ('68.36 ns', '586.2 ms', '12 s')
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

KIB = 2**10
MIB = 2**20
GIB = 2**30

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """A size in bytes from ``"80GiB"`` (2**30), ``"80GB"`` (10**9), ``"8e10"`` or ``512``.

    Units (case-insensitive): B, kB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers
    of 1024); no unit means bytes. A capitalised prefix before a lowercase b (``Mb``, ``Gib``)
    is the bits convention and refused.

    Raises:
      ValueError: not a positive size with a known unit; a size written in bits (``4Mb``).
    """
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {str(text)!r} as a size: write a number with an optional unit, e.g. "
            "80GiB, 80GB, 8e10 (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    written = m.group(2)
    if written[-1:] == "b" and written[:-1] != written[:-1].lower():  # Mb, Gb, GiB-less Mib
        raise ValueError(
            f"{str(text)!r}: a lowercase b after {written[:-1]!r} is bits; write "
            f"{m.group(1)}{written[0].upper()}B or {m.group(1)}{written[0].upper()}iB for bytes"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"size must be positive, got {str(text)!r}")
    return int(value)


def format_bytes(n: float | int | None, digits: int = 2, up: bool = False) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``"-"`` for unknown).
    ``up``: rounded up at the digits shown, for a figure offered as a budget (a peak of
    4,112,192 B is ``"3.93 MiB"``, which holds it, not ``"3.92 MiB"``, which does not)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= scale:
            value = n / scale
            if up:
                value = math.ceil(value * 10**digits - 1e-9) / 10**digits
            return f"{value:.{digits}f} {unit}"
    return f"{math.ceil(n) if up else n:.0f} B"


def format_seconds(s: float | None, digits: int = 4) -> str:
    """Seconds in the largest of s, ms, µs, ns that keeps the number >= 1, ``digits``
    significant digits (``"-"`` for unknown or infinite)."""
    if s is None or s != s or s in (float("inf"), float("-inf")):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.{digits}g} {unit}"
    return f"{s / 1e-9:.{digits}g} ns"


def format_flops(n: float | int | None, digits: int = 1) -> str:
    """FLOPs (a count, not a rate) with the largest of the P, T, G, M prefixes that keeps the
    number >= 1, ``digits`` decimals (``"-"`` for unknown): ``format_flops(12.08e9) ==
    "12.1 GFLOP"``."""
    if n is None:
        return "-"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {prefix}FLOP"
    return f"{n:.{digits}f} FLOP"


def gib(n: float | int | None, digits: int = 2) -> str:
    """Bytes as a bare GiB figure (``"-"`` for unknown), for columns headed "GiB"."""
    return "-" if n is None else f"{n / GIB:.{digits}f}"


def table_unit(values: list[float | int | None]) -> tuple[int, str]:
    """``(bytes per unit, unit name)`` for a column of byte figures: GiB when the largest is at
    least 4 GiB, else MiB."""
    top = max((abs(v) for v in values if v is not None), default=0)
    return (GIB, "GiB") if top >= 4 * GIB else (MIB, "MiB")


def in_unit(n: float | int | None, unit: int, digits: int = 1) -> str:
    """Bytes as a bare figure in ``unit`` bytes, thousands separated (``"-"`` for unknown), for
    columns whose header names the unit (see :func:`table_unit`)."""
    return "-" if n is None else f"{n / unit:,.{digits}f}"


def format_span(values: Iterable[float], digits: int = 2) -> str:
    """The range of ``values`` as ``"lo-hi"``, or one figure where all are equal when printed
    (``[3.61, 3.61]`` -> ``"3.61"``): a load average, a spread of ratios.

    Raises:
      ValueError: ``values`` is empty.
    """
    values = list(values)
    if not values:
        raise ValueError("format_span needs at least one value")
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"
