"""Benchmark (not a test): an analysis grid run by 1 and by 2 worker processes, and the local
engine's scheduling overhead per point, measured with points that do nothing.

1. The grid: tiny-gpt (scanned) x s in {32, 64} x every registered policy, analysis only on the
   local CPU (26 points, two groups), run serially in this process (``--workers 1``) and by the
   local engine with 2 CPU worker processes (``--workers 2``: each group one task), the compile
   cache off so each run compiles; the wall times and their ratio are printed, and whether the
   two runs gave the same rows (timings aside).
2. The overhead: no-op points (a runner that returns a row per point and runs nothing) through
   the same driver loop as a sweep (:func:`remat_kit.sweep.run.run_tasks`: the engine, one
   fsync-ed row per point, the progress tally), ``N`` and ``N + 200`` of them on 2 worker
   processes; overhead per point = the difference in wall time over 200 (the workers' start,
   paid once, cancels out), and the start itself.
3. ``--cli``: the same grid as ``remat-kit analyze --model tiny-gpt --set scan_layers=true
   --batch 2 --seq 32 --seq 64 --all-policies --no-cache --out ... --grid-workers 1`` (and
   ``2``), each a fresh process as a user runs it.

Command (about 6 minutes on 2 cores; the figures of a run are in docs/results/fanout.md)::

    python experiments/bench_fanout.py
    python experiments/bench_fanout.py --skip-grid   # the overhead alone (~30 s)
    python experiments/bench_fanout.py --cli         # the grid through remat-kit analyze
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this file as a module the workers can import

os.environ.setdefault("JAX_PLATFORMS", "cpu")


class NoopRunner:
    """A task runner that runs nothing: one ``ok`` row per point, naming the process."""

    def __call__(self, task, advance=None):
        return [{"key": p.key, "status": "ok", "pid": os.getpid()} for p in task.points]


def grid(policies=None):
    from remat_kit.sweep import ALL_POLICIES, Grid, SweepConfig

    return SweepConfig("fanout", grids=(Grid(
        name="analysis", models=("tiny-gpt",), policies=policies or ALL_POLICIES,
        batch_sizes=(2,), seq_lens=(32, 64), overrides={"scan_layers": True}, measure=False,
    ),))  # fmt: skip


def _figures(row: dict) -> dict:
    """A row without its timings (when it was made, compile seconds) and without the name of
    the file its run kept the calibration in (the estimate's source says it)."""
    out = {k: v for k, v in row.items() if k not in ("time", "point_s", "analysis_compile_s")}
    report = row.get("report") or {}
    out["report"] = {k: v for k, v in report.items() if k not in ("compile_s", "compile_cached")}
    step = out["report"].get("step_time")
    if step and step.get("figures"):
        figures = re.sub(r"kept for this run in \S+", "kept for this run", step["figures"])
        out["report"]["step_time"] = {**step, "figures": figures}
    return out


def run_grid(folder: Path) -> dict:
    """The grid serially and on 2 workers: wall seconds each, and whether the rows agree."""
    from remat_kit import targets as T
    from remat_kit.memory import calibration
    from remat_kit.sweep import results, run_sweep
    from remat_kit.sweep.engine import LocalEngine

    calibration.device_figures(T.get_target(T.LOCAL))  # calibrated (or read) before timing
    config = grid()
    walls, rows = {}, {}
    for workers in (1, 2):
        engine = None if workers == 1 else LocalEngine(workers)
        out = folder / f"w{workers}" / "sweep.jsonl"
        start = time.perf_counter()
        run = run_sweep(config, out, progress=False, engine=engine)
        walls[workers] = time.perf_counter() - start
        rows[workers] = {r["key"]: _figures(r) for r in results.read_rows(out, timelines=False)}
        bad = [r["error"] for r in run.rows if r["status"] != "ok"]
        print(f"{workers} worker(s): {len(run.rows)} points in {walls[workers]:.1f} s"
              + (f"; {len(bad)} failed: {bad[0]}" if bad else ""), flush=True)  # fmt: skip
    same = rows[1] == rows[2]
    return {"points": len(rows[1]), "wall_1": walls[1], "wall_2": walls[2], "same_rows": same}


#: The grid of :func:`grid` as ``remat-kit analyze`` takes it (every policy, s in {32, 64}).
CLI_GRID = ["analyze", "--model", "tiny-gpt", "--set", "scan_layers=true", "--batch", "2",
            "--seq", "32", "--seq", "64", "--all-policies", "--target", "local",
            "--no-cache"]  # fmt: skip


def run_cli_grid(folder: Path) -> dict:
    """The grid through the command line (``remat-kit analyze``, a fresh process each, as a
    user runs it) with ``--grid-workers 1`` and ``2``: wall seconds each (the process's start
    and JAX's import included), and whether the rows agree (timings aside)."""
    import subprocess

    from remat_kit.sweep import results

    walls, rows = {}, {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *filter(None, [
        os.environ.get("PYTHONPATH")])])}  # fmt: skip
    for workers in (1, 2):
        out = folder / f"cli-w{workers}" / "grid.jsonl"
        argv = [*CLI_GRID, "--out", str(out), "--grid-workers", str(workers)]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "remat_kit.cli", *argv], env=env,
                              capture_output=True, text=True)  # fmt: skip
        walls[workers] = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"remat-kit {' '.join(argv)}: exit {done.returncode}: {done.stderr}")
        rows[workers] = {r["key"]: _figures(r) for r in results.read_rows(out, timelines=False)}
        print(f"remat-kit {' '.join(argv[:-4])} --grid-workers {workers}: {len(rows[workers])} "
              f"rows in {walls[workers]:.1f} s", flush=True)  # fmt: skip
    same = rows[1] == rows[2]
    return {"points": len(rows[1]), "wall_1": walls[1], "wall_2": walls[2], "same_rows": same}


def run_overhead(folder: Path, base: int = 24, more: int = 200) -> dict:
    """Seconds per no-op point on 2 worker processes (and their start), through the driver."""
    import bench_fanout  # this file, importable by the workers (not __main__)

    from remat_kit.sweep.engine import LocalEngine
    from remat_kit.sweep.run import RowSink, run_tasks
    from remat_kit.sweep.tasks import Task

    one = grid(policies=("no-remat",)).points()[0]
    walls = {}
    for n in (base, base + more):
        points = [dataclasses.replace(one, seed=i) for i in range(n)]  # distinct keys
        tasks = [Task((p,)) for p in points]
        path = folder / f"noop-{n}.jsonl"
        start = time.perf_counter()
        rows = run_tasks(
            LocalEngine(2), tasks, bench_fanout.NoopRunner, RowSink(path), progress=False
        )
        walls[n] = time.perf_counter() - start
        assert len(rows) == n and len({r["pid"] for r in rows}) == 2, rows[:3]
        print(f"{n} no-op points on 2 workers: {walls[n]:.2f} s", flush=True)
    per_point = (walls[base + more] - walls[base]) / more
    return {"per_point_s": per_point, "start_s": walls[base] - base * per_point}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-grid", action="store_true", help="only the no-op overhead")
    p.add_argument("--cli", action="store_true",
                   help="only the grid through remat-kit analyze --grid-workers 1, 2")  # fmt: skip
    args = p.parse_args(argv)
    os.environ["REMAT_KIT_NO_CACHE"] = "1"  # every run compiles
    import jax

    from remat_kit.memory.calibration import cpu_model

    print(f"{os.cpu_count()} CPUs ({cpu_model()}), {jax.default_backend()} backend, "
          f"jax {jax.__version__}, load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.cli:
            g = run_cli_grid(folder)
            print(f"CLI grid: {g['points']} rows, 1 worker {g['wall_1']:.1f} s, 2 workers "
                  f"{g['wall_2']:.1f} s: ratio {g['wall_1'] / g['wall_2']:.2f}x; same rows "
                  f"(timings aside): {g['same_rows']}", flush=True)  # fmt: skip
            print(f"load average at the end {os.getloadavg()[0]:.2f}")
            return 0
        over = run_overhead(folder)
        print(f"overhead: {1e3 * over['per_point_s']:.1f} ms per point on the local engine "
              f"(2 workers); workers' start {over['start_s']:.1f} s", flush=True)  # fmt: skip
        if not args.skip_grid:
            g = run_grid(folder)
            print(f"grid: {g['points']} points, 1 worker {g['wall_1']:.1f} s, 2 workers "
                  f"{g['wall_2']:.1f} s: ratio {g['wall_1'] / g['wall_2']:.2f}x; same rows "
                  f"(timings aside): {g['same_rows']}", flush=True)  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
