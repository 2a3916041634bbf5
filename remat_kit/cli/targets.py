"""``remat-kit targets``: the compile targets."""

from __future__ import annotations

import argparse
import json

from remat_kit import targets
from remat_kit.cli import args as A
from remat_kit.cli.console import add_row, console, table
from remat_kit.units import gib


def add(subparsers) -> None:
    """Register ``targets``."""
    p = subparsers.add_parser("targets", help="list the compile targets")
    A.add_json(p, "the targets")
    p.set_defaults(func=run)


def rows() -> list[dict]:
    """One dict per registered target (the ``--json`` rows)."""
    out = []
    for name in targets.target_names():
        t = targets.get_target(name)
        out.append(
            {
                "name": t.name,
                "platform": t.platform,
                "memory_bytes": t.memory_bytes,
                "peak_flops_bf16": t.peak_flops_bf16,
                "deviceless": t.deviceless,
                "description": t.description,
                "devices": t.num_devices,
            }
        )
    return out


def tpu_rows() -> list[dict]:
    """One row per TPU generation for the table (the slices one by one are in ``--json``)."""
    out = []
    for g, chip in targets.CHIPS.items():
        names = targets.slice_names(g)
        first = targets.get_target(names[0])
        out.append(
            {
                "name": f"{g}-N",
                "platform": "tpu",
                "memory_bytes": chip.memory_bytes,
                "peak_flops_bf16": chip.peak_flops_bf16,
                "deviceless": first.deviceless,
                "description": f"{chip.description}; {names[0]} ... {names[-1]} "
                f"({len(names)} sizes)",
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit targets``."""
    data = rows()
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    cols = ("name", "platform", "memory GiB", "bf16 TFLOP/s", "compiled", "description")
    t = table("compile targets (per device; a TPU device is a chip)", cols)
    for r in [r for r in data if r["platform"] != "tpu"] + tpu_rows():
        flops = "-" if r["peak_flops_bf16"] is None else f"{r['peak_flops_bf16'] / 1e12:.0f}"
        add_row(
            t, r["name"], r["platform"], gib(r["memory_bytes"], 1), flops,
            "deviceless" if r["deviceless"] else "local", r["description"],
        )  # fmt: skip
    console().print(t)
    return 0
