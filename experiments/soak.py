"""Soak benchmark for crash safety: kill training and sweeps at random moments, resume, check.

Not part of the test suite. ``--kills N`` (default 20) times each:

* ``experiments/train.py`` (tiny settings: tiny-gpt d_model=32, 24 steps, a checkpoint every 2
  steps so that saves take a fair share of the run, an evaluation every 8) is started in a
  fresh workdir, killed with SIGKILL (the whole process group) at a random moment, then run
  again with ``--resume`` to the end. Moments alternate between two draws: uniformly over the
  wall time of an uninterrupted run (redrawn over the run's own length when it finished first;
  start-up and the first compile fill most of it), and a uniform offset (up to the mean time
  between steps) after a uniformly drawn ``step`` line of its output, so that steps and the
  asynchronous saves behind them are hit as often as start-up. Checked against an
  uninterrupted run: the resume exits 0; ``result.json`` has one loss per step (none lost or
  duplicated) and the same losses and validation losses, bit for bit; the final checkpoint's
  parameters and optimizer state (restored with orbax through
  :func:`trainer.load_checkpoint`) are bitwise equal.
* ``experiments/sweep.py --config quick`` likewise (the second draw counts rows written to the
  results file instead of step lines: a kill after the last row lands while the summary and
  figures are written), resumed with ``--resume``. Checked: the resume
  exits 0; every point has exactly one row (none lost, none duplicated); the file ends with a
  whole line and every line parses (no torn line); the rows finished before the kill are kept
  byte for byte; each row's losses and analysis figures (peak, argument, output, temp bytes,
  FLOPs, recompute ratio, residual bytes) equal the uninterrupted run's (timings differ by
  nature); ``summary.md`` and ``pareto.png`` exist.

Command (about 20 s per kill and resume on 2 idle CPU cores, jax 0.10.2; minutes under load)::

    python experiments/soak.py --kills 20      # writes experiments/results/soak/soak.json

Exit code 0 when every resume succeeded with nothing lost, duplicated or different; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

try:
    import remat_kit  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# experiments/trainer, imported as `trainer`: this folder is sys.path[0] when run as a script, not
# when loaded by path (tests: importlib, runpy)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np
from trainer import load_checkpoint

from remat_kit.sweep import results

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["experiments/train.py", "--steps", "24", "--batch", "4", "--seq", "32", "--eval-every",
         "8", "--eval-batches", "1", "--ckpt-every", "2", "--set", "d_model=32", "--set",
         "d_ff=64", "--log-every", "1"]  # fmt: skip
SWEEP = ["experiments/sweep.py", "--config", "quick", "--no-progress"]
#: Row fields that do not depend on timing: equal to the uninterrupted run's, or a bug.
SWEEP_FIELDS = ("key", "status", "losses", "peak_bytes", "argument_bytes", "output_bytes",
                "temp_bytes", "alias_bytes", "flops", "flops_no_remat", "recompute_ratio",
                "activation_bytes")  # fmt: skip
RESULTS = ROOT / "experiments" / "results" / "soak"
TIMEOUT_S = 900


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip


class _Progress:
    """Counts a run's progress events while it runs: lines starting with ``step`` on its
    standard output (training; read by a thread) or whole lines of a file (sweep rows)."""

    def __init__(self, proc: subprocess.Popen, rows: Path | None):
        self.rows, self.count, self.times = rows, 0, []
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            if self.rows is None and line.startswith("step"):
                self.count += 1
                self.times.append(time.perf_counter() - self._t0)

    def poll(self) -> int:
        if self.rows is not None:
            lines = _lines(self.rows)
            n = sum(ln.endswith(b"\n") for ln in lines)
            self.times += [time.perf_counter() - self._t0] * (n - self.count)
            self.count = n
        return self.count


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *cmd], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip


def _kill_at(cmd: list[str], moment: dict[str, Any], rows: Path | None) -> dict[str, Any]:
    """Start ``cmd`` and SIGKILL its process group at ``moment`` (if still running):
    ``{"mode": "time", "at_s": t}`` t seconds after the start, or ``{"mode": "event", "after":
    n, "offset_s": d}`` d seconds after its n-th progress event (:class:`_Progress`)."""
    proc = _start(cmd)
    progress = _Progress(proc, rows)
    t0 = time.perf_counter()
    deadline = t0 + moment["at_s"] if moment["mode"] == "time" else None
    while proc.poll() is None:
        now = time.perf_counter()
        if deadline is None and progress.poll() >= moment["after"]:
            deadline = now + moment["offset_s"]
        if deadline is not None and now >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    killed = proc.returncode == -signal.SIGKILL
    return {**moment, "killed": killed, "ran_s": time.perf_counter() - t0,
            "events_at_kill": progress.poll(), "exit": proc.returncode}  # fmt: skip


def _kill_somewhere(
    cmd: list[str], moment: dict[str, Any], rng: random.Random, folder: Path, rows: Path | None
) -> dict:
    """:func:`_kill_at`; when the run finished before a ``time`` kill (the machine was faster
    than during the uninterrupted run), start again from an empty ``folder`` with a moment
    drawn over the length that run took (at most 3 tries)."""
    tries = 0
    while True:
        tries += 1
        record = _kill_at(cmd, moment, rows)
        if record["killed"] or tries == 3:
            break
        shutil.rmtree(folder, ignore_errors=True)
        moment = {**moment, "at_s": round(rng.uniform(0, record["ran_s"]), 3)}
    record["tries"] = tries
    record["ran_s"] = round(record["ran_s"], 2)
    return record


def _moment(i: int, wall: float, events: list[float], rng: random.Random) -> dict[str, Any]:
    """Kill ``i``'s moment: even ``i`` uniformly over the uninterrupted run's wall time (start-up
    and compiling dominate it); odd ``i`` a uniform offset (up to the run's mean time between
    events) after a uniformly drawn progress event, so that steps, saves and rows are hit too."""
    if i % 2 == 0 or not events:
        return {"mode": "time", "at_s": round(rng.uniform(0, wall), 3)}
    gap = (events[-1] - events[0]) / max(1, len(events) - 1) if len(events) > 1 else 0.1
    return {"mode": "event", "after": rng.randint(1, len(events)),
            "offset_s": round(rng.uniform(0, gap), 4)}  # fmt: skip


def _timed(cmd: list[str], rows: Path | None) -> tuple[float, list[float]]:
    """The uninterrupted run: its wall time (s) and the moments of its progress events."""
    t0 = time.perf_counter()
    proc = _start(cmd)
    progress = _Progress(proc, rows)
    while proc.poll() is None:
        progress.poll()
        time.sleep(0.005)
    progress._thread.join()
    progress.poll()
    if proc.returncode:
        raise SystemExit(f"uninterrupted run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - t0, progress.times


# -- Training ------------------------------------------------------------------------------


def _trees_equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


def _train_trial(base: Path, folder: Path, moment: dict, rng: random.Random) -> dict[str, Any]:
    workdir = folder / "train"
    steps = int(TRAIN[TRAIN.index("--steps") + 1])
    record = _kill_somewhere([*TRAIN, "--workdir", str(workdir)], moment, rng, workdir, None)
    done = _run([*TRAIN, "--workdir", str(workdir), "--resume"])
    record.update(resume_exit=done.returncode, error=done.stderr.strip()[-500:] or None)
    if done.returncode:
        return record
    want = json.loads((base / "result.json").read_text())
    got = json.loads((workdir / "result.json").read_text())
    record.update(
        resumed_from=got["resumed_from"],
        steps=len(got["losses"]),
        lost=max(0, steps - len(got["losses"])),
        duplicated=max(0, len(got["losses"]) - steps),
        losses_equal=got["losses"] == want["losses"],
        val_losses_equal=got["val_losses"] == want["val_losses"],
    )
    (state, meta), (ref, ref_meta) = load_checkpoint(workdir), load_checkpoint(base)
    record["state_equal"] = meta["step"] == ref_meta["step"] and _trees_equal(state, ref)
    record["error"] = None
    return record


def _train_ok(r: dict[str, Any]) -> bool:
    return (
        r["resume_exit"] == 0
        and not r.get("lost")
        and not r.get("duplicated")
        and all(r.get(k) for k in ("losses_equal", "val_losses_equal", "state_equal"))
    )


# -- Sweep ---------------------------------------------------------------------------------


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True) if path.exists() else []


def _sweep_trial(
    base_rows: list[dict], folder: Path, moment: dict, rng: random.Random
) -> dict[str, Any]:
    out = folder / "sweep" / "sweep.jsonl"
    record = _kill_somewhere([*SWEEP, "--out", str(out)], moment, rng, out.parent, out)
    kept = [ln for ln in _lines(out) if ln.endswith(b"\n")]
    record["rows_at_kill"] = len(kept)
    at_kill = out.read_bytes() if out.exists() else b""
    record["torn_at_kill"] = bool(at_kill) and not at_kill.endswith(b"\n")
    done = _run([*SWEEP, "--out", str(out), "--resume"])
    record.update(resume_exit=done.returncode, error=done.stderr.strip()[-500:] or None)
    if done.returncode:
        return record
    data = out.read_bytes()
    rows = results.read_rows(out)
    keys = [r["key"] for r in rows]
    want = {r["key"]: r for r in base_rows}
    record.update(
        rows=len(rows),
        lost=len(set(want) - set(keys)),
        duplicated=len(keys) - len(set(keys)),
        torn=not data.endswith(b"\n") or len(data.splitlines()) != len(rows),
        kept_rows_intact=data.startswith(b"".join(kept)),
        rows_equal=all(
            all(r.get(f) == want[r["key"]].get(f) for f in SWEEP_FIELDS)
            for r in rows
            if r["key"] in want
        ),
        summary=(out.parent / "summary.md").is_file() and (out.parent / "pareto.png").is_file(),
        error=None,
    )
    return record


def _sweep_ok(r: dict[str, Any]) -> bool:
    return (
        r["resume_exit"] == 0
        and not r.get("lost")
        and not r.get("duplicated")
        and not r.get("torn")
        and all(r.get(k) for k in ("kept_rows_intact", "rows_equal", "summary"))
    )


# -- Main ----------------------------------------------------------------------------------


def _totals(records: list[dict[str, Any]], ok) -> dict[str, Any]:
    return {
        "kills": len(records),
        "killed_while_running": sum(r["killed"] for r in records),
        "killed_after_first_event": sum(r["killed"] and r["events_at_kill"] > 0 for r in records),
        "resumed_from_checkpoint": sum(r.get("resumed_from") is not None for r in records),
        "rows_kept_at_kill": sum((r.get("rows_at_kill") or 0) > 0 for r in records),
        "failed_resumes": sum(r["resume_exit"] != 0 for r in records),
        "lost": sum(r.get("lost") or 0 for r in records),
        "duplicated": sum(r.get("duplicated") or 0 for r in records),
        "final_equal": sum(bool(r.get("state_equal", r.get("rows_equal"))) for r in records),
        "all_ok": all(ok(r) for r in records),
    }


def _soak(kind: str, kills: int, rng: random.Random, scratch: Path) -> dict[str, Any]:
    base = scratch / f"{kind}-base"
    if kind == "train":
        wall, events = _timed([*TRAIN, "--workdir", str(base)], None)
        reference: Any = base
        trial = _train_trial
        ok = _train_ok
    else:
        wall, events = _timed([*SWEEP, "--out", str(base / "sweep.jsonl")], base / "sweep.jsonl")
        reference = results.read_rows(base / "sweep.jsonl")
        trial = _sweep_trial
        ok = _sweep_ok
    records = []
    for i in range(kills):
        record = trial(reference, scratch / f"{kind}-{i}", _moment(i, wall, events, rng), rng)
        record["ok"] = ok(record)
        records.append(record)
        print(f"{kind} {i + 1}/{kills}: {json.dumps(record)}", flush=True)
    return {
        "uninterrupted_wall_s": round(wall, 1),
        "uninterrupted_events_s": [round(t, 2) for t in events],
        **_totals(records, ok),
        "trials": records,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="kills of each command (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--only", choices=("train", "sweep"), help="soak one command only")
    p.add_argument("--out", default=str(RESULTS / "soak.json"), help="JSON summary")
    args = p.parse_args(argv)
    if args.kills < 1:
        p.exit(2, f"soak.py: error: --kills must be a positive integer, got {args.kills}\n")
    rng = random.Random(args.seed)
    summary: dict[str, Any] = {
        "command": "python experiments/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, JAX_PLATFORMS=cpu",
        "jax": jax.__version__,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="remat-kit-soak-") as scratch:
        for kind in ("train", "sweep"):
            if args.only in (None, kind):
                summary[kind] = _soak(kind, args.kills, rng, Path(scratch))
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    ok = all(summary[k]["all_ok"] for k in ("train", "sweep") if k in summary)
    print(json.dumps({k: {f: v for f, v in summary[k].items() if f != "trials"}
                      for k in ("train", "sweep") if k in summary}, indent=1))  # fmt: skip
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
