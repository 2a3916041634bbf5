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
from remat_kit.policies import PolicySpec, get_policy_spec, policy_label, policy_names
from remat_kit.program import Program
from remat_kit.sharding import parse_mesh
from remat_kit.training.step import make_optimizer
from remat_kit.units import format_bytes as _size
from remat_kit.units import in_unit, table_unit


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
    A.add_policy(p, "remat policy (default: the preset's own; every named policy for a program)")
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
                   help="devices of the target (default: --mesh's product, else 1)")  # fmt: skip
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
        if args.policy:
            return config, target, args.policy
        return config, target, [get_policy_spec(n) for n in policy_names()]
    make_optimizer(args.optimizer)
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
    if args.timeline and reports:
        plots.timeline(reports, args.timeline)
        print(f"{A.PROG}: wrote {args.timeline}", file=sys.stderr)
    if args.json:
        out = {
            "reports": [_report_dict(r, with_timeline=bool(args.timeline)) for r in reports],
            "errors": [{"what": e.what, "error": e.xla_message} for e in errors],
        }
        if layers:
            out["per_layer"] = [dataclasses.asdict(x) for x in layers]
        print(json.dumps(out, indent=1))
    else:
        print_reports(config, target, args, results, layers, specs)
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
    shape = "" if isinstance(config, Program) else f"  batch={args.batch} seq={args.seq}"
    title = f"{config.name}{shape}  on {target.name} ({target.description})"
    ok = [r for r in results if not isinstance(r, CompileError)]
    unit, name = table_unit([v for r in ok for v in (r.peak_bytes, r.activation_bytes)])
    cols = ("policy", "peak", "host", "residuals", "recompute", "fits", "compile s")
    t = table(f"{title}, bytes in {name}", cols, right=cols[1:])
    for label, r in zip(labels, results, strict=True):
        if isinstance(r, CompileError):
            add_row(t, label, "compile failed", "", "", "", "", "")
            continue
        fits = "?" if r.fits is None else ("yes" if r.fits else "no")
        style = "" if r.fits is None else ("green" if r.fits else "red")
        ratio = "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.2f}x"
        add_row(
            t, label, in_unit(r.peak_bytes, unit, 2), in_unit(r.host_bytes, unit, 2),
            in_unit(r.activation_bytes, unit, 2), ratio, Text(fits, style=style),
            f"{r.compile_s:.1f}",
        )  # fmt: skip
    return t


def _summary_lines(target, args, reports) -> list[str]:
    first = reports[0]
    budget = args.budget if args.budget is not None else target.memory_bytes
    lines = [
        f"{first.backend}; peak = argument + output + temp - alias (per device)"
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
    for r in reports:
        if r.peak_bytes_without_offload is not None:
            delta = r.peak_bytes_without_offload - r.peak_bytes
            verdict = (
                f"offloading lowers the device peak by {_size(delta)}"
                if delta > 0
                else f"offloading does not lower the device peak (+{_size(-delta)})"
            )
            lines.append(
                f"{r.policy}: {_size(r.peak_bytes)} on device + {_size(r.host_bytes)} host, "
                f"against {_size(r.peak_bytes_without_offload)} keeping the same tensors on "
                f"device: {verdict}"
            )
    return lines


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


def print_reports(config, target, args, results, layers, specs: Sequence[PolicySpec]) -> None:
    """The reports as tables: one row per policy, the shared figures, XLA's warnings, the
    largest buffers at the peak (one policy) and the per-layer comparison (``--per-layer``)."""
    out = console()
    labels = [policy_label(s) for s in specs]
    out.print(_policy_table(config, target, args, results, labels))
    reports = [r for r in results if not isinstance(r, CompileError)]
    if not reports:
        return
    for line in _summary_lines(target, args, reports):
        out.print(line, highlight=False, markup=False)
    for r in reports:
        short = [short_warning(w) for w in r.warnings if "offloading did not" not in w]
        if short:
            out.print(
                f"[yellow]{text(r.policy)}:[/yellow] " + text("; ".join(short)), highlight=False
            )
    if args.buffers > 0 and len(reports) == 1:
        out.print(buffer_table(reports[0]))
    if layers:
        out.print(_layer_table(layers))
        for x in layers:
            out.print(f"{x.policy}: {x.note}", highlight=False, markup=False)
