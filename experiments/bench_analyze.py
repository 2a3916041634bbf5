"""Benchmark and figures for ``remat-kit analyze`` (issue 3).

Command (CPU machine; GPU targets compile deviceless with the CUDA plugin)::

    JAX_PLATFORMS=cpu python experiments/bench_analyze.py            # everything, ~3-6 min
    JAX_PLATFORMS=cpu python experiments/bench_analyze.py --quick    # CLI timing only (~30 s)

Writes ``experiments/results/analyze/``:

- ``llama3-8b_b1_s8192_h100-sxm.json``: the ``--all-policies --json`` output (13 reports);
- ``per_layer.jsonl``: one row per (block, target, policy): Korthikanti et al. 2022's per-layer
  activation bytes, JAX's residual bytes, and the compiled per-layer bytes (from 2 and 4 layers);
- ``llama3-8b_b1_s8192_h100-sxm.txt``: the same as a table;
- ``cli_runs.jsonl``: one row appended per timed CLI run (wall and CPU seconds, load average:
  the machine is shared, so wall time varies with what else runs);
- ``bench.json``: the last run: machine (cores, jax version), CLI timing, the FLOPs split (JAX
  remat vs XLA's own), and two consistency checks: the memory figures do not depend on the
  code-generation-only options or on the shared kernel cache.

Expected on a 2-core x86 VM, jax 0.10.2, H100 target: llama3-8b b=1 s=8192 all 13 policies in
~20-35 s wall when the machine is otherwise idle (about 30-35 CPU-seconds: 13 lowerings, one full
compile, the rest sharing its GPU kernels); save-nothing peaks at 81.2 GiB, full remat keeps
exactly 2sbh per layer on the H100 target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "analyze"
CLI_ARGS = [
    "analyze", "--model", "llama3-8b", "--batch", "1", "--seq", "8192", "--target", "h100-sxm",
    "--all-policies",
]  # fmt: skip
TEXTBOOK_POLICIES = ["no-remat", "save-dots-no-batch", "save-nothing"]


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_cli() -> dict:
    """Time ``remat-kit analyze ... --all-policies`` end to end in a fresh process."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = _loadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", *CLI_ARGS, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"CLI failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    (OUT / "llama3-8b_b1_s8192_h100-sxm.json").write_text(proc.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "remat-kit " + " ".join(CLI_ARGS),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "loadavg_before": load,
        "loadavg_after": _loadavg(),
        "cpus": os.cpu_count(),
    }
    with open(OUT / "cli_runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(path: Path) -> str:
    """The CLI's table, from its JSON output."""
    data = json.loads(path.read_text())
    rows = [
        f"{'policy':22s} {'peak GiB':>9s} {'host GiB':>9s} {'act GiB':>8s} {'recompute':>9s} "
        f"{'fits':>5s} {'vs on-device':>13s}"
    ]
    for r in data["reports"]:
        twin = r.get("peak_bytes_without_offload")
        delta = "" if twin is None else f"{(r['peak_bytes'] - twin) / 2**30:+.2f}"
        rows.append(
            f"{r['policy']:22s} {r['peak_bytes'] / 2**30:9.2f} {r['host_bytes'] / 2**30:9.2f} "
            f"{r['activation_bytes'] / 2**30:8.2f} {r['recompute_ratio']:8.2f}x "
            f"{'yes' if r['fits'] else 'no':>5s} {delta:>13s}"
        )
    return "\n".join(rows)


def per_layer() -> list[dict]:
    """Textbook vs jaxpr vs compiled per-layer activation bytes."""
    import remat_kit
    from remat_kit.zoo.textbook import per_layer_activations

    blocks = [
        # (label, config, batch, seq, targets)
        ("gpt2-medium", remat_kit.get_config("gpt2-medium"), 8, 1024, ["h100-sxm", "cpu"]),
        (
            "gpt-block-h2048",  # the design notes' GPT block: b=1, s=2048, h=2048, 16 heads
            remat_kit.get_config(
                "gpt2-medium", d_model=2048, num_heads=16, d_ff=8192, max_seq_len=2048
            ),
            1,
            2048,
            ["h100-sxm"],
        ),
        ("llama3-8b", remat_kit.get_config("llama3-8b"), 1, 8192, ["h100-sxm"]),
    ]
    rows = []
    for label, config, b, s, targets in blocks:
        for target in targets:
            t0 = time.perf_counter()
            for x in per_layer_activations(config, b, s, TEXTBOOK_POLICIES, target=target):
                row = {"block": label, **dataclasses.asdict(x)}
                rows.append(row)
                mib = [
                    (v or 0) / 2**20 for v in (x.textbook_bytes, x.jaxpr_bytes, x.compiled_bytes)
                ]
                print(
                    f"{label:16s} {target:9s} {x.policy:19s} textbook {mib[0]:9.1f} MiB  "
                    f"jaxpr {mib[1]:9.1f} MiB  compiled {mib[2]:9.1f} MiB  ratio {x.ratio:.2f}",
                    flush=True,
                )
            print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    with open(OUT / "per_layer.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def flops_split(reports_path: Path) -> list[dict]:
    """Compiled FLOPs against the jaxpr's (JAX's own remat) for each policy: the rest is XLA's
    rematerialisation pass."""
    import remat_kit
    from remat_kit import targets
    from remat_kit.training.step import abstract_batch, abstract_train_state, make_train_step
    from remat_kit.walker import traced_flops

    reports = json.loads(reports_path.read_text())["reports"]
    opt = remat_kit.make_optimizer("adamw")
    sharding = targets.abstract_sharding("h100-sxm")
    config = remat_kit.get_config("llama3-8b")
    state = targets.abstractify(abstract_train_state(config, opt), sharding)
    batch = targets.abstractify(abstract_batch(1, 8192), sharding)
    out = []
    for r in reports:
        step = make_train_step(config.replace(remat_policy=r["policy"]), opt, jit=False)
        traced = traced_flops(step, state, batch)
        out.append(
            {
                "policy": r["policy"],
                "jaxpr_ratio": round(traced / r["flops_no_remat"], 3),
                "compiled_ratio": round(
                    r.get("compiled_recompute_ratio") or r["recompute_ratio"], 3
                ),
                "xla_extra": round(r["flops"] / traced, 3),
            }
        )
    return out


def consistency(reports_path: Path) -> dict:
    """Memory figures with a fresh, slow compile (no fast options, no shared kernel cache)
    against the CLI's (fast options; all but the first compile reuse kernels)."""
    from remat_kit.memory import analyze_model

    reports = {r["policy"]: r for r in json.loads(reports_path.read_text())["reports"]}
    parts = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "host_bytes")
    out = {}
    for policy in ("save-dots-no-batch", "offload-layer-inputs"):
        slow = analyze_model(
            "llama3-8b", 1, 8192, policy, "h100-sxm", fast_compile=False, compare_offload=False
        )
        fast = reports[policy]
        out[policy] = {
            "identical": all(getattr(slow, p) == fast[p] for p in parts),
            "slow_compile_s": slow.compile_s,
            "fast_compile_s": fast["compile_s"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only time the CLI")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    import jax

    bench = {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "backend": "XLA:CPU host; H100 target compiled deviceless (jax-cuda12-plugin)",
        },
        "cli": run_cli(),
    }
    reports_path = OUT / "llama3-8b_b1_s8192_h100-sxm.json"
    print(json.dumps(bench["cli"], indent=1))
    text = table(reports_path)
    (OUT / "llama3-8b_b1_s8192_h100-sxm.txt").write_text(
        bench["cli"]["command"] + "\n" + text + "\n"
    )
    print(text)
    if not args.quick:
        bench["flops_split"] = flops_split(reports_path)
        print(json.dumps(bench["flops_split"], indent=1))
        bench["consistency"] = consistency(reports_path)
        print(json.dumps(bench["consistency"], indent=1))
        bench["per_layer_rows"] = len(per_layer())
        (OUT / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")


if __name__ == "__main__":
    main()
