"""Timelines of four policies for llama3-8b b=1 s=8192 on a deviceless H100, and XLA's own
rematerialisation told apart (issue 16).

Command (CPU machine; the GPU target compiles deviceless with the CUDA plugin)::

    JAX_PLATFORMS=cpu python experiments/bench_timeline.py            # ~2-3 min on 2 cores
    JAX_PLATFORMS=cpu python experiments/bench_timeline.py --quick    # llama3.2-1b s=2048

Runs, each in a fresh process (so neither inherits the other's traces and caches):

1. ``baseline``: the analysis without timelines (the runner's ``build_timeline`` replaced by
   ``None`` for this run only) and no second compile;
2. ``timeline``: the analysis with a timeline per report and the peak of the policy alone (the
   pass-off compile where XLA's pass fired: ``policy_alone_peak=True``) and the PNG:
   ``analyze_policies`` then ``remat_kit.plots.timeline``.

Writes ``experiments/results/timeline/``: ``<model>_b1_s<seq>_h100-sxm.png`` (the figure),
``bench.json`` (machine, jax version, wall and CPU seconds of both runs and their ratio, and per
policy: peak, live peak, the timeline's maximum, the policy's own figures next to the compiled
ones, the XLA line, bytes by category at the peak) and ``reports.json`` (the four reports with
their timelines).

Expected on a 2-core x86 VM, jax 0.10.2: every timeline maximum equals the report's live peak;
save-nothing's own recompute ratio 1.25 (x1.53 as compiled, XLA's pass adding the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "timeline"
POLICIES = ["no-remat", "save-dots-no-batch", "save-nothing", "offload-layer-inputs"]
SHAPES = {False: ("llama3-8b", 1, 8192), True: ("llama3.2-1b", 1, 2048)}
TARGET = "h100-sxm"


def _phase(kind: str, quick: bool) -> dict:
    """One analysis in this process; returns its timing (and, for ``timeline``, the figures)."""
    import jax

    import remat_kit
    from remat_kit import plots
    from remat_kit.memory import runner

    model, b, s = SHAPES[quick]
    cpu0, t0 = time.process_time(), time.perf_counter()
    if kind == "baseline":
        runner.build_timeline = lambda *a, **k: None  # the analysis as it was before
        reports = remat_kit.memory.analyze_policies(
            remat_kit.preset(model, b, s), POLICIES, target=TARGET
        )
        png = None
    else:
        reports = remat_kit.memory.analyze_policies(
            remat_kit.preset(model, b, s), POLICIES, target=TARGET, policy_alone_peak=True
        )
        png = OUT / f"{model}_b{b}_s{s}_{TARGET}.png"
        plots.timeline(reports, png)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = {"kind": kind, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "jax": jax.__version__}
    if kind == "timeline":
        out["png"] = str(png.relative_to(REPO))
        out["policies"] = [_figures(r) for r in reports]
        (OUT / "reports.json").write_text(json.dumps([r.to_dict() for r in reports]))
    return out


def _figures(r) -> dict:
    tl, po = r.timeline, r.policy_only
    line = next((w for w in r.warnings if w.startswith("XLA recomputed")), None)
    return {
        "policy": r.policy,
        "peak_gib": round(r.peak_bytes / 2**30, 3),
        "live_peak_gib": round(r.live_peak_bytes / 2**30, 3),
        "timeline_max_gib": round(max(tl.totals()) / 2**30, 3),
        "timeline_max_equals_live_peak": max(tl.totals()) == r.live_peak_bytes,
        "host_gib": round(r.host_bytes / 2**30, 3),
        "peak_phase": tl.phase_at(tl.peak_position),
        "peak_instruction": tl.peak_instruction,
        "at_peak_gib": {c: round(v / 2**30, 3) for c, v in tl.at_peak().items()},
        "recompute_ratio_policy": r.recompute_ratio and round(r.recompute_ratio, 3),
        "recompute_ratio_compiled": r.compiled_recompute_ratio
        and round(r.compiled_recompute_ratio, 3),
        "policy_only_peak_gib": po and po.peak_bytes and round(po.peak_bytes / 2**30, 3),
        "xla_remat_instructions": po.xla_remat_instructions if po else 0,
        "xla_line": line,
        "compile_s": r.compile_s,
        "policy_only_compile_s": po and po.compile_s,
    }


def _run(kind: str, quick: bool) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    args = [sys.executable, __file__, "--phase", kind] + (["--quick"] if quick else [])
    load = [round(x, 2) for x in os.getloadavg()]
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{kind} run failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["loadavg_before"] = load
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama3.2-1b s=2048 instead")
    parser.add_argument("--phase", choices=["baseline", "timeline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.phase:
        print(json.dumps(_phase(args.phase, args.quick)))
        return
    baseline = _run("baseline", args.quick)
    shipped = _run("timeline", args.quick)
    model, b, s = SHAPES[args.quick]
    bench = {
        "command": "JAX_PLATFORMS=cpu python experiments/bench_timeline.py"
        + (" --quick" if args.quick else ""),
        "model": model, "batch_size": b, "seq_len": s, "target": TARGET, "policies": POLICIES,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "baseline": baseline,
        "timeline": shipped,
        "wall_ratio": round(shipped["wall_s"] / baseline["wall_s"], 3),
        "cpu_ratio": round(shipped["cpu_s"] / baseline["cpu_s"], 3),
        "children_cpu_s": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime, 2),
    }  # fmt: skip
    (OUT / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
    print(f"baseline {baseline['wall_s']} s, with timelines {shipped['wall_s']} s "
          f"(x{bench['wall_ratio']} wall, x{bench['cpu_ratio']} CPU)")  # fmt: skip
    for p in shipped["policies"]:
        print(
            f"{p['policy']:22} peak {p['peak_gib']:8.2f} GiB  live {p['live_peak_gib']:8.2f}  "
            f"timeline max {p['timeline_max_gib']:8.2f} ({p['timeline_max_equals_live_peak']})  "
            f"ratio x{p['recompute_ratio_policy']} own / x{p['recompute_ratio_compiled']} compiled"
        )
        if p["xla_line"]:
            print("   ", p["xla_line"])
    print("wrote", OUT)


if __name__ == "__main__":
    main()
