"""Shards: the i-th of N deterministic parts of a sweep's points, each run by its own process
into its own *part file*, and the merge of the part files into one results file.

This is how a sweep runs on a SLURM job array without a scheduler of remat-kit's: array task
``i`` of ``N`` runs ``--shard i/N`` (:func:`shard_points`: a contiguous run of the points in
run order, so a part holds whole groups where it can and each group is analysed once), writing
``sweep.part-i-of-N.jsonl`` beside the results file (:func:`part_path`); a part resumes like any
sweep (``--resume``). When the parts are done, :func:`merge_parts` joins them into the one
results file the summary, the figures and the report are made from. The parts share the
sweep's identity (the shard is not part of it), so their rows are the rows a single process
writes, each point's figures its own.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from remat_kit.sweep import results as R
from remat_kit.sweep.config import Point, SweepConfig
from remat_kit.sweep.output import SweepRun
from remat_kit.sweep.output import _check_writable as check_writable

#: What ``--shard`` takes, for error messages.
SHARD_FORM = "I/N (part I of N, 0 <= I < N, e.g. 0/4 for SLURM_ARRAY_TASK_ID=0 of 4)"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Part ``index`` (from 0) of ``count`` parts of a sweep's points."""

    index: int
    count: int

    def __post_init__(self):
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.index, self.count))
        if not ok or self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"expected {SHARD_FORM}, got {self.index!r}/{self.count!r}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``"1/4"`` -> ``Shard(1, 4)``.

    Raises:
      ValueError: anything else (one line naming the value and the form).
    """
    found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if found:
        index, count = int(found.group(1)), int(found.group(2))
        if count >= 1 and index < count:
            return Shard(index, count)
    raise ValueError(f"expected {SHARD_FORM}, got {text!r}")


def shard_points(points: Sequence[Point], shard: Shard) -> list[Point]:
    """The points of ``shard``: the ``index``-th of ``count`` contiguous runs of ``points`` (in
    run order), of sizes differing by at most one; every point is in exactly one part, the same
    one in every process and run. A part may be empty (more parts than points)."""
    n = len(points)
    return list(points[shard.index * n // shard.count : (shard.index + 1) * n // shard.count])


def part_path(out: str | os.PathLike[str], shard: Shard) -> Path:
    """The part file of ``shard`` beside the results file ``out``: ``runs/x/sweep.jsonl`` ->
    ``runs/x/sweep.part-0-of-2.jsonl``."""
    p = Path(out)
    return p.with_name(f"{p.stem}.part-{shard.index}-of-{shard.count}{p.suffix or '.jsonl'}")


def find_parts(out: str | os.PathLike[str]) -> list[Path]:
    """Every part file of ``out`` (:func:`part_path`), by part index.

    Raises:
      ValueError: none; parts of several part counts; a part missing (named).
    """
    p = Path(out)
    suffix = p.suffix or ".jsonl"
    pattern = re.compile(rf"{re.escape(p.stem)}\.part-(\d+)-of-(\d+){re.escape(suffix)}")
    found: dict[int, dict[int, Path]] = {}
    if p.parent.is_dir():
        for f in p.parent.iterdir():
            m = pattern.fullmatch(f.name)
            if m:
                found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    if not found:
        raise ValueError(
            f"no part files {p.stem}.part-I-of-N{suffix} in {str(p.parent)!r}: run the parts "
            "first (--shard I/N with the same --out), or name the part files after --merge"
        )
    if len(found) > 1:
        counts = ", ".join(str(n) for n in sorted(found))
        raise ValueError(
            f"part files of {len(found)} part counts ({counts}) beside {str(p)!r}; name the "
            "ones to merge after --merge"
        )
    count, parts = next(iter(found.items()))
    missing = [part_path(p, Shard(i, count)).name for i in range(count) if i not in parts]
    if missing:
        raise ValueError(
            f"part file(s) {', '.join(missing)} missing beside {str(p)!r}: run "
            f"--shard {missing and _index(missing[0])}/{count} first, or name the part files "
            "to merge after --merge"
        )
    return [parts[i] for i in range(count)]


def _index(name: str) -> str:
    return name.rsplit(".part-", 1)[1].split("-of-", 1)[0]


def merge_parts(
    config: SweepConfig,
    out: str | os.PathLike[str],
    parts: Sequence[str | os.PathLike[str]] | None = None,
    *,
    data: str | os.PathLike[str] | None = None,
) -> SweepRun:
    """Join part files into the results file ``out``: its own rows (of the same config) are
    kept, a part's row replaces the row of the same key; every row in point order. ``out`` and
    its timelines file are written beside and renamed into place, so a kill leaves the old
    file or the new one; the part files are left as they are.

    Args:
      config: the sweep the parts ran (with the same ``data``: both make its identity).
      out: the results file (created with its folders).
      parts: the part files; None: :func:`find_parts` of ``out``.
      data: the ``data`` argument the parts ran with.

    Returns:
      A :class:`~remat_kit.sweep.output.SweepRun`: ``rows`` every row now in ``out``,
      ``new_rows`` those from the parts, ``skipped`` the rows ``out`` already had, and in
      ``notes`` how many points no file holds yet (which part to resume).

    Raises:
      ValueError: see :func:`find_parts`; a part file that does not exist or holds rows of
        another config, or ``out`` holding such rows (the message names what differs);
        ``out`` not writable.
    """
    start = time.perf_counter()
    path = Path(out)
    files = [Path(f) for f in parts] if parts is not None else find_parts(path)
    identity = config.identity(data)
    fingerprint = R.fingerprint(identity)
    points = config.points()
    check_writable(path)
    own = {r["key"]: r for r in R.read_rows(path) if "key" in r}
    R.check_resumable(list(own.values()), fingerprint, str(path), identity)
    from_parts: dict[str, dict[str, Any]] = {}
    for f in files:
        if not f.is_file():
            raise ValueError(f"part file {str(f)!r} does not exist")
        rows = R.read_rows(f)
        R.check_resumable(rows, fingerprint, str(f), identity)
        from_parts.update({r["key"]: r for r in rows if "key" in r})
    order = {p.key: i for i, p in enumerate(points)}
    merged = {**own, **from_parts}
    rows = sorted(merged.values(), key=lambda r: order.get(r["key"], len(order)))
    _write_rows(path, rows)
    new = [r for r in rows if r["key"] in from_parts]
    wall = time.perf_counter() - start
    return SweepRun(path, rows, new, len(rows) - len(new), wall, _missing(points, merged, files))


def _write_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as the whole of ``path`` and its timelines file: written beside, renamed."""
    tmp = path.with_name(f"{path.stem}.merging{path.suffix or '.jsonl'}")
    for f in (tmp, R.timelines_path(tmp)):
        f.unlink(missing_ok=True)
    for row in rows:
        R.append_row(tmp, row)
    tmp.touch()
    if R.timelines_path(tmp).exists():
        os.replace(R.timelines_path(tmp), R.timelines_path(path))
    else:
        R.timelines_path(path).unlink(missing_ok=True)
    os.replace(tmp, path)


def _missing(points: Sequence[Point], rows: Mapping[str, Any], files: Sequence[Path]) -> list[str]:
    """A note on the points no file holds (empty when none), naming the parts to resume when
    the files are parts of one count."""
    missing = [p for p in points if p.key not in rows]
    if not missing:
        return []
    counts = {m.group(2) for f in files if (m := re.search(r"\.part-(\d+)-of-(\d+)\.", f.name))}
    where = ""
    if len(counts) == 1:
        count = int(counts.pop())
        short = [
            f"{i}/{count} ({n} left)"
            for i in range(count)
            if (n := sum(p.key not in rows for p in shard_points(points, Shard(i, count))))
        ]
        where = f" (part {', '.join(short)}: rerun it with --shard I/N --resume, then --merge)"
    return [f"{len(missing)} of {len(points)} points are in no file yet{where}"]
