"""``remat-kit doctor``: check that a remat policy does what it promises on a model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from remat_kit import targets
from remat_kit.cli import args as A
from remat_kit.cli.console import console
from remat_kit.doctor import check_policies
from remat_kit.doctor.checks import DEFAULT_SHAPE
from remat_kit.memory import CompileError
from remat_kit.policies import get_policy_spec, policy_names
from remat_kit.terminal import group_notes


def add(subparsers) -> None:
    """Register ``doctor``."""
    p = subparsers.add_parser(
        "doctor",
        help="check that a remat policy does what it promises on a model",
        description="Compare what a policy promises (tags saved, offloaded, the rest recomputed) "
        "with what the traced and compiled training step does; one line per finding: what is "
        "wrong, the likely cause, the fix (a cause and fix several findings share, once). Exit "
        "code 1 when a finding is an error.",
    )
    A.add_model(p, "tiny-gpt or llama3-8b")
    A.add_maxtext(p)
    A.add_policy(
        p,
        "policy to check (default: every registered policy; for a MODULE:FACTORY program, "
        "those that act on its checkpoint names, the rest in one note)",
    )
    A.add_batch(p, DEFAULT_SHAPE[0])
    A.add_seq(p, DEFAULT_SHAPE[1])
    A.add_target(p, "local")
    p.add_argument(
        "--no-scan", action="store_true",
        help="presets: unrolled layers instead of nn.scan (scan_layers)",
    )  # fmt: skip
    p.add_argument("--group-size", type=A.positive_int, default=None,
                   help="presets: remat_group_size (default 1)")  # fmt: skip
    A.add_json(p, "findings")
    A.add_no_cache(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit doctor``: 0 no error finding, 1 some (or a step XLA cannot compile:
    one line, as ``analyze`` says it)."""
    try:
        return _run(args)
    except CompileError as err:
        print(f"{A.PROG}: error: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    """A preset (default: every registered policy, at batch 2, seq 64) or a user's program
    (default: the registered policies that act on its own checkpoint names, the others in one
    note line)."""
    targets.get_target(args.target)
    fixed = {}
    if not A.is_program_ref(args.model):
        args.batch, args.seq = args.batch or DEFAULT_SHAPE[0], args.seq or DEFAULT_SHAPE[1]
        fixed = dict(scan_layers=not args.no_scan, remat_group_size=args.group_size or 1)
    flags = {"--no-scan": args.no_scan, "--group-size": args.group_size}
    program = A.read_program(args, preset_only=flags, **fixed)
    specs = args.policy
    if specs is None and program.known.default_policy is not None:  # a bundled model: every one
        specs = [get_policy_spec(n) for n in policy_names()]
    result = check_policies(program, specs, args.target)
    labels = [c.label for c in result.checks]
    notes = list(result.notes)
    if program.known.default_policy is None:
        emitted = ", ".join(sorted(result.tags)) or "no tags"
        notes.insert(0, f"program {program.name!r} emits: {emitted}")
    _print(args, labels, [list(c.findings) for c in result.checks], notes)
    return 1 if result.has_errors else 0


def _print(args, labels, results, notes) -> None:
    if args.json:
        out = {
            label: [dataclasses.asdict(f) for f in findings]
            for label, findings in zip(labels, results, strict=True)
        }
        if notes:
            out = {"policies": out, "notes": notes}
        print(json.dumps(out, indent=2))
        return
    out = console()
    for line in notes:
        out.print(f"note: {line}", highlight=False, markup=False)
    clean = [label for label, findings in zip(labels, results, strict=True) if not findings]
    if clean:
        out.print(f"no finding: {', '.join(clean)}", highlight=False, markup=False)
    # each finding after its policy, a cause and fix several share said once after them
    found = [(label, [f.line() for f in fs]) for label, fs in zip(labels, results, strict=True)]
    for line in group_notes([(label, lines) for label, lines in found if lines], everyone=None):
        out.print(line, highlight=False, markup=False)
