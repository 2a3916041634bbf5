"""``remat-kit analyze``: compile a model's training step per policy and report its memory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence

from rich.text import Text

from remat_kit import plots, targets
from remat_kit.cli import args as A
from remat_kit.cli.console import add_row, console, table, text
from remat_kit.memory import CompileError, analyze_policies, per_layer_activations
from remat_kit.memory.programs import ProgramPolicies, program_policies
from remat_kit.memory.report import same_program_as
from remat_kit.memory.xla_compile import out_of_memory
from remat_kit.policies import PolicySpec, get_policy_spec, policy_label, policy_names
from remat_kit.program import Program
from remat_kit.sharding import parse_mesh
from remat_kit.training.step import make_optimizer
from remat_kit.units import KIB, MIB, in_unit, table_unit
from remat_kit.units import format_bytes as _size


def add(subparsers) -> None:
    """Register ``analyze``."""
    p = subparsers.add_parser(
        "analyze",
        help="compile a model's training step per policy and report its memory",
        description="Compile the training step (forward, backward, optax update; state donated) "
        "of a model preset for a target, from abstract shapes, once per remat policy, and "
        "report peak, host and activation memory, recompute ratio and whether it fits.",
    )
    A.add_model(p)
    A.add_batch(p)
    A.add_seq(p)
    A.add_policy(
        p,
        "remat policy (default: the preset's own; for a program, the named policies that act "
        "on its checkpoint names and policies in its own names)",
    )
    p.add_argument("--all-policies", action="store_true", help="every registered policy")
    A.add_target(p, "local")
    A.add_optimizer(p)
    A.add_budget(p, "the target's memory")
    A.add_json(p, "the reports")
    p.add_argument("--buffers", type=int, default=5, help="largest buffers at the peak to show")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="also compile at 2 and 4 layers and compare per-layer bytes with the textbook "
        "(Korthikanti et al. 2022)",
    )
    A.add_workers(p)
    A.add_timeline(p)
    p.add_argument("--devices", type=A.positive_int, default=None,
                   help="devices of the target (default: --mesh's product, else a TPU slice's "
                   "chips, else 1)")  # fmt: skip
    p.add_argument(
        "--mesh", default=None,
        help="mesh over --devices: 'fsdp=8' or 'dp=2,fsdp=4,tp=1' (default: dp=DEVICES); "
        "figures are per device",
    )  # fmt: skip
    p.set_defaults(func=run)


def _resolve(args: argparse.Namespace) -> tuple:
    """Validate names before compiling anything (ValueError -> exit 2)."""
    if args.all_policies and args.policy:
        raise A.UsageError("give --policy or --all-policies, not both")
    config = A.resolve_model(args)
    A.require_shape(args, config)
    target = targets.get_target(args.target)
    if isinstance(config, Program):
        for flag in ("per_layer", "mesh", "devices"):
            if getattr(args, flag):
                raise A.UsageError(
                    f"--{flag.replace('_', '-')} applies to presets; not to program {config.name!r}"
                )
        asked = args.policy or (policy_names() if args.all_policies else None)
        return config, target, program_policies(config, target, asked)
    make_optimizer(args.optimizer)
    if target.tpu is not None and args.devices is None and not args.mesh:
        args.devices = target.tpu.num_devices  # a TPU slice: all its chips unless told
    mesh = parse_mesh(args.mesh, args.devices)
    A.check_shape(config, args.batch, args.seq, mesh)
    args.devices = mesh.num_devices
    args.mesh_spec = None if mesh.num_devices == 1 else mesh
    if args.policy:
        return config, target, args.policy
    if args.all_policies:
        return config, target, [get_policy_spec(n) for n in policy_names()]
    return config, target, [config.policy_spec]


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit analyze``: 0 ok, 1 a compile failed."""
    config, target, specs = _resolve(args)
    chosen = specs if isinstance(specs, ProgramPolicies) else None
    if chosen is not None:
        specs = list(chosen.specs)
    try:
        if isinstance(config, Program):
            results = analyze_policies(
                config, specs, target=target, budget_bytes=args.budget,
                top_k=max(args.buffers, 0), workers=args.workers, raise_errors=False,
            )  # fmt: skip
        else:
            results = analyze_policies(
                config, args.batch, args.seq, specs, target=target, optimizer=args.optimizer,
                budget_bytes=args.budget, top_k=max(args.buffers, 0), workers=args.workers,
                raise_errors=False, mesh=args.mesh_spec,
            )  # fmt: skip
    except CompileError as err:
        print(f"{A.PROG}: error: {err}", file=sys.stderr)
        return 1
    reports = [r for r in results if not isinstance(r, CompileError)]
    errors = [e for e in results if isinstance(e, CompileError)]
    layers = []
    if args.per_layer and reports:
        try:
            layers = per_layer_activations(
                config, args.batch, args.seq, [r.policy for r in reports], target=target,
                optimizer=args.optimizer, workers=args.workers,
            )  # fmt: skip
        except CompileError as err:
            errors.append(err)
    labels = [  # the table's row names, one per report
        label
        for label, r in zip(_labels(specs, chosen), results, strict=True)
        if not isinstance(r, CompileError)
    ]
    if args.timeline and reports:
        plots.timeline(reports, args.timeline, titles=labels)
        print(f"{A.PROG}: wrote {args.timeline}", file=sys.stderr)
    if args.json:
        out = {
            "reports": [_report_dict(r, with_timeline=bool(args.timeline)) for r in reports],
            "labels": labels,
            "errors": [{"what": e.what, "error": e.xla_message} for e in errors],
        }
        if chosen is not None:
            out["checkpoint_names"] = sorted(chosen.tags)
            out["notes"] = list(chosen.notes)
        if layers:
            out["per_layer"] = [dataclasses.asdict(x) for x in layers]
        print(json.dumps(out, indent=1))
    else:
        print_reports(config, target, args, results, layers, specs, chosen)
    for err in errors:
        print(f"{A.PROG}: error: {err}", file=sys.stderr)
    return 1 if errors else 0


def _report_dict(report, with_timeline: bool) -> dict:
    """``report.to_dict()``; its timeline (a few hundred points per policy) only with
    ``--timeline``."""
    d = report.to_dict()
    if not with_timeline:
        d.pop("timeline", None)
    return d


_REMAT_WARNING = re.compile(
    r"Can't reduce memory use below ([\d.]+\w+) .*only reduced to ([\d.]+\w+).*down from "
    r"([\d.]+\w+)"
)


def short_warning(text: str) -> str:
    """XLA's long messages, shortened for the table view (``--json`` keeps them whole)."""
    m = _REMAT_WARNING.search(text)
    if m:
        limit, reached, before = m.groups()
        return f"XLA's remat pass missed its {limit} limit ({before} -> {reached})"
    m = re.search(r"recomputed (\d+) instruction", text)
    if m and "rematerialisation pass" in text:
        return f"XLA recomputed {m.group(1)} instructions itself (in the FLOPs)"
    return text


def _policy_table(config, target, args, results, labels: Sequence[str]):
    shape = "" if isinstance(config, Program) else f", batch={args.batch} seq={args.seq},"
    title = f"{config.name}{shape} on {target.name} ({target.description})"
    ok = [r for r in results if not isinstance(r, CompileError)]
    unit, name = table_unit([v for r in ok for v in (r.peak_bytes, r.activation_bytes)])
    cols = ("policy", "peak", "host", "residuals", "recompute", "fits", "compile s")
    t = table(f"{title}, bytes in {name}", cols, right=cols[1:])
    for label, r, same in zip(labels, results, same_program_as(results), strict=True):
        if isinstance(r, CompileError):
            if out_of_memory(r):  # TPU: XLA refuses a step over HBM (its message says by how much)
                add_row(t, label, "over memory", "", "", "", Text("no", style="red"), "")
            else:
                add_row(t, label, "compile failed", "", "", "", "", "")
            continue
        seconds = f"{r.compile_s:.1f}"
        if same is not None:  # compiled once, for the first row of that program
            label, seconds = f"{label} (same program as {labels[same]})", "-"
        fits = "?" if r.fits is None else ("yes" if r.fits else "no")
        style = "" if r.fits is None else ("green" if r.fits else "red")
        ratio = "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.2f}x"
        add_row(
            t, label, in_unit(r.peak_bytes, unit, 2), in_unit(r.host_bytes, unit, 2),
            in_unit(r.activation_bytes, unit, 2), ratio, Text(fits, style=style), seconds,
        )  # fmt: skip
    return t


def _summary_lines(target, args, results, labels: Sequence[str]) -> list[str]:
    reports = [r for r in results if not isinstance(r, CompileError)]
    first = reports[0]
    budget = args.budget if args.budget is not None else target.memory_bytes
    lines = [
        f"{first.backend}; peak = "
        + (
            "XLA's peak_memory_in_bytes (per device; its temp figure leaves out temporaries)"
            if target.platform == "tpu"
            else "argument + output + temp - alias (per device)"
        )
        + (f"; budget {_size(budget)}" if budget else "; target memory unknown (CPU)"),
        "arguments: " + ", ".join(f"{k} {_size(v)}" for k, v in first.arguments.items()),
    ]
    if target.platform == "cpu":
        lines.append("CPU backend: these are XLA:CPU numbers, not GPU numbers; offload is not real")
    if first.logits:
        lg = first.logits
        lines.append(
            f"logits {list(lg.shape)} {lg.dtype}: {_size(lg.logits_bytes)}, float32 copy in "
            f"the loss {_size(lg.f32_bytes)}, gradient {_size(lg.grad_bytes)}; remat "
            "does not shrink them"
        )
    for label, r, same in zip(labels, results, same_program_as(results), strict=True):
        if (
            not isinstance(r, CompileError)
            and same is None
            and r.peak_bytes_without_offload is not None
        ):
            delta = r.peak_bytes_without_offload - r.peak_bytes
            verdict = (
                f"offloading lowers the device peak by {_size(delta)}"
                if delta > 0
                else f"offloading does not lower the device peak (+{_size(-delta)})"
            )
            lines.append(
                f"{label}: {_size(r.peak_bytes)} on device + {_size(r.host_bytes)} host, "
                f"against {_size(r.peak_bytes_without_offload)} keeping the same tensors on "
                f"device: {verdict}"
            )
    return lines


def _labels(specs: Sequence[PolicySpec], chosen: ProgramPolicies | None) -> list[str]:
    return chosen.labels() if chosen else [policy_label(s) for s in specs]


def tag_bytes(report, tags: frozenset[str]) -> dict[str, tuple[int, int]]:
    """``{column: (device bytes, host bytes)}`` of the residuals ``report`` keeps, per emitted
    tag (sorted) and ``untagged`` (under no emitted tag)."""
    out = {}
    for column in [*sorted(tags), "untagged"]:
        rows = [r for r in report.residuals if (r.tag not in tags if column == "untagged" else
                                                r.tag == column)]  # fmt: skip
        out[column] = (
            sum(r.nbytes for r in rows if r.memory == "device"),
            sum(r.nbytes for r in rows if r.memory == "host"),
        )
    return out


def _tag_cell(device: int, host: int, unit: int) -> str:
    parts = ([in_unit(device, unit, 2)] if device else []) + (
        [f"host {in_unit(host, unit, 2)}"] if host else []
    )
    return " + ".join(parts) or "-"


def residual_tag_tables(results, labels: Sequence[str], tags: frozenset[str], per_table: int = 5):
    """The residuals each policy keeps, by the program's own checkpoint names: rows are the
    policies (one per compiled program), columns the emitted tags and ``untagged`` (residuals
    under no emitted tag), cells the bytes kept on device and offloaded to host (``-``: none),
    in KiB below 1 MiB, else MiB or GiB; ``per_table`` columns per table at most (more make
    several tables, for 80 columns). Empty when no report has residuals (no loss given)."""
    rows = [
        (label, tag_bytes(r, tags))
        for label, r, same in zip(labels, results, same_program_as(results), strict=True)
        if not isinstance(r, CompileError) and same is None and r.activation_bytes is not None
    ]
    if not rows:
        return []
    top = max(max(cell) for _, cells in rows for cell in cells.values())
    unit, name = (KIB, "KiB") if top < MIB else table_unit([top])
    columns = list(rows[0][1])
    size = -(-len(columns) // -(-len(columns) // per_table))  # even chunks of <= per_table
    chunks = [columns[i : i + size] for i in range(0, len(columns), size)]
    out = []
    for k, chunk in enumerate(chunks):
        part = f" ({k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
        t = table(
            f"residuals by checkpoint name{part}, bytes in {name} on device ('host': offloaded, "
            "'-': none)", ("policy", *chunk), right=chunk,
        )  # fmt: skip
        for label, cells in rows:
            add_row(t, label, *(_tag_cell(*cells[c], unit) for c in chunk))
        out.append(t)
    return out


def buffer_table(report):
    """The largest buffers live at XLA's peak: size, XLA shape (``f32[1,8,8192,8192]``), kind,
    phase and the op that made it."""
    unit, name = table_unit([b.nbytes for b in report.peak_buffers])
    t = table(f"largest buffers live at XLA's peak ({report.policy})", (name, "shape", "what",
              "phase", "op"), right=(name,))  # fmt: skip
    for b in report.peak_buffers:
        kind = f"{b.kind} (host)" if b.memory == "host" else b.kind
        add_row(t, in_unit(b.nbytes, unit, 3), b.shape, kind, b.phase, b.op_name)
    return t


def _layer_table(layers):
    cols = ("policy", "textbook", "jaxpr", "compiled", "compiled / textbook")
    t = table("per-layer activations: textbook (Korthikanti et al. 2022) vs compiled", cols,
              right=cols[1:])  # fmt: skip
    for x in layers:
        host = f" + {_size(x.compiled_host_bytes)} host" if x.compiled_host_bytes else ""
        ratio = "-" if x.ratio is None else f"{x.ratio:.2f}"
        add_row(t, x.policy, _size(x.textbook_bytes), _size(x.jaxpr_bytes),
                _size(x.compiled_bytes) + host, ratio)  # fmt: skip
    return t


def _warning_lines(results, labels: Sequence[str]) -> list[str]:
    """Each report's warnings, shortened; a row that is the same program as an earlier one
    gives only the warnings that one did not."""
    reports = [r for r in results if not isinstance(r, CompileError)]
    every = [w for w in reports[0].warnings if all(w in r.warnings for r in reports[1:])]
    lines = []
    if len(reports) > 1 and every:
        lines.append("[yellow]every policy:[/yellow] " + text("; ".join(map(short_warning, every))))
    else:
        every = []
    for label, r, same in zip(labels, results, same_program_as(results), strict=True):
        if isinstance(r, CompileError):
            continue
        said = (*every, *(results[same].warnings if same is not None else ()))
        short = [
            short_warning(w) for w in r.warnings if "offloading did not" not in w and w not in said
        ]
        if short:
            lines.append(f"[yellow]{text(label)}:[/yellow] " + text("; ".join(short)))
    return lines


def print_reports(
    config, target, args, results, layers, specs: Sequence[PolicySpec], chosen=None
) -> None:
    """The reports as tables: one row per policy, the shared figures, XLA's warnings, the
    largest buffers at the peak (one policy) and the per-layer comparison (``--per-layer``);
    for a program (``chosen``: its :class:`ProgramPolicies`), the notes on which policies were
    compiled and the residuals by its own checkpoint names."""
    out = console()
    labels = _labels(specs, chosen)
    out.print(_policy_table(config, target, args, results, labels))
    reports = [r for r in results if not isinstance(r, CompileError)]
    if not reports:
        return
    if chosen is not None:
        for t in residual_tag_tables(results, labels, chosen.tags):
            out.print(t)
    notes = []
    if chosen is not None:
        names = ", ".join(sorted(chosen.tags)) or "none"
        notes = [f"checkpoint names {config.name!r} emits: {names}", *chosen.notes]
    for line in _summary_lines(target, args, results, labels) + notes:
        out.print(line, highlight=False, markup=False)
    for line in _warning_lines(results, labels):
        out.print(line, highlight=False)
    if args.buffers > 0 and len(reports) == 1:
        out.print(buffer_table(reports[0]))
    if layers:
        out.print(_layer_table(layers))
        for x in layers:
            out.print(f"{x.policy}: {x.note}", highlight=False, markup=False)
