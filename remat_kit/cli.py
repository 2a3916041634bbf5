"""The ``remat-kit`` command: ``analyze``, ``policies``, ``targets``.

Examples::

    remat-kit analyze --model llama3-8b --batch 1 --seq 8192 --target h100-sxm --all-policies
    remat-kit analyze --model gpt2-medium --batch 8 --seq 1024 --policy save-nothing \\
        --policy save-dots-no-batch --target a100-40gb --budget 40GB --json
    remat-kit policies
    remat-kit targets

Each subcommand is a ``add_<name>(subparsers)`` function that registers its parser and sets
``func`` to its handler ``(args) -> exit code``; add a command by adding one to :data:`COMMANDS`.
Heavy imports (JAX, flax, rich) happen inside handlers, so bad input fails fast. Exit codes: 0
success, 1 a compile failed, 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence

from remat_kit import units, validation

PROG = "remat-kit"
GIB = 2**30


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def parse_bytes(text: str) -> int:
    """argparse type: :func:`remat_kit.units.parse_bytes`, errors as ``ArgumentTypeError``."""
    try:
        return units.parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer > 0.

    Raises:
      argparse.ArgumentTypeError: otherwise.
    """
    try:
        return validation.parse_positive_int("value", text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


_gib = units.gib
_size = units.format_bytes


def _console():
    from rich.console import Console

    # Tables stay on one line per row when piped (rich would wrap at 80 columns).
    return Console(width=None if sys.stdout.isatty() else 200)


# -- analyze --------------------------------------------------------------------------------


def add_analyze(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="compile a model's training step per policy and report its memory",
        description="Compile the training step (forward, backward, optax update; state donated) "
        "of a model preset for a target, from abstract shapes, once per remat policy, and "
        "report peak, host and activation memory, recompute ratio and whether it fits.",
    )
    p.add_argument("--model", required=True, help="model preset, e.g. llama3-8b")
    p.add_argument("--batch", type=positive_int, required=True, help="sequences per step")
    p.add_argument("--seq", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="remat policy (repeat for several; see `remat-kit policies`)",
    )
    p.add_argument("--all-policies", action="store_true", help="every registered policy")
    p.add_argument("--target", default="local", help="compile target (see `remat-kit targets`)")
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")
    p.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="device memory budget per device (80GiB, 80GB, 8e10); default: the target's memory",
    )
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("--buffers", type=int, default=5, help="largest buffers at the peak to show")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="also compile at 2 and 4 layers and compare per-layer bytes with the textbook "
        "(Korthikanti et al. 2022)",
    )
    p.add_argument("--workers", type=positive_int, default=None, help="concurrent compiles")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="devices of the target (default: --mesh's product, else 1)")  # fmt: skip
    p.add_argument(
        "--mesh", default=None,
        help="mesh over --devices: 'fsdp=8' or 'dp=2,fsdp=4,tp=1' (default: dp=DEVICES); "
        "figures are per device",
    )  # fmt: skip
    p.set_defaults(func=run_analyze)


def _resolve(args) -> tuple:
    """Validate names before compiling anything (ValueError -> exit 2)."""
    from remat_kit import targets
    from remat_kit.models.config import get_config
    from remat_kit.policies import get_policy_spec, policy_names
    from remat_kit.train import make_optimizer

    if args.all_policies and args.policy:
        raise UsageError("give --policy or --all-policies, not both")
    config = get_config(args.model)
    target = targets.get_target(args.target)
    make_optimizer(args.optimizer)
    if args.seq > config.max_seq_len:
        raise UsageError(
            f"--seq {args.seq} exceeds max_seq_len={config.max_seq_len} of {config.name!r}"
        )
    from remat_kit.sharding import parse_mesh

    mesh = parse_mesh(args.mesh, args.devices)
    args.devices = mesh.num_devices
    if mesh.dp * mesh.fsdp > 1 and args.batch % (mesh.dp * mesh.fsdp):
        raise UsageError(
            f"--batch {args.batch} is not divisible by dp*fsdp={mesh.dp * mesh.fsdp} of mesh {mesh}"
        )
    args.mesh_spec = None if mesh.num_devices == 1 else mesh
    if args.all_policies:
        policies = policy_names()
    else:
        policies = args.policy or [config.policy_spec.name]
        for name in policies:
            get_policy_spec(name)
    return config, target, policies


def run_analyze(args) -> int:
    try:
        config, target, policies = _resolve(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    from remat_kit.memory import CompileError, analyze_policies, per_layer_activations

    try:
        results = analyze_policies(
            config,
            args.batch,
            args.seq,
            policies,
            target=target,
            optimizer=args.optimizer,
            budget_bytes=args.budget,
            top_k=max(args.buffers, 0),
            workers=args.workers,
            raise_errors=False,
            mesh=args.mesh_spec,
        )
    except CompileError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    reports = [r for r in results if not isinstance(r, CompileError)]
    errors = [e for e in results if isinstance(e, CompileError)]
    layers = []
    if args.per_layer and reports:
        try:
            layers = per_layer_activations(
                config,
                args.batch,
                args.seq,
                [r.policy for r in reports],
                target=target,
                optimizer=args.optimizer,
                workers=args.workers,
            )
        except CompileError as err:
            errors.append(err)
    if args.json:
        import dataclasses

        out = {
            "reports": [r.to_dict() for r in reports],
            "errors": [{"what": e.what, "error": e.xla_message} for e in errors],
        }
        if layers:
            out["per_layer"] = [dataclasses.asdict(x) for x in layers]
        print(json.dumps(out, indent=1))
    else:
        _print_reports(config, target, args, results, layers)
    for err in errors:
        print(f"{PROG}: error: {err}", file=sys.stderr)
    return 1 if errors else 0


_REMAT_WARNING = re.compile(
    r"Can't reduce memory use below ([\d.]+\w+) .*only reduced to ([\d.]+\w+).*down from "
    r"([\d.]+\w+)"
)


def _short_warning(text: str) -> str:
    """XLA's long messages, shortened for the table view (``--json`` keeps them whole)."""
    m = _REMAT_WARNING.search(text)
    if m:
        limit, reached, before = m.groups()
        return f"XLA's remat pass missed its {limit} limit ({before} -> {reached})"
    m = re.search(r"recomputed (\d+) instruction", text)
    if m and "rematerialisation pass" in text:
        return f"XLA recomputed {m.group(1)} instructions itself (in the FLOPs)"
    return text


def _print_reports(config, target, args, results, layers) -> None:
    from rich.table import Table

    from remat_kit.memory import CompileError

    console = _console()
    reports = [r for r in results if not isinstance(r, CompileError)]
    first = reports[0] if reports else None
    budget = args.budget if args.budget is not None else target.memory_bytes
    title = (
        f"{config.name}  batch={args.batch} seq={args.seq}  on {target.name} ({target.description})"
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "policy",
        "peak GiB",
        "host GiB",
        "activations GiB",
        "recompute",
        "fits",
        "compile s",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for result in results:
        if isinstance(result, CompileError):
            table.add_row(result.policy or "?", "compile failed", "", "", "", "", "")
            continue
        r = result
        fits = "?" if r.fits is None else ("yes" if r.fits else "no")
        style = None if r.fits is None else ("green" if r.fits else "red")
        table.add_row(
            r.policy,
            _gib(r.peak_bytes),
            _gib(r.host_bytes),
            _gib(r.activation_bytes),
            "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.2f}x",
            f"[{style}]{fits}[/{style}]" if style else fits,
            f"{r.compile_s:.1f}",
        )
    console.print(table)
    if first is None:
        return
    lines = [
        f"{first.backend}; peak = argument + output + temp - alias (per device)"
        + (f"; budget {_gib(budget)} GiB" if budget else "; target memory unknown (CPU)"),
        "arguments: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in first.arguments.items()),
    ]
    if target.platform == "cpu":
        lines.append("CPU backend: these are XLA:CPU numbers, not GPU numbers; offload is not real")
    if first.logits:
        lg = first.logits
        lines.append(
            f"logits {list(lg.shape)} {lg.dtype}: {_gib(lg.logits_bytes)} GiB, float32 copy in "
            f"the loss {_gib(lg.f32_bytes)} GiB, gradient {_gib(lg.grad_bytes)} GiB; remat "
            "does not shrink them"
        )
    for r in reports:
        if r.peak_bytes_without_offload is not None:
            delta = r.peak_bytes_without_offload - r.peak_bytes
            verdict = (
                f"offloading lowers the device peak by {_gib(delta)} GiB"
                if delta > 0
                else f"offloading does not lower the device peak (+{_gib(-delta)} GiB)"
            )
            lines.append(
                f"{r.policy}: {_gib(r.peak_bytes)} GiB on device + {_gib(r.host_bytes)} GiB host, "
                f"against {_gib(r.peak_bytes_without_offload)} GiB keeping the same tensors on "
                f"device: {verdict}"
            )
    for line in lines:
        console.print(line, highlight=False)
    for r in reports:
        short = [_short_warning(w) for w in r.warnings if "offloading did not" not in w]
        if short:
            console.print(f"[yellow]{r.policy}:[/yellow] " + "; ".join(short), highlight=False)
    if args.buffers > 0 and len(reports) == 1:
        bt = Table(title=f"largest buffers live at XLA's peak ({reports[0].policy})")
        for col in ("GiB", "shape", "what", "phase", "op"):
            bt.add_column(col)
        for b in reports[0].peak_buffers:
            bt.add_row(_gib(b.nbytes, 3), b.shape, b.kind, b.phase, b.op_name[-70:])
        console.print(bt)
    if layers:
        lt = Table(title="per-layer activations: textbook (Korthikanti et al. 2022) vs compiled")
        for col in ("policy", "textbook", "jaxpr", "compiled", "compiled / textbook"):
            lt.add_column(col, justify="left" if col == "policy" else "right")
        for x in layers:
            lt.add_row(
                x.policy,
                _size(x.textbook_bytes),
                _size(x.jaxpr_bytes),
                _size(x.compiled_bytes)
                + (f" + {_size(x.compiled_host_bytes)} host" if x.compiled_host_bytes else ""),
                "-" if x.ratio is None else f"{x.ratio:.2f}",
            )
        console.print(lt)
        for x in layers:
            console.print(f"{x.policy}: {x.note}", highlight=False)


# -- policies, targets ----------------------------------------------------------------------


def add_policies(subparsers) -> None:
    p = subparsers.add_parser("policies", help="list the named remat policies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_policies)


def run_policies(args) -> int:
    from remat_kit.policies import policy_specs

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
    from rich.table import Table

    table = Table(title="remat policies")
    for col in ("name", "saves / offloads", "description"):
        table.add_column(col)
    for s in specs.values():
        what = s.base if s.base != "names" else ""
        if s.save:
            what += "save " + ", ".join(sorted(s.save))
        if s.offload:
            what += ("; " if what else "") + "offload " + ", ".join(sorted(s.offload))
        table.add_row(s.name, what or "nothing (full remat)", s.description)
    _console().print(table)
    return 0


def add_targets(subparsers) -> None:
    p = subparsers.add_parser("targets", help="list the compile targets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_targets)


def run_targets(args) -> int:
    from remat_kit import targets

    rows = []
    for name in targets.target_names():
        t = targets.get_target(name)
        rows.append(
            {
                "name": t.name,
                "platform": t.platform,
                "memory_bytes": t.memory_bytes,
                "peak_flops_bf16": t.peak_flops_bf16,
                "deviceless": t.deviceless,
                "description": t.description,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    table = Table(title="compile targets")
    for col in ("name", "platform", "memory GiB", "bf16 TFLOP/s", "compiled", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"],
            r["platform"],
            _gib(r["memory_bytes"], 1),
            "-" if r["peak_flops_bf16"] is None else f"{r['peak_flops_bf16'] / 1e12:.0f}",
            "deviceless" if r["deviceless"] else "local",
            r["description"],
        )
    _console().print(table)
    return 0


# -- doctor ---------------------------------------------------------------------------------


def add_doctor(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check that a remat policy does what it promises on a model",
        description="Compare what a policy promises (tags saved, offloaded, the rest recomputed) "
        "with what the traced and compiled training step does; one line per finding: what is "
        "wrong, the likely cause, the fix. Exit code 1 when a finding is an error.",
    )
    p.add_argument("--model", required=True, help="model preset, e.g. tiny-gpt or llama3-8b")
    p.add_argument(
        "--policy", action="append", default=None,
        help="policy to check (repeat for several; default: every registered policy)",
    )  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=2, help="sequences per step")
    p.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence")
    p.add_argument("--target", default="cpu", help="compile target (see `remat-kit targets`)")
    p.add_argument(
        "--no-scan", action="store_true", help="unrolled layers instead of nn.scan (scan_layers)"
    )
    p.add_argument("--group-size", type=positive_int, default=1, help="remat_group_size")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    from remat_kit import targets
    from remat_kit.models.config import get_config
    from remat_kit.policies import get_policy_spec, policy_names

    try:
        config = get_config(
            args.model, scan_layers=not args.no_scan, remat_group_size=args.group_size
        )
        targets.get_target(args.target)
        policies = args.policy or policy_names()
        for name in policies:
            get_policy_spec(name)
        if args.seq > config.max_seq_len:
            raise ValueError(
                f"--seq {args.seq} exceeds max_seq_len={config.max_seq_len} of {config.name!r}"
            )
    except ValueError as err:
        raise UsageError(str(err)) from None
    from remat_kit.doctor import check_policies, has_errors

    results = check_policies(config, args.batch, args.seq, policies, args.target)
    if args.json:
        out = {
            name: [dataclasses.asdict(f) for f in findings]
            for name, findings in zip(policies, results, strict=True)
        }
        print(json.dumps(out, indent=2))
    else:
        for name, findings in zip(policies, results, strict=True):
            print(f"{name}: " + ("ok" if not findings else f"{len(findings)} finding(s)"))
            for f in findings:
                print(f"  {f.line()}")
    return 1 if any(has_errors(f) for f in results) else 0


# -- recommend ------------------------------------------------------------------------------


def add_recommend(subparsers) -> None:
    from remat_kit.recommend import add_parser

    add_parser(subparsers)


#: Subcommand registrars, in help order.
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_analyze,
    add_policies,
    add_targets,
    add_doctor,
    add_recommend,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Choose, measure and verify rematerialization policies for JAX/Flax "
        "transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 compile failed, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
