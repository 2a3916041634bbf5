"""The results file of a sweep run (checked, resumed, owned by process 0), the progress bar,
and what a run returns."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from remat_kit.sweep import results as R
from remat_kit.sweep.config import Point
from remat_kit.terminal import group_notes, short_warnings


@dataclasses.dataclass
class SweepRun:
    """What :func:`run_sweep` did.

    Attributes:
      path: the results file.
      rows: every row of this config now in the file (earlier runs' included), in point order.
      new_rows: rows written by this call.
      skipped: points skipped because their key was already in the file (``resume``).
      wall_s: seconds this call took.
      notes: what the run left out and why (a program sweep's policies cut down to the
        program's tags or skipped).
    """

    path: Path
    rows: list[dict[str, Any]]
    new_rows: list[dict[str, Any]]
    skipped: int
    wall_s: float
    notes: list[str] = dataclasses.field(default_factory=list)


def _check_writable(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder")
        with open(path, "a", encoding="utf-8"):
            pass
        if not os.access(path, os.W_OK):
            raise PermissionError("not writable")
    except OSError as err:
        raise ValueError(f"cannot write results to {str(path)!r}: {err}") from None


def check_output_flags(path: str | os.PathLike[str], resume: bool, overwrite: bool) -> None:
    """Refuse a run that cannot go on, before it starts (its banner, a program's load): both
    flags, or ``path`` holding rows with neither (what to do with them is the user's call).

    Raises:
      ValueError: one line naming the flags to pass.
    """
    if resume and overwrite:
        raise ValueError("pass --resume or --overwrite, not both")
    if resume or overwrite or not Path(path).is_file():
        return
    rows = R.read_rows(path, timelines=False)
    if rows:
        raise ValueError(
            f"{path} already holds {len(rows)} row(s); pass --resume to continue that sweep, "
            "--overwrite to start again, or --out for a new file"
        )


def calibration_path(path: str | os.PathLike[str]) -> Path:
    """Where a sweep writing ``path`` keeps the local device's calibration its rows are priced
    with (``results.jsonl`` -> ``results.calibration.json``)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.calibration.json")


def prepare_output(
    path: Path, identity: Mapping[str, Any], resume: bool, overwrite: bool
) -> dict[str, dict]:
    """Check the output can be written and return the rows already there (by key).

    Nothing in the file changes unless the run may go on: then a torn last line (a kill
    mid-write) is truncated away (``resume``), or every row is dropped (``overwrite``).

    Args:
      path: the results file.
      identity: the sweep's :meth:`~remat_kit.sweep.SweepConfig.identity` (config and data).
      resume: keep the rows there and run the points missing.
      overwrite: drop the rows there.

    Raises:
      ValueError: both flags; ``path`` not writable; rows there without either flag
        (:func:`check_output_flags`); rows of another config (the message names what differs).
    """
    check_output_flags(path, resume, overwrite)
    _check_writable(path)
    rows = R.read_rows(path)
    if overwrite:
        calibration_path(path).unlink(missing_ok=True)
    if rows and overwrite:
        R.truncate(path)
        return {}
    R.check_resumable(rows, R.fingerprint(identity), str(path), identity)
    R.repair(path)
    return {r["key"]: r for r in rows if "key" in r}


def agreed_todo(points: Sequence[Point], done: Mapping[str, Any] | ValueError) -> list[Point]:
    """The points still to run, as process 0 sees them (broadcast to every process of a
    ``jax.distributed`` run, whose steps must run in the same order everywhere).

    Raises:
      ValueError: process 0 could not prepare the output (``done`` is its error there).
    """
    failed = isinstance(done, ValueError)
    mask = np.array([failed] + [failed or p.key not in done for p in points], np.int32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
    if failed:
        raise done
    if mask[0]:
        raise ValueError("process 0 could not prepare the results file (its error says why)")
    return [p for p, todo in zip(points, mask[1:], strict=True) if todo]


@contextlib.contextmanager
def progress(enabled: bool, console: Any, total: int):
    """Yields ``advance(n, description)`` (``n`` points finished, or None for a new stage): a
    rich progress bar on a terminal; where the console is a log or a pipe, one plain line per
    call (``[0:01:02 5/35] gpt-10m ...``, cut to the console's width), so a sweep run under
    ``nohup`` or CI shows where it is; nothing when disabled."""
    if not enabled:
        yield lambda n, description: None
        return
    from rich.console import Console

    console = console or Console(stderr=True)
    if not console.is_terminal:
        start, done = time.monotonic(), [0]

        def line(n: int | None, description: str) -> None:
            done[0] += n or 0
            clock = datetime.timedelta(seconds=int(time.monotonic() - start))
            what = f"done: {description}" if n else description
            text = f"[{clock} {done[0]}/{total}] {what}"
            if len(text) > console.width:  # one line each, within the width (COLUMNS)
                text = text[: console.width - 1] + "…"
            console.print(text, markup=False, highlight=False, soft_wrap=True)

        yield line
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[bold]sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=console,
    ) as bar:
        task = bar.add_task("", total=total)

        def advance(n: int | None, description: str) -> None:
            bar.update(task, advance=n or 0, description=description)

        yield advance


def warning_lines(rows: Sequence[Mapping[str, Any]], short: bool = False) -> list[str]:
    """The analysis warnings of the ``ok`` rows, one line per distinct warning: a warning every
    policy of its table (same model, target and shapes: :func:`remat_kit.sweep.results.group_key`)
    shares once as ``all policies: ...``, another after the policies that have it
    (``save-nothing, attn_in=save: ...``); a cause several warnings give (``... Cause: X``) is
    written once (``[cause 1]``, then ``cause 1: X``) (:func:`remat_kit.terminal.group_notes`);
    the table is named first when there are several. ``short``: XLA's long messages in one
    line, for a terminal (:func:`remat_kit.terminal.short_warnings`; the rows keep them whole)."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            groups.setdefault(R.group_key(r), []).append(r)
    out = []
    for members in groups.values():
        r0 = members[0]
        shape = ", ".join(f"{k} {r0[k]}" for k in ("batch_size", "seq_len") if r0.get(k))
        where = f"{r0.get('model')} on {r0.get('target')}" + (f", {shape}" if shape else "")
        items = [
            (str(r.get("policy")), (short_warnings if short else list)(r.get("warnings") or ()))
            for r in members
        ]
        out += group_notes(items, lead=f"{where}: " if len(groups) > 1 else "")
    return out
