"""``remat-kit recommend``: arguments and rendering of :func:`remat_kit.recommend.recommend`."""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Sequence

from remat_kit import targets
from remat_kit.cli import args as A
from remat_kit.cli.console import add_row, console, table
from remat_kit.recommend import (
    DEFAULT_MARGIN,
    BudgetTooSmall,
    Candidate,
    Recommendation,
    recommend_program,
)
from remat_kit.targets import parse_mesh
from remat_kit.units import GIB, MIB, format_bytes, format_seconds


def add(subparsers) -> argparse.ArgumentParser:
    """Register ``recommend`` on an argparse ``subparsers``; sets ``func=run``."""
    p = subparsers.add_parser(
        "recommend",
        help="the fastest remat configuration that fits a memory budget, verified by compiling",
        description="Compile the training step per named policy (and other remat group sizes, "
        "larger batches, per-tag choices with --solve) for a target, and pick the one with the "
        "least estimated step time (the roofline over its compiled kernels: FLOPs, bytes, "
        "launches, host transfers that cannot hide) whose compiled peak fits the budget.",
    )
    A.add_model(p)
    A.add_maxtext(p)
    A.add_seq(p)
    A.add_target(p, "h100-sxm")
    A.add_budget(p, "target memory less --margin")
    p.add_argument(
        "--batch", type=A.batch_or_auto, default=None,
        help="sequences per step, or 'auto' (presets; default 1)",
    )  # fmt: skip
    p.add_argument("--solve", action="store_true", help="also search per-tag choices")
    A.add_policy(p, "limit to these policies")
    p.add_argument(
        "--group-size", type=A.positive_int, action="append", default=None, dest="group_sizes",
        help="remat_group_size values to consider (default: every divisor of num_layers)",
    )  # fmt: skip
    p.add_argument(
        "--structure", action=argparse.BooleanOptionalAction, default=None,
        help="also search cuDNN attention, chunked loss and partial-layer remat (default: on "
        "unless --policy is given)",
    )  # fmt: skip
    A.add_optimizer(p, default=None)
    p.add_argument(
        "--margin", type=float, default=DEFAULT_MARGIN,
        help=f"fraction of device memory the default budget keeps free (default {DEFAULT_MARGIN})",
    )  # fmt: skip
    p.add_argument(
        "--max-compiles", type=A.positive_int, default=None,
        help="cap on compiles after the named policies (default 2x the named policies; 6x with "
        "--batch auto)",
    )  # fmt: skip
    A.add_workers(p)
    p.add_argument(
        "--mesh", default=None,
        help="compile on this mesh of the target's devices: 'fsdp=256' or 'dp=2,fsdp=4' "
        "(presets only: a program shards inside its own step; default --batch: one sequence "
        "per dp*fsdp device); figures are per device",
    )  # fmt: skip
    A.add_json(p, "the recommendation")
    A.add_html(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit recommend``: 0 a pick, 1 nothing fits (what would is printed; a budget
    below the parameters and optimizer state alone included), 2 bad input.

    Raises:
      ValueError: bad input (one line; the CLI exits 2).
    """
    try:
        return _run(args)
    except BudgetTooSmall as err:
        print(f"remat-kit recommend: nothing fits: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    A.check_output_path(args.html, "--html")
    targets.get_target(args.target)  # a bad name fails before the program is built
    auto = args.batch == "auto"
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if mesh is not None and auto:
        raise A.UsageError(f"--batch auto is for one device; on mesh {mesh} give a batch size")
    if not A.is_program_ref(args.model) and (auto or args.batch is None):
        args.batch = 1 if auto else (mesh.dp * mesh.fsdp if mesh is not None else 1)
    flags = {"--group-size": args.group_sizes, "--optimizer": args.optimizer,
             "--mesh": args.mesh, "--structure": args.structure}  # fmt: skip
    program = A.read_program(args, needed=("seq",), mesh=mesh, preset_only=flags)
    if args.maxtext is not None and args.policy is None:
        args.policy = A.maxtext_policies(program)  # the pick is then a MaxText config line
    rec = recommend_program(
        program, args.target, auto=auto, budget=args.budget, solve=args.solve,
        policies=args.policy, group_sizes=args.group_sizes, margin=args.margin,
        max_compiles=args.max_compiles, workers=args.workers, structure=args.structure,
    )  # fmt: skip
    if args.json and args.maxtext is not None:
        print(json.dumps({**rec.to_dict(), "maxtext_lines": _maxtext_lines(rec.pick)}, indent=1))
    elif args.json:
        print(rec.to_json(indent=1))
    else:
        print_recommendation(rec, code=args.maxtext is None)
        if args.maxtext is not None and rec.pick is not None:
            print_maxtext_lines(rec)
    if args.html:
        from remat_kit import report_html

        group = report_html.group_of_recommendation(rec)
        size = report_html.write_report(args.html, [group], command=A.command_line(args))
        print(f"{A.PROG}: wrote {args.html} ({size / 2**20:.1f} MiB)", file=sys.stderr)
    return 0 if rec.pick is not None else 1


def _maxtext_lines(pick: Candidate | None) -> list[str] | None:
    """The pick's MaxText config lines (:func:`remat_kit.policies.maxtext_config_lines`); None
    without a pick or where MaxText's config cannot say it."""
    from remat_kit.policies import maxtext_config_lines

    if pick is None:
        return None
    try:
        return maxtext_config_lines(pick.actions if pick.policy == "custom" else pick.policy)
    except ValueError:
        return None


def print_maxtext_lines(rec: Recommendation) -> None:
    """The pick as the MaxText config lines to set (:func:`remat_kit.policies.
    maxtext_config_lines`), with the peak and budget it was picked for, or why MaxText's
    config cannot say it."""
    from remat_kit.policies import maxtext_config_lines

    pick = rec.pick
    try:
        lines = maxtext_config_lines(pick.actions if pick.policy == "custom" else pick.policy)
    except ValueError as err:
        print(f"# not a MaxText setting: {err}")
        return
    print(
        f"# MaxText config lines for the pick (command line or YAML); {rec.target}: peak "
        f"{format_bytes(pick.peak_bytes)} of the {format_bytes(rec.budget_bytes)} budget"
    )
    print(" ".join(lines))


def _units(candidates: Sequence[Candidate]) -> tuple[tuple[str, int], tuple[str, float, int]]:
    """(bytes unit, scale), (time unit, scale, decimals): GiB and ms at real sizes, MiB and µs
    (ns for a tiny program) below; the time unit keeps the fastest candidate at 1 or more, with
    the decimals that give it 4 significant digits (1.305 and 1.316 ms, not 1.3 and 1.3)."""
    big = max((c.peak_bytes for c in candidates), default=0) >= GIB
    finite = [c.step_time_s for c in candidates if 0 < c.step_time_s < math.inf]
    fastest = min(finite, default=1.0)  # the unit keeps the fastest step at >= 1
    unit, scale = ("ms", 1e3) if fastest >= 1e-3 else ("µs", 1e6) if fastest >= 1e-6 else (
        "ns", 1e9)  # fmt: skip
    decimals = max(1, 3 - math.floor(math.log10(max(fastest * scale, 1.0))))
    return (("GiB", GIB) if big else ("MiB", MIB)), (unit, scale, decimals)


def _table(rec: Recommendation, title: str, candidates: Sequence[Candidate]):
    """One row per candidate; a user's program (no group, batch or tokens) drops those columns,
    and the host and transfer columns go where every candidate's is zero (nothing offloaded),
    leaving the candidates' names the width; on a narrow terminal "found by", then the transfer
    and tokens columns go (the caption says which; ``--json`` has them)."""
    (bu, bs), (tu, ts, td) = _units(candidates)
    shaped = rec.seq_len is not None
    host = any(c.host_bytes for c in candidates)
    transfer = any(c.transfer_s for c in candidates)
    shape = {  # a preset's columns, as text per candidate
        "options": [c.options_label for c in candidates],
        "group": [str(c.remat_group_size) for c in candidates],
        "batch": [str(c.batch_size) for c in candidates],
    } if shaped else {}  # fmt: skip
    # a column whose value is the same in every row says it once, in the title
    same = [f"{name} {vals[0]}" for name, vals in shape.items() if vals and len(set(vals)) == 1]
    if same:
        title = f"{title}; every candidate: {', '.join(same)}"
    shape_cols = [name for name, vals in shape.items() if len(set(vals)) > 1]
    header = [
        "candidate", *shape_cols, f"peak {bu}",
        *([f"host {bu}"] if host else []), "fits", f"est. step {tu}",
        *([f"transfer {tu}"] if transfer else []), *(["tokens/s"] if shaped else []), "found by",
    ]  # fmt: skip
    left = ("candidate", "options", "found by")
    rows, first = [], {}
    for i, c in enumerate(candidates):
        where = c.found_by + (f" (seq {c.seq_len})" if c.seq_len != rec.seq_len else "")
        same = first.setdefault(c.program_sha256, c) if c.program_sha256 else c
        label = c.label if same is c else f"{c.label} (same program as {same.label})"
        if c.policy == "no-remat" and rec.remats_for_none:
            label += " (your factory still remats for None)"
        tokens = [f"{c.tokens_per_s:,.0f}"] if shaped else []
        rows.append([
            ("* " if c is rec.pick else "") + label, *(shape[n][i] for n in shape_cols),
            f"{c.peak_bytes / bs:.2f}",
            *([f"{c.host_bytes / bs:.2f}"] if host else []), "yes" if c.fits else "no",
            f"{c.step_time_s * ts:.{td}f}", *([f"{c.transfer_s * ts:.{td}f}"] if transfer else []),
            *tokens, where,
        ])  # fmt: skip
    # left out first where the terminal is narrow: how a candidate was found, its transfer time
    optional = ("found by", f"transfer {tu}", "tokens/s")
    t = table(title, header, [h for h in header if h not in left], optional=optional)
    for row in rows:
        add_row(t, *row)
    return t


def _lines(rec: Recommendation) -> list[str]:
    lines = [
        *([f"compiled on: {rec.compiled_on}"] if rec.compiled_on else []),
        f"budget {format_bytes(rec.budget_bytes)} per device ({rec.budget_note})",
        "arguments: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in rec.arguments.items()),
        f"host link: {rec.host_link}",
    ]
    if rec.tags is not None:
        lines.append(f"checkpoint tags the program emits: {', '.join(rec.tags) or 'none'}")
    if rec.solve is not None:
        s = rec.solve
        allowing = (
            "the additive model's error not measured yet"
            if s.peak_slack_bytes is None
            else f"allowing {format_bytes(s.peak_slack_bytes)} for the additive model's error seen "
            "so far"
        )
        lines.append(
            f"solve: {s.combinations:,} per-tag choices enumerated; {s.predicted_fit:,} of them "
            f"predicted to fit ({allowing}); {len(s.verified)} compiled to check"
        )
    n_cached = rec.from_compile_cache
    cached = f", {n_cached} read from the compile cache" if n_cached else ""
    lines.append(f"compiles: {rec.compiles} (+{rec.reused} reused{cached}), {rec.wall_s:.1f} s")
    lines += [f"note: {n}" for n in rec.notes]
    if rec.pick is None:
        lines.append("nothing fits the budget; what would:")
        lines += [f"  - {a}" for a in rec.advice]
    else:
        p = rec.pick
        shape = (
            "" if p.batch_size is None else f" (group {p.remat_group_size}, batch {p.batch_size})"
        )
        tokens = "" if p.tokens_per_s is None else f", {p.tokens_per_s:,.0f} tokens/s"
        opts = "" if not p.options else f" [{p.options_label}]"
        lines.append(
            f"pick: {p.label}{opts}{shape}: peak {format_bytes(p.peak_bytes)} of "
            f"{format_bytes(rec.budget_bytes)}, estimated step "
            f"{format_seconds(p.step_time_s)}{tokens}"
        )
        if rec.made_fit:
            lines.append(f"options: {rec.made_fit}")
    return lines


def print_recommendation(rec: Recommendation, code: bool = True) -> None:
    """Print the candidates (fits first, then by estimated step time; ``*`` marks the pick),
    the budget and its source, the compiles spent, and the pick as one line of code (not with
    ``code=False``: a MaxText program's pick is its config lines), or what would fit."""
    out = console()
    if rec.seq_len is None:  # a user's program: its own arguments and optimizer
        title = f"{rec.model} (your program) on {rec.target}"
    else:
        batch = "auto" if rec.batch_size is None else rec.batch_size
        title = f"{rec.model}, seq={rec.seq_len} batch={batch}, on {rec.target} ({rec.optimizer})"
    tables = [(title, sorted(rec.candidates, key=lambda c: (not c.fits, c.step_time_s)))]
    if rec.largest_batch:
        best = sorted(rec.largest_batch, key=lambda c: -c.tokens_per_s)
        tables.insert(0, ("largest batch that fits, per policy", best))
    for name, cands in tables:
        out.print(_table(rec, name, cands))
    for line in _lines(rec):
        out.print(line, highlight=False, markup=False)
    if rec.pick is not None and code:  # its comment above it: the code stays one line
        code, _, comment = rec.line().partition("  # ")
        for part in textwrap.wrap(comment, max(40, out.width - 2)):  # comments within the width
            print(f"# {part}")
        print(code)
