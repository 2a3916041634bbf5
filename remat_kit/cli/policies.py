"""``remat-kit policies``: the registered remat policies."""

from __future__ import annotations

import argparse
import json

from remat_kit.cli import args as A
from remat_kit.cli.console import add_row, console, table
from remat_kit.policies import PolicySpec, policy_specs


def add(subparsers) -> None:
    """Register ``policies``."""
    p = subparsers.add_parser(
        "policies",
        help="list the named remat policies",
        description="List the registered remat policies: what each saves, offloads and "
        "recomputes. Any command's --policy also takes a per-tag spec: " + A.POLICY_ARG_HELP,
    )
    A.add_json(p, "the policies")
    p.set_defaults(func=run)


def _what(s: PolicySpec) -> str:
    what = s.base if s.base != "names" else ""
    if s.save:
        what += "save " + ", ".join(sorted(s.save))
    if s.offload:
        what += ("; " if what else "") + "offload " + ", ".join(sorted(s.offload))
    return what or "nothing (full remat)"


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit policies``."""
    specs = policy_specs()
    if args.json:
        rows = [
            {
                "name": s.name,
                "description": s.description,
                "base": s.base,
                "save": sorted(s.save),
                "offload": sorted(s.offload),
                "source": s.source,
            }
            for s in specs.values()
        ]
        print(json.dumps(rows, indent=1))
        return 0
    t = table("remat policies", ("name", "saves / offloads", "description"))
    for s in specs.values():
        add_row(t, s.name, _what(s), s.description)
    console().print(t)
    return 0
