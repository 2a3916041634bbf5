"""The GPU estimate's order of three remat settings on every bundled preset (issue: no-remat
<= save-dots-no-batch <= save-nothing where all fit).

For each published-shape preset, compiled deviceless for a GPU target at a shape where every
policy fits, prints the per-layer estimated step time of ``no-remat``, ``save-dots-no-batch``
and ``save-nothing`` (per layer = (step with 4 layers - step with 2 layers) / 2, so the
embedding, loss and optimizer update cancel), whether they come in that order, and the terms
of the time model that decide it (matmul, memory, collectives, per layer). Writes
``order.json`` and ``order.md`` under ``--out``.

Command (the committed figures: ``experiments/results/published/``)::

    python experiments/bench_gpu_order.py --target h100-sxm --out experiments/results/published

Runtime: 12 presets x 3 policies x 2 depths = 72 deviceless compiles, ~10 min on 2 CPU cores
(remat-kit's compile cache makes a repeat take seconds). Hardware: none needed (deviceless
compiles for the target); the table names the target, backend and jax version.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

import remat_kit
from remat_kit.models import PRESETS, preset_names

POLICIES = ("no-remat", "save-dots-no-batch", "save-nothing")
#: Sequences per step and tokens per sequence: small enough that no-remat fits one GPU at
#: every preset's width (4 layers), long enough that attention and the MLP matter.
BATCH, SEQ = 1, 2048
TERMS = ("compute_s", "memory_s", "collective_s", "elementwise_s", "launch_s")


def per_layer(preset: str, target: str) -> dict[str, dict[str, float]]:
    """Per-layer estimated seconds (total and by term) of each policy on ``preset``."""
    steps = {}
    for layers in (2, 4):
        # GPT-2 has 1024 learned positions: SEQ of them instead
        longer = {"max_seq_len": SEQ} if PRESETS[preset].max_seq_len < SEQ else {}
        config = remat_kit.get_config(preset, num_layers=layers, scan_layers=True, **longer)
        program = remat_kit.preset(config, BATCH, SEQ)
        reports = remat_kit.analyze_policies(program, list(POLICIES), target=target)
        steps[layers] = {r.policy: r for r in reports}
    out = {}
    for policy in POLICIES:
        a, b = steps[2][policy].step_time, steps[4][policy].step_time
        row = {"step_s": (b.step_time_s - a.step_time_s) / 2}
        row |= {t: (getattr(b, t) - getattr(a, t)) / 2 for t in TERMS}
        row["fits"] = bool(steps[4][policy].fits)
        out[policy] = row
    return out


def table(rows: dict[str, dict], target: str) -> str:
    head = (
        f"Per-layer estimated step time (ms), {target} (deviceless), batch {BATCH}, seq {SEQ}, "
        f"scanned layers, jax {jax.__version__}; memory / matmul / collective terms of each "
        "policy in brackets.\n\n"
        "| preset | no-remat | save-dots-no-batch | save-nothing | in order |\n"
        "|---|---|---|---|---|"
    )
    lines = [head]
    for preset, row in rows.items():
        cells = [
            f"{row[p]['step_s'] * 1e3:.3f} (mem {row[p]['memory_s'] * 1e3:.2f} / mm "
            f"{row[p]['compute_s'] * 1e3:.2f} / coll {row[p]['collective_s'] * 1e3:.2f})"
            for p in POLICIES
        ]
        times = [row[p]["step_s"] for p in POLICIES]
        ordered = "yes" if times == sorted(times) else "no"
        lines.append(f"| {preset} | {' | '.join(cells)} | {ordered} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/published"))
    parser.add_argument("--preset", action="append", help="only these presets (repeatable)")
    args = parser.parse_args(argv)
    presets = args.preset or [p for p in preset_names() if not p.startswith(("tiny", "gpt-10m"))]
    rows = {}
    for preset in presets:
        rows[preset] = per_layer(preset, args.target)
        print(f"{preset}: " + ", ".join(
            f"{p} {rows[preset][p]['step_s'] * 1e3:.3f} ms" for p in POLICIES
        ), flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"order_{args.target}"
    (args.out / f"{name}.json").write_text(
        json.dumps(
            {
                "target": args.target,
                "jax": jax.__version__,
                "batch": BATCH,
                "seq": SEQ,
                "rows": rows,
            },
            indent=1,
        )  # fmt: skip
    )
    text = table(rows, args.target)
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
