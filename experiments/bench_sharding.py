"""Per-device memory under FSDP, compiled deviceless for H100s (issue 9 benchmark).

Command: ``python experiments/bench_sharding.py`` (~2-5 min on 2 CPU cores, no GPU needed).
Hardware: any; compiles for h100-sxm topologies "1x1xN" with the CUDA plugin (``[cuda12]``).
Writes experiments/results/sharding/fsdp.json: for llama3-8b at s=8192, one sequence per device,
save-nothing, N = 1, 8 (and 64 with --large), the compiled per-device peak next to
(params + optimizer state) / N + the per-device activations of N=1; and the wall time of
llama3-70b over 64 GPUs (fsdp=64) for one policy.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import jax

from remat_kit.memory import analyze_model

GIB = 2**30
OUT = Path(__file__).parent / "results" / "sharding" / "fsdp.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", action="store_true", help="also N=64 and llama3-70b over 64 GPUs")
    args = ap.parse_args()
    rows = []
    base = None
    for n in (1, 8, 64) if args.large else (1, 8):
        t = time.perf_counter()
        r = analyze_model(
            "llama3-8b", n, 8192, "save-nothing", "h100-sxm",
            mesh=None if n == 1 else f"fsdp={n}", compare_offload=False,
        )  # fmt: skip
        wall = time.perf_counter() - t
        state = r.arguments["params"] + r.arguments["opt_state"]
        if base is None:
            base = r
        activations_1 = base.peak_bytes - (base.arguments["params"] + base.arguments["opt_state"])
        full_state = base.arguments["params"] + base.arguments["opt_state"]
        estimate = full_state / n + activations_1
        rows.append({
            "model": "llama3-8b", "seq_len": 8192, "batch_per_device": 1, "devices": n,
            "mesh": f"fsdp={n}", "policy": "save-nothing", "target": "h100-sxm",
            "peak_gib": r.peak_bytes / GIB, "state_gib_per_device": state / GIB,
            "estimate_gib": estimate / GIB, "ratio_peak_to_estimate": r.peak_bytes / estimate,
            "analysis_s": wall,
        })  # fmt: skip
        print(rows[-1], flush=True)
    if args.large:
        t = time.perf_counter()
        r = analyze_model("llama3-70b", 64, 8192, "save-nothing", "h100-sxm", mesh="fsdp=64",
                          compare_offload=False)  # fmt: skip
        rows.append(
            {
                "model": "llama3-70b",
                "devices": 64,
                "mesh": "fsdp=64",
                "peak_gib": r.peak_bytes / GIB,
                "analysis_s": time.perf_counter() - t,
            }
        )
        print(rows[-1], flush=True)
    meta = {"jax": jax.__version__, "backend": "deviceless h100-sxm (XLA GPU compiler on CPU host)",
            "host": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs"}  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
