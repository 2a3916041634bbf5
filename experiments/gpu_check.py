"""Predicted vs measured on one GPU, in one command that keeps a wall-clock budget (issue 18).

Command for a device session (H200, jax 0.11.2 + CUDA 13 plugin, no package registry)::

    pip install --no-deps -e . && python experiments/gpu_check.py --out $OUT --budget-s 480

Run it with the tool's ``timeout_s`` at ~560 s (the script stops starting points at the budget
and kills a running one there; a second try fits in the 15 device minutes only if the first
ends early). Add ``--resume`` to a second try to keep the points already written. Expected
runtime: ~6-8 min on an H200 (estimate, never run on one): 6 clean processes of ~60 s (start
JAX, init, compile, 2 + 5 steps, then the analyzer's own compile), ~30 s of gradients, and the
deviceless ``h200`` predictions and ``recommend`` in a CPU-only process alongside.

What it writes to ``--out`` (3 files; at most 8 come back from a device session):
``gpu_check.jsonl`` (one JSON row per point, written, flushed and fsync'ed as it finishes: a
point that failed is a row with ``status`` ``error`` / ``oom`` / ``timeout`` and the exception
text; one not started for lack of budget is ``skipped``), ``summary.md`` (tables, rewritten
after every point) and ``workers.log`` (the tail of each worker's stderr).

Points, most valuable first (each in its own process, with a timeout):

1. ``measure`` per policy: llama3.2-1b, bf16 params and AdamW state, scanned layers, batch 1,
   seq 4096, 2 warm-up + 5 timed steps in a fresh process (``peak_bytes_in_use`` is a
   process-wide maximum: a peak from an earlier point would be borrowed), then the analyzer's
   prediction for the local GPU (``analyze_model(..., target="local")``) in that process after
   the peak is read. Gives measured/predicted peak, step time against no-remat, tokens/s and
   MFU (PaLM appendix B, Chowdhery et al. 2022, arXiv:2204.02311: 6N + 12 L H Q T FLOPs per
   token). Policies: save-nothing, no-remat, save-dots-no-batch, offload-layer-inputs,
   save-layer-inputs (the offload's on-device twin: device peak lowered or not, measured), and
   the custom spec :data:`CUSTOM`.
2. ``predict``: the deviceless ``h200`` prediction of every policy (CPU-only process, run
   alongside point 1; retried on the GPU process at the end if it failed).
3. ``grads``: tiny-llama in float32: loss and gradients of the offloading policies against
   no-remat on the device (XLA once computed wrong gradients for offloaded scan carries), with
   the compiled host bytes.
4. ``recommend``: ``remat_kit.recommend`` on ``h200`` over the measured named policies with a
   budget half-way between the largest predicted peak (no-remat) and the next, so no-remat is
   excluded and the choice matters; the summary sets its pick against the measured step times.

Why seq 4096: deviceless ``h200`` peaks (jax 0.10.2, XLA attention, b=1, compiled on the CPU
machine with this script's ``predict`` worker): seq 4096: no-remat 98.09 GiB, save-nothing
15.54, save-dots-no-batch 18.15, offload-layer-inputs 15.55 (+0.25 host), save-layer-inputs
15.54, custom 15.90 (+0.00 host: its mlpwo offload did not reach host memory); seq 8192:
no-remat 349.21 GiB (XLA's own remat pass cannot bring it under 107.50 GiB), save-nothing 33.86.
At 4096 no-remat still fits in 141 GB (so its step time is the baseline to measure against) but
takes 6x the memory of save-nothing: one doubling of the sequence and only remat fits. Workers
raise ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to 0.95 (unless set) so that the 98 GiB no-remat step is
not refused by JAX's default 75% pool.

``--cpu``: the same code path on the local CPU with tiny-llama and 2 policies (~50 CPU-seconds,
two lanes in parallel; the test suite runs it once):
what a CPU cannot give (``peak_bytes_in_use``, MFU, real host offload) is null with a note.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Sibling modules (the script's folder is on sys.path when it runs as a script).
import gpu_check_report as report
import gpu_check_worker as worker

#: Versions this script was run with (CPU mode, 2-core x86_64, jax 0.10.2); others get a warning.
TESTED = {"python": "3.11", "jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "optax": "0.2.8"}
#: The custom spec of point 1: keep q/k/v on device, send the MLP output to host memory.
CUSTOM = {"query_proj": "save", "key_proj": "save", "value_proj": "save", "mlpwo": "offload"}
#: Per mode: model and shape, policies (most valuable first), steps, and per kind of point an
#: initial time estimate and a timeout (seconds). Estimates are replaced by observed durations.
#: An optional ``"measure"`` list names the policies given a ``measure`` point (default: every
#: one; the test suite's quick CPU run measures one).
MODES: dict[str, dict[str, Any]] = {
    "gpu": {
        "model": "llama3.2-1b",
        "seq_len": 4096,
        "batch_size": 1,
        "policies": [
            "save-nothing",
            "no-remat",
            "save-dots-no-batch",
            "offload-layer-inputs",
            CUSTOM,
            "save-layer-inputs",
        ],
        "grads": {
            "model": "tiny-llama",
            "seq_len": 64,
            "batch_size": 2,
            "policies": [
                "no-remat",
                "offload-layer-inputs",
                "offload-to-host",
                "offload-qkv-proj",
                CUSTOM,
            ],
        },
        "warmup": 2,
        "timed": 5,
        "estimate_s": {
            "preflight": 20,
            "measure": 75,
            "predict": 90,
            "grads": 45,
            "recommend": 120,
        },
        "timeout_s": {
            "preflight": 90,
            "measure": 200,
            "predict": 300,
            "grads": 150,
            "recommend": 300,
        },
    },
    "cpu": {
        "model": "tiny-llama",
        "seq_len": 64,
        "batch_size": 2,
        "policies": ["save-nothing", "no-remat"],
        "grads": {
            "model": "tiny-llama",
            "seq_len": 32,
            "batch_size": 2,
            "policies": ["no-remat", CUSTOM],
        },
        "warmup": 1,
        "timed": 2,
        "estimate_s": {"preflight": 6, "measure": 10, "predict": 15, "grads": 10, "recommend": 20},
        # Generous: a test must not fail because other processes share the cores.
        "timeout_s": dict.fromkeys(("preflight", "measure", "predict", "grads", "recommend"), 300),
    },
}


def versions() -> dict[str, str | None]:
    """Installed versions (package metadata; JAX is not initialised), plugins included."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax-cuda", "jax_cuda", "jax-rocm")):
            out[name] = dist.version
    return out


def version_warnings(found: dict[str, str | None]) -> list[str]:
    """One line per package whose version differs from :data:`TESTED` (a warning, not a stop)."""
    lines = []
    for name, tested in TESTED.items():
        got = found.get(name)
        if got is None or not (got == tested or got.startswith(tested + ".")):
            lines.append(f"{name} {got} was not tested (tested: {tested}); results may differ")
    return lines


#: CPU mode's XLA flags: LLVM optimisation off (remat_kit.memory's fast-compile options: they
#: change how fast code is generated, not buffer assignment), so the test suite stays quick.
_FAST_CPU_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


class Results:
    """The output folder: rows appended to JSONL (flush + fsync each), summary rewritten."""

    def __init__(self, out: Path, mode: dict[str, Any], resume: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.summary, self.log = (
            out / "gpu_check.jsonl",
            out / "summary.md",
            out / "workers.log",
        )
        self.mode, self.lock, self.rows = mode, threading.Lock(), []
        if resume and self.jsonl.exists():
            self.rows = [json.loads(ln) for ln in self.jsonl.read_text().splitlines() if ln]
        elif self.jsonl.exists():
            self.jsonl.unlink()

    def done(self, point_id: str) -> bool:
        return any(r["id"] == point_id and r["status"] == "ok" for r in self.rows)

    def add(self, row: dict[str, Any], stderr: str = "") -> None:
        with self.lock:
            self.rows.append(row)
            with self.jsonl.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
            if stderr:
                with self.log.open("a") as f:
                    f.write(f"== {row['id']} ({row['status']})\n{stderr[-4000:]}\n")
            self.write_summary()

    def write_summary(self) -> None:
        """Rewrite ``summary.md``; a bug in the tables must not stop a device run (the JSONL
        rows are the record), so it writes the exception there instead."""
        try:
            text = report.summary(self.rows, self.mode)
        except Exception as err:
            text = f"# gpu_check summary\n\nsummary failed: {type(err).__name__}: {err}\n"
        tmp = self.summary.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.summary)


class Runner:
    """Starts points in worker processes while the budget allows; records every outcome."""

    def __init__(self, results: Results, mode: dict[str, Any], budget_s: float, cpu: bool):
        self.results, self.mode, self.cpu = results, mode, cpu
        self.deadline = time.monotonic() + budget_s
        self.estimate = dict(mode["estimate_s"])

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, point_id: str, kind: str, args: dict[str, Any], cpu_only: bool = False) -> dict:
        """Run one point unless done (``--resume``) or over budget; return its row."""
        if self.results.done(point_id):
            return next(r for r in self.results.rows if r["id"] == point_id and r["status"] == "ok")
        row: dict[str, Any] = {"id": point_id, "kind": kind, "args": args, "started": time.time()}
        if self.remaining() < self.estimate[kind]:
            row.update(
                status="skipped",
                error=f"estimated {self.estimate[kind]:.0f} s > "
                f"{max(0.0, self.remaining()):.0f} s left of the budget",
            )
            self.results.add(row)
            return row
        timeout = max(1.0, min(self.mode["timeout_s"][kind], self.remaining()))
        row.update(self._spawn(kind, args, timeout, cpu_only))
        self.estimate[kind] = max(self.estimate[kind] * 0.5, row["wall_s"] * 1.15)
        stderr = row.pop("stderr", "")
        self.results.add(row, stderr)
        print(
            f"[gpu_check] {point_id}: {row['status']} in {row['wall_s']:.1f} s"
            + (f" ({row['error'][:160]})" if row.get("error") else ""),
            flush=True,
        )
        return row

    def _spawn(self, kind: str, args: dict[str, Any], timeout: float, cpu_only: bool) -> dict:
        env = dict(os.environ)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
        if self.cpu or cpu_only:
            env["JAX_PLATFORMS"] = "cpu"  # never touches the GPU (deviceless lane, CPU mode)
        if self.cpu:  # CPU mode: half the compile time; code generation only, same memory
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_FAST_CPU_FLAGS}".strip()
        cmd = [sys.executable, __file__, "--worker", kind, "--args", json.dumps(args)]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as err:  # keep a partial result printed before
            partial = worker.parse(_text(err.stdout)) or {}
            return {
                **partial,
                "status": "timeout",
                "error": f"killed after {timeout:.0f} s",
                "wall_s": time.monotonic() - start,
                "stderr": _text(err.stderr),
            }
        wall = time.monotonic() - start
        result = worker.parse(proc.stdout)
        if result is None or (result.get("partial") and proc.returncode):
            tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
            return {
                **(result or {}),
                "status": worker.classify(proc.stderr),
                "wall_s": wall,
                "error": f"exit {proc.returncode}: " + " | ".join(tail)[-1500:],
                "stderr": proc.stderr,
            }
        return {"wall_s": wall, "stderr": proc.stderr, **result}


def _text(stream: str | bytes | None) -> str:
    """A captured stream as text (``TimeoutExpired`` may hold bytes even with ``text=True``)."""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def background_lane(runner: Runner, policies: list, mode: dict[str, Any]) -> None:
    """Deviceless ``h200`` predictions, then ``recommend`` with a budget set from them."""
    shape = {k: mode[k] for k in ("model", "seq_len", "batch_size")}
    pred = runner.run(
        "predict/h200", "predict", {**shape, "target": "h200", "policies": policies}, cpu_only=True
    )
    named = [p for p in policies if isinstance(p, str)]
    runner.run(
        "recommend/h200",
        "recommend",
        {
            **shape,
            "target": "h200",
            "policies": named,
            "budget_bytes": report.choice_budget(pred, named),
        },
        cpu_only=True,
    )


def run_check(out: Path, budget_s: float, cpu: bool, resume: bool = False) -> list[dict]:
    """Run every point that fits in ``budget_s`` seconds; return the rows (also in ``out``)."""
    mode = MODES["cpu" if cpu else "gpu"]
    results = Results(out, mode, resume)
    runner = Runner(results, mode, budget_s, cpu)
    found = versions()
    print("[gpu_check] versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    warnings = version_warnings(found)
    for line in warnings:
        print(f"[gpu_check] warning: {line}", flush=True)
    results.add(
        {
            "id": "versions",
            "kind": "versions",
            "status": "ok",
            "versions": found,
            "warnings": warnings,
            "mode": "cpu" if cpu else "gpu",
            "budget_s": budget_s,
        }
    )
    pre = runner.run("preflight", "preflight", {})
    if pre["status"] == "ok":
        print(
            f"[gpu_check] device: {pre.get('device_kind')} memory_stats: {pre.get('memory_stats')}",
            flush=True,
        )
    policies = mode["policies"]
    lane = threading.Thread(target=background_lane, args=(runner, policies, mode), daemon=True)
    lane.start()
    shape = {k: mode[k] for k in ("model", "seq_len", "batch_size", "warmup", "timed")}
    for policy in mode.get("measure", policies):
        runner.run(f"measure/{report.label(policy)}", "measure", {**shape, "policy": policy})
    runner.run("grads", "grads", mode["grads"])
    # The same under jax_remat3 (issue 31): grads equal and host bytes real, or not, there.
    runner.run("grads/remat3", "grads", {**mode["grads"], "remat_impl": "remat3"})
    lane.join(timeout=max(0.0, runner.remaining()) + 5)
    if not results.done("predict/h200") and not lane.is_alive():
        args = {k: mode[k] for k in ("model", "seq_len", "batch_size")}
        runner.run(
            "predict/h200-retry", "predict", {**args, "target": "h200", "policies": policies}
        )
    results.write_summary()
    return results.rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_out", help="output folder")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget (s)")
    parser.add_argument("--cpu", action="store_true", help="tiny model on the local CPU")
    parser.add_argument("--resume", action="store_true", help="keep the ok rows already in --out")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker.emit(worker.run(args.worker, json.loads(args.args)))
        return 0
    if not args.budget_s > 0:
        print(
            f"gpu_check.py: error: --budget-s must be positive, got {args.budget_s}",
            file=sys.stderr,
        )
        return 2
    start = time.monotonic()
    rows = run_check(Path(args.out), args.budget_s, args.cpu, args.resume)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"[gpu_check] {counts} in {time.monotonic() - start:.1f} s; see {args.out}/summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
