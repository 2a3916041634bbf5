"""Benchmark for ``remat-kit recommend`` (issue 8): picks, compiles spent, wall time, and whether
each pick's compiled peak is within the budget.

Command (CPU machine; GPU targets compile deviceless with the CUDA plugin)::

    JAX_PLATFORMS=cpu python experiments/bench_recommend.py            # all runs, ~10-15 min
    JAX_PLATFORMS=cpu python experiments/bench_recommend.py --quick    # the headline run, ~2 min

Runs (all llama3-8b, seq 8192, one device, bf16 parameters):

- ``h100_default``: h100-sxm, AdamW, batch 1, default budget (memory less 5% = 75.15 GiB), the
  named policies and group sizes: the issue's headline figure (compiles spent, goal <= 2 x 13).
- ``h100_solve``: the same with ``solve=True``.
- ``h200_solve``: h200 (141 GB), AdamW, batch 1, ``solve=True``.
- ``h100_adafactor_solve``: h100-sxm, Adafactor (factored second moments: ~30 GiB less optimizer
  state than AdamW), batch 1, ``solve=True``.
- ``h100_adafactor_auto``: the same optimizer, ``batch_size="auto"``.
- ``h100_structure`` (issue 17): ``h100_default`` with the structure search
  (``structure=True``: cuDNN attention / chunked loss when nothing fits, then partial-layer
  remat); the runs above keep ``structure=False`` to stay comparable with issue 8's figures.
- ``h200_structure``: the same on h200 (141 GB): room for fewer rematerialised layers.

Writes ``experiments/results/recommend/``: one ``<run>.json`` per run (``Recommendation.to_json``)
and ``bench.json`` (per run: wall and CPU seconds, compiles, pick, pick's peak against the budget;
the machine and its load). No GPU was available: the picks' measured step times are not compared
with the estimates.

Expected on a 2-core x86 VM, jax 0.10.2, shared machine (load average 10-25 in the committed
run, 2026-12-01): h100_default ~8 min, 26 compiles (25 named programs + 1 for the
shorter-sequence advice), nothing fits at 75.15 GiB (least: offload-layer-inputs at 80.17 GiB),
seq 4096 fits (compiled). The committed run predates the change that stopped recommend from
compiling each policy a second time with XLA's rematerialisation pass off (12 of the 26
compiles, which left one for the advice); a re-run compiles fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "recommend"
MODEL, SEQ = "llama3-8b", 8192
RUNS = {
    "h100_default": dict(target="h100-sxm", structure=False),
    "h100_solve": dict(target="h100-sxm", solve=True, structure=False),
    "h200_solve": dict(target="h200", solve=True, structure=False),
    "h100_adafactor_solve": dict(
        target="h100-sxm", optimizer="adafactor", solve=True, structure=False
    ),
    "h100_adafactor_auto": dict(target="h100-sxm", optimizer="adafactor", batch_size="auto"),
    # issue 17: cuDNN attention, chunked loss and partial-layer remat in the search
    "h100_structure": dict(target="h100-sxm", structure=True),
    "h200_structure": dict(target="h200", structure=True),
}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(name: str, kwargs: dict) -> dict:
    """One fresh :func:`recommend` call (no shared cache: every compile counted)."""
    from remat_kit.cli.recommend import print_recommendation
    from remat_kit.recommend import recommend

    load = [round(x, 2) for x in os.getloadavg()]
    t0, c0 = time.perf_counter(), _cpu_s()
    rec = recommend(MODEL, SEQ, **kwargs)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    print_recommendation(rec)
    (OUT / f"{name}.json").write_text(rec.to_json(indent=1) + "\n")
    named = sum(1 for c in rec.candidates if c.found_by == "named")
    pick = rec.pick
    row = {
        "call": f"recommend({MODEL!r}, {SEQ}, "
        + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        + ")",
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "loadavg_before": load,
        "compiles": rec.compiles,
        "named_policies": named,
        "compile_goal": 2 * named,
        "budget_bytes": rec.budget_bytes,
        "pick": None if pick is None else pick.label,
        "pick_line": rec.line(),
        "pick_peak_bytes": None if pick is None else pick.peak_bytes,
        "pick_within_budget": None if pick is None else pick.peak_bytes <= rec.budget_bytes,
        "pick_step_time_s": None if pick is None else round(pick.step_time_s, 4),
        "pick_tokens_per_s": None if pick is None else round(pick.tokens_per_s),
        "pick_batch": None if pick is None else pick.batch_size,
        "advice": list(rec.advice),
        "pick_options": None if pick is None else pick.options,
        "made_fit": rec.made_fit,
        # Every compiled candidate judged "fits" is within the budget by construction; checked.
        "all_fits_within_budget": all(
            c.peak_bytes <= rec.budget_bytes for c in rec.candidates if c.fits
        ),
    }
    if rec.solve is not None:
        s = rec.solve
        row["solve"] = {
            "combinations": s.combinations,
            "predicted_fit": s.predicted_fit,
            "verified": len(s.verified),
            "verified_fit": sum(c.fits for c in s.verified),
            "slack_bytes": s.peak_slack_bytes,
            "predicted_vs_compiled_peak_gib": [
                [round(c.predicted_peak_bytes / 2**30, 2), round(c.peak_bytes / 2**30, 2)]
                for c in s.verified
            ],
        }
    if rec.largest_batch:
        row["largest_batch"] = {
            c.label: {"batch": c.batch_size, "tokens_per_s": round(c.tokens_per_s)}
            for c in rec.largest_batch
        }
    print(json.dumps(row, indent=1), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the headline run")
    parser.add_argument("--only", action="append", choices=sorted(RUNS), help="runs to do")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    import jax

    names = ["h100_default"] if args.quick else (args.only or list(RUNS))
    path = OUT / "bench.json"
    bench = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    bench["machine"] = {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": "XLA:CPU host; GPU targets compiled deviceless (jax-cuda12-plugin)",
        "measured_step_time": "not compared: no GPU was available for this issue",
    }
    for name in names:
        bench["runs"][name] = run(name, RUNS[name])
        path.write_text(json.dumps(bench, indent=1) + "\n")


if __name__ == "__main__":
    main()
