"""``remat-kit doctor``: check that a remat policy does what it promises on a model."""

from __future__ import annotations

import argparse
import dataclasses
import json

from remat_kit import targets
from remat_kit.cli import args as A
from remat_kit.doctor import check_policies, has_errors
from remat_kit.policies import get_policy_spec, policy_label, policy_names


def add(subparsers) -> None:
    """Register ``doctor``."""
    p = subparsers.add_parser(
        "doctor",
        help="check that a remat policy does what it promises on a model",
        description="Compare what a policy promises (tags saved, offloaded, the rest recomputed) "
        "with what the traced and compiled training step does; one line per finding: what is "
        "wrong, the likely cause, the fix. Exit code 1 when a finding is an error.",
    )
    A.add_model(p, "tiny-gpt or llama3-8b")
    A.add_policy(p, "policy to check (default: every registered policy)")
    A.add_batch(p, default=2)
    A.add_seq(p, default=64)
    A.add_target(p, "cpu")
    p.add_argument(
        "--no-scan", action="store_true", help="unrolled layers instead of nn.scan (scan_layers)"
    )
    p.add_argument("--group-size", type=A.positive_int, default=1, help="remat_group_size")
    A.add_json(p, "findings")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit doctor``: 0 no error finding, 1 some."""
    config = A.resolve_model(args, scan_layers=not args.no_scan, remat_group_size=args.group_size)
    targets.get_target(args.target)
    specs = args.policy or [get_policy_spec(n) for n in policy_names()]
    A.check_shape(config, args.batch, args.seq)
    labels = [policy_label(s) for s in specs]
    results = check_policies(config, args.batch, args.seq, specs, args.target)
    if args.json:
        out = {
            label: [dataclasses.asdict(f) for f in findings]
            for label, findings in zip(labels, results, strict=True)
        }
        print(json.dumps(out, indent=2))
    else:
        for label, findings in zip(labels, results, strict=True):
            print(f"{label}: " + ("ok" if not findings else f"{len(findings)} finding(s)"))
            for f in findings:
                print(f"  {f.line()}")
    return 1 if any(has_errors(f) for f in results) else 0
