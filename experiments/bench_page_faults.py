"""The step-time model's allocation term against measured steps on XLA:CPU.

XLA:CPU allocates a step's temp buffer (and outputs not aliased to inputs) at every execution;
glibc serves an allocation of 32 MiB or more with a fresh ``mmap`` whose pages the kernel faults
in (and zeroes) on first touch, so the step pays for them each time. The roofline prices this
as ``fresh bytes / fresh_bytes_per_s`` (:func:`remat_kit.memory.roofline.fresh_bytes`, the
calibration's fresh-output micro-kernel: :mod:`remat_kit.memory.roofline`). This benchmark
checks both halves on real train steps (a preset, the sweep's step):

- **which bytes fault**: minor page faults per step (``getrusage``) x the page size, beside
  the fresh bytes the model counts;
- **what they cost**: the same step timed twice, each in its own process: as it runs normally
  (faulting) and with glibc told to keep its heap (``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
  MALLOC_TRIM_THRESHOLD_`` large: the temp buffer is reused, its pages stay mapped). The
  difference of the medians is the measured allocation cost, beside the model's term.

Processes alternate (faulting, heap kept, faulting, ...) for ``--rounds`` rounds, and each
figure is the median over rounds of each round's median step, so drift in the machine's load
touches both modes alike.

Command (the committed figures: ``experiments/results/cpu/page_faults.md``)::

    python experiments/bench_page_faults.py --out experiments/results/cpu

Runtime: about 4.5 minutes on a 2-core AMD EPYC VM (3 policies x 2 sequence lengths x 2 modes x 3
rounds, each process compiling its steps).
Hardware: this machine's CPU; Linux with glibc only (``getrusage`` page-fault counts and the
``MALLOC_*`` tunables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROG = "bench_page_faults.py"
#: glibc tunables that keep freed memory in the heap (mallopt(3)): one arena, no mmap, no trim.
KEEP_HEAP = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
}


def worker(model: str, batch: int, seqs: list[int], policies: list[str], steps: int) -> None:
    """Print one JSON line per (policy, seq): median step seconds, median faults per step and
    the compiled step's memory parts."""
    import dataclasses
    import resource

    import jax
    import jax.numpy as jnp

    from remat_kit.memory.reading import memory_parts
    from remat_kit.models import get_config
    from remat_kit.training.step import (
        abstract_batch,
        init_train_state,
        make_optimizer,
        make_train_step,
    )

    for seq in seqs:
        for policy in policies:
            config = dataclasses.replace(get_config(model), remat_policy=policy)
            optimizer = make_optimizer()
            state = init_train_state(config, optimizer, jax.random.key(0))
            data = {k: jnp.zeros(v.shape, v.dtype) for k, v in abstract_batch(batch, seq).items()}
            compiled = make_train_step(config, optimizer).lower(state, data).compile()
            for _ in range(3):  # warm: the first executions fault in the arguments and code
                state, metrics = jax.block_until_ready(compiled(state, data))
            times, faults = [], []
            for _ in range(steps):
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                state, metrics = jax.block_until_ready(compiled(state, data))
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            row = {"policy": policy, "seq": seq, "step_s": statistics.median(times)}
            row |= {"faults": statistics.median(faults), "parts": memory_parts(compiled)}
            print(json.dumps(row), flush=True)


def run_worker(args: argparse.Namespace, keep_heap: bool) -> list[dict]:
    env = dict(os.environ, **(KEEP_HEAP if keep_heap else {}))
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--batch", str(args.batch)]
    cmd += ["--seqs", *map(str, args.seqs), "--policies", *args.policies]
    cmd += ["--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-10m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqs", type=int, nargs="+", default=[128, 256])
    p.add_argument("--policies", nargs="+", default=["no-remat", "save-nothing", "save-dots"])
    p.add_argument("--steps", type=int, default=7, help="timed steps per process and point")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="folder for page_faults.{json,md}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.model, args.batch, args.seqs, args.policies, args.steps)
        return 0
    if not sys.platform.startswith("linux"):
        print(f"{PROG}: error: needs Linux with glibc, got {sys.platform!r}", file=sys.stderr)
        return 2

    from remat_kit.memory import calibration
    from remat_kit.memory.roofline import fresh_bytes
    from remat_kit.sweep.results import environment

    figures = calibration.calibrate()  # before the workers: a quiet machine
    runs: dict[bool, list[list[dict]]] = {False: [], True: []}
    for r in range(args.rounds):
        for keep in (False, True):
            runs[keep].append(run_worker(args, keep))
            print(f"round {r + 1}/{args.rounds} {'heap kept' if keep else 'faulting'}", flush=True)

    page = os.sysconf("SC_PAGE_SIZE")
    rows = []
    for i, first in enumerate(runs[False][0]):
        faulting = statistics.median(rnd[i]["step_s"] for rnd in runs[False])
        kept = statistics.median(rnd[i]["step_s"] for rnd in runs[True])
        fresh = fresh_bytes(first["parts"])
        predicted = fresh / figures.fresh_bytes_per_s if figures.fresh_bytes_per_s else None
        measured = faulting - kept
        rows.append({
            "policy": first["policy"], "seq": first["seq"],
            "temp_bytes": first["parts"]["temp_bytes"], "fresh_bytes": fresh,
            "faulted_bytes": statistics.median(rnd[i]["faults"] for rnd in runs[False]) * page,
            "faulted_bytes_heap_kept": statistics.median(rnd[i]["faults"] for rnd in runs[True])
            * page,
            "step_s": faulting, "step_s_heap_kept": kept,
            "measured_allocation_s": measured, "predicted_allocation_s": predicted,
            "error_s": None if predicted is None else predicted - measured,
        })  # fmt: skip
    env = environment()
    result = {
        "command": "python experiments/bench_page_faults.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model, "batch": args.batch, "rounds": args.rounds, "steps": args.steps,
        "fresh_bytes_per_s": figures.fresh_bytes_per_s, "page_bytes": page,
        "environment": env, "rows": rows,
    }  # fmt: skip
    md = markdown(result)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "page_faults.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "page_faults.md").write_text(md)
    return 0


def markdown(result: dict) -> str:
    mib = 2**20
    env = result["environment"]
    lines = [
        f"**{result['model']}, batch {result['batch']}**: the allocation term (fresh bytes / "
        f"{result['fresh_bytes_per_s'] / 1e9:.2f} GB/s, the calibration's fresh-output rate) "
        "beside the measured cost (median step, faulting minus heap kept; "
        f"{result['rounds']} rounds x {result['steps']} steps)",
        "",
        "| policy | seq | temp MiB | fresh MiB (model) | faulted MiB (measured) | step ms | "
        "heap kept ms | allocation ms measured | predicted | error |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in result["rows"]:
        pred = r["predicted_allocation_s"]
        lines.append(
            f"| {r['policy']} | {r['seq']} | {r['temp_bytes'] / mib:.1f} | "
            f"{r['fresh_bytes'] / mib:.1f} | {r['faulted_bytes'] / mib:.1f} | "
            f"{r['step_s'] * 1e3:.0f} | {r['step_s_heap_kept'] * 1e3:.0f} | "
            f"{r['measured_allocation_s'] * 1e3:.0f} | "
            + ("null |" if pred is None else f"{pred * 1e3:.0f} | ")
            + ("null |" if pred is None else f"{(pred - r['measured_allocation_s']) * 1e3:+.0f} |")
        )
    lines += [
        "",
        f"{env['cpu_count']}-core {env['cpu_model']} ({env['backend']} backend), "
        f"jax {env['jax']}. Command: `{result['command']}`.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
