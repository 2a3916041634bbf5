"""``remat-kit analyze``: compile a model's training step per policy and report its memory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from rich.text import Text

from remat_kit import targets
from remat_kit.cli import args as A
from remat_kit.cli import grid
from remat_kit.cli.console import add_row, console, table
from remat_kit.cli.progress import CompileProgress
from remat_kit.memory import CompileError, analyze_policies
from remat_kit.memory.diff import peak_inversions
from remat_kit.memory.policy_set import PolicySet, policy_set
from remat_kit.memory.report import SAME_PROGRAM, MemoryReport, same_program_as
from remat_kit.memory.roofline import StepTime, no_remat_slower_note, small_step_note
from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import PolicySpec, get_policy_spec, policy_label, policy_names
from remat_kit.targets import parse_mesh
from remat_kit.terminal import group_notes, short_warnings
from remat_kit.training.step import make_optimizer
from remat_kit.units import KIB, MIB, format_seconds, in_unit, table_unit
from remat_kit.units import format_bytes as _size
from remat_kit.zoo.textbook import per_layer_activations

#: Largest buffers at the peak shown for one policy when ``--buffers`` is not given.
_BUFFERS = 5


def add(subparsers) -> None:
    """Register ``analyze``."""
    p = subparsers.add_parser(
        "analyze",
        help="compile a model's training step per policy and report its memory",
        description="Compile the training step (forward, backward, optax update; state donated) "
        "of a model preset for a target, from abstract shapes, once per remat policy, and "
        "report peak, host and activation memory, recompute ratio and whether it fits.",
    )
    A.add_model(p, several=True)
    A.add_maxtext(p)
    A.add_batch(p, several=True)
    A.add_seq(p, several=True)
    A.add_policy(
        p,
        "remat policy (default: the preset's own; for a program, the named policies that act "
        "on its checkpoint names and policies in its own names)",
    )
    p.add_argument("--all-policies", action="store_true", help="every registered policy")
    A.add_target(p, "local")
    A.add_optimizer(p, default=None)
    A.add_budget(p, "the target's memory")
    A.add_json(p, "the reports")
    p.add_argument(
        "--buffers", type=int, default=None,
        help="largest buffers at the peak to show, when one policy is analysed (default 5)",
    )  # fmt: skip
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="also compile at 2 and 4 layers and compare per-layer bytes with the textbook "
        "(Korthikanti et al. 2022); presets only (a program builds its own layers)",
    )
    p.add_argument(
        "--policy-alone-peak", action="store_true",
        help="where XLA's own remat pass fired, compile the step again with it off for the peak "
        "of the policy alone (the policy's own FLOPs are read without it)",
    )  # fmt: skip
    A.add_workers(p)
    A.add_timeline(p)
    A.add_html(p)
    p.add_argument(
        "--doctor", action="store_true",
        help="with --html: also run the doctor's checks on each policy and show its findings "
        "(compiles each policy again, and no-remat once)",
    )  # fmt: skip
    p.add_argument("--devices", type=A.positive_int, default=None,
                   help="devices of the target (default: --mesh's product, else a TPU slice's "
                   "chips, else 1); presets only")  # fmt: skip
    p.add_argument(
        "--mesh", default=None, action="append",
        help="mesh over --devices: 'fsdp=8' or 'dp=2,fsdp=4,tp=1' (default: dp=DEVICES); "
        "figures are per device; presets only (a program shards inside its own step)"
        + A.SEVERAL,
    )  # fmt: skip
    A.add_grid(p)
    p.set_defaults(func=run)


def _resolve(args: argparse.Namespace) -> tuple:
    """Validate names before compiling anything (ValueError -> exit 2): the program, the
    target, and the policies (a list, or :class:`PolicySet` where the default set was
    chosen from the program's own checkpoint names)."""
    if args.all_policies and args.policy:
        raise A.UsageError("give --policy or --all-policies, not both")
    target = targets.get_target(args.target)
    A.check_output_path(args.html, "--html")
    if args.doctor and not args.html:
        raise A.UsageError("--doctor adds the doctor's findings to the --html report; give --html")
    if args.doctor and (args.mesh or args.devices):
        raise A.UsageError("--doctor checks one device; not with --mesh / --devices")
    mesh = None
    if not A.is_program_ref(args.model):
        args.optimizer = args.optimizer or "adamw"
        make_optimizer(args.optimizer)
        if target.tpu is not None and args.devices is None and not args.mesh:
            args.devices = target.tpu.num_devices  # a TPU slice: all its chips unless told
        spec = parse_mesh(args.mesh, args.devices)
        args.devices = spec.num_devices
        mesh = None if spec.num_devices == 1 else spec
    flags = {"--per-layer": args.per_layer, "--mesh": args.mesh, "--devices": args.devices,
             "--optimizer": args.optimizer}  # fmt: skip
    program = A.read_program(args, mesh=mesh, preset_only=flags)
    if args.doctor and program.make_loss is None:
        raise A.UsageError(
            f"--doctor needs program {program.name!r}'s loss (Program.from_loss, or make_loss= "
            "in Program.from_step)"
        )
    if program.known.default_policy is None:  # no policy of its own: its names, what acts on them
        asked = args.policy or (policy_names() if args.all_policies else None)
        return program, target, policy_set(program, target, asked)
    if args.policy:
        return program, target, args.policy
    if args.all_policies:
        return program, target, [get_policy_spec(n) for n in policy_names()]
    return program, target, [get_policy_spec(program.known.default_policy)]


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit analyze``: 0 ok, 1 a compile failed. A step the compiler refused as
    over the device's memory (XLA:TPU) is an answer, not a failure: a row that does not fit,
    as a GPU target's peak over memory is. Several points (or ``--out``): a grid
    (:mod:`remat_kit.cli.grid`)."""
    if grid.is_grid(args):
        return grid.run(args)
    grid.one_point(args)
    program, target, specs = _resolve(args)
    chosen = specs if isinstance(specs, PolicySet) else None
    if chosen is not None:
        specs = list(chosen.specs)
    try:
        with CompileProgress() as bar, CompileEngine(args.workers, progress=bar) as engine:
            results = analyze_policies(
                program, specs, target=target, budget_bytes=args.budget,
                top_k=max(_BUFFERS if args.buffers is None else args.buffers, 0),
                raise_errors=False, engine=engine,
                policy_alone_peak=args.policy_alone_peak,
            )  # fmt: skip
    except CompileError as err:
        print(f"{A.PROG}: error: {err}", file=sys.stderr)
        return 1
    reports = [r for r in results if not isinstance(r, CompileError)]
    errors = [e for e in results if isinstance(e, CompileError) and not e.out_of_memory]
    layers = []
    if args.per_layer and reports:
        try:
            layers = per_layer_activations(
                program,
                policies=[s for s, r in zip(specs, results, strict=True)
                          if not isinstance(r, CompileError)],
                target=target, workers=args.workers,
            )  # fmt: skip
        except CompileError as err:
            errors.append(err)
    labels = [  # the table's row names, one per report
        label
        for label, r in zip(_labels(specs, chosen), results, strict=True)
        if not isinstance(r, CompileError)
    ]
    if args.timeline and reports:
        from remat_kit import plots  # matplotlib: imported only when a figure is drawn

        plots.timeline(reports, args.timeline, titles=labels)
        print(f"{A.PROG}: wrote {args.timeline}", file=sys.stderr)
    if args.html and reports:
        _write_html(args, program, target, specs, results, labels, chosen)
    if args.json:
        rows = [  # the reports, and the steps refused as over memory, in policy order
            (label, r)
            for label, r in zip(_labels(specs, chosen), results, strict=True)
            if not isinstance(r, CompileError) or r.out_of_memory
        ]
        out = {
            "reports": [
                refused_dict(r, label, program, target, args.budget)
                if isinstance(r, CompileError)
                else _report_dict(r, with_timeline=bool(args.timeline))
                for label, r in rows
            ],
            "labels": [label for label, _ in rows],
            "errors": [{"what": e.what, "error": e.xla_message} for e in errors],
        }
        if chosen is not None:
            out["checkpoint_names"] = sorted(chosen.tags)
            out["notes"] = list(chosen.notes)
        if layers:
            out["per_layer"] = [dataclasses.asdict(x) for x in layers]
        print(json.dumps(out, indent=1))
    else:
        print_reports(program, target, args, results, layers, specs, chosen)
    for err in errors:
        print(f"{A.PROG}: error: {err}", file=sys.stderr)
    return 1 if errors else 0


def _write_html(args, config, target, specs, results, labels, chosen) -> None:
    """``--html``: the interactive report of every compiled policy, with the doctor's findings
    under ``--doctor`` (one line on stderr)."""
    from remat_kit import doctor, report_html

    ok = [i for i, r in enumerate(results) if not isinstance(r, CompileError)]
    notes = []
    if chosen is not None:
        names = ", ".join(sorted(chosen.tags)) or "none"
        notes = [f"checkpoint names {config.name!r} emits: {names}", *chosen.notes]
    notes += _summary_lines(target, args, results, labels)
    findings = None
    if args.doctor:
        compiled = [specs[i] for i in ok]
        findings = [list(f) for f in doctor.check_policies(config, compiled, target)]
    group = report_html.group_of_reports(
        [results[i] for i in ok], labels, findings=findings, notes=notes
    )
    size = report_html.write_report(args.html, [group], command=A.command_line(args))
    print(f"{A.PROG}: wrote {args.html} ({size / 2**20:.1f} MiB)", file=sys.stderr)


def refused_dict(err: CompileError, label: str, program, target, budget: int | None) -> dict:
    """A step the compiler refused as over the device's memory, as a ``--json`` report: every
    field of :class:`~remat_kit.memory.report.MemoryReport`, ``fits`` False, the peak and the
    other compiled figures unknown (null, never 0), XLA's message in ``warnings``."""
    row: dict = {f.name: None for f in dataclasses.fields(MemoryReport)}
    row.update(
        name=program.title, target=target.name, platform=target.platform, policy=label,
        memory_bytes=target.memory_bytes,
        budget_bytes=budget if budget is not None else target.memory_bytes, fits=False,
        arguments={}, residuals=[], peak_buffers=[], compile_cached=False,
        warnings=[f"does not fit: XLA refused to compile the step ({err.over_memory()}): "
                  f"{err.xla_message}"],
    )  # fmt: skip
    return row


def _refused_line(err: CompileError, label: str, target) -> str:
    """The note under the table for a step refused as over memory."""
    return (
        f"{label}: does not fit {target.name}: XLA refused to compile it "
        f"({err.over_memory()}); its peak is unknown (--json has XLA's message)"
    )


def _report_dict(report, with_timeline: bool) -> dict:
    """``report.to_dict()``; its timeline (a few hundred points per policy) only with
    ``--timeline``."""
    d = report.to_dict()
    if not with_timeline:
        d.pop("timeline", None)
    return d


def _policy_table(program, target, args, results, labels: Sequence[str]):
    """One row per policy, fitted to the terminal: the host column only where some policy puts
    bytes on the host, and the compile seconds left out first when it does not fit."""
    known = program.known
    shape = "" if known.batch_size is None else f", batch={known.batch_size} seq={known.seq_len},"
    title = f"{program.name}{shape} on {target.name} ({target.description})"
    ok = [r for r in results if not isinstance(r, CompileError)]
    unit, name = table_unit([v for r in ok for v in (r.peak_bytes, r.activation_bytes)])
    host = any(r.host_bytes for r in ok)
    cols = ("policy", "peak", *(["host"] if host else []), "residuals", "recompute", "fits",
            "est. step", "bound by", "compile s")  # fmt: skip
    none = "" if host else ", none on the host"
    t = table(f"{title}, bytes in {name}{none}", cols, right=cols[1:], optional=("compile s",))
    for label, r, same in zip(labels, results, same_program_as(results), strict=True):
        if isinstance(r, CompileError):
            # TPU: XLA refuses a step over HBM (a note below gives its figures)
            over = r.out_of_memory
            first = ("over memory", "", "", "", Text("no", style="red")) if over else (
                "compile failed", "", "", "", "")  # fmt: skip
            add_row(t, label, *first[: 1 + host], *first[2:], "", "", "")
            continue
        seconds = "cached" if r.compile_cached else f"{r.compile_s:.1f}"
        if same is not None:  # compiled once, for the first row of that program
            label, seconds = f"{label} (same program as {labels[same]})", "-"
        fits = "-" if r.fits is None else ("yes" if r.fits else "no")  # "-": no budget known
        style = "" if r.fits is None else ("green" if r.fits else "red")
        ratio = "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.2f}x"
        add_row(
            t, label, in_unit(r.peak_bytes, unit, 2),
            *([in_unit(r.host_bytes, unit, 2)] if host else []),
            in_unit(r.activation_bytes, unit, 2), ratio, Text(fits, style=style),
            format_seconds(r.step_time_s, 3), _bound_by(r.step_time), seconds,
        )  # fmt: skip
    return t


def _bound_by(step: StepTime | None) -> str:
    """The largest share of an estimated step (``"memory 61%"``), or "-"."""
    if step is None or not step.step_time_s:
        return "-"
    parts = {
        "compute": step.compute_s, "memory": step.memory_s, "vector": step.elementwise_s,
        "launch": step.launch_s, "host": step.transfer_s, "network": step.collective_s,
        "alloc": step.allocation_s,
    }  # fmt: skip
    name, value = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} {value / step.step_time_s:.0%}"


def _time_line(results) -> str | None:
    """Where the estimated step times come from (one line), or None without estimates."""
    step = next((r.step_time for r in results if getattr(r, "step_time", None)), None)
    if step is None:
        return None
    figures = step.figures.split(":", 1)[0]
    how = "measured on this machine" if step.measured_figures else "from datasheets"
    # a figure no datasheet gives (a TPU's per-op cost, a GPU's launch, vector units) says so
    assumed = [p.strip() for p in step.figures.split(";") if "assumed" in p]
    small = small_step_note(
        (r.step_time_s for r in results if not isinstance(r, CompileError)),
        step.measured_figures,
    )
    slower = no_remat_slower_note(
        {r.policy: r.step_time_s for r in results if not isinstance(r, CompileError)},
        step.measured_figures,
    )
    return (
        f"est. step: roofline over the compiled kernels, device figures {how} ({figures}; "
        + (f"assumed, not cited: {'; '.join(assumed)}; " if assumed else "")
        + "MemoryReport.step_time has the breakdown and the dominant kernels): an estimate, "
        "not a measurement" + (f"; {small}" if small else "") + (f"; {slower}" if slower else "")
    )


def _margin_note(memory: int) -> str:
    """What recommend's default budget keeps free of the same memory, so a policy fitting here
    and not there reads as the margin, not a disagreement."""
    from remat_kit.recommend.api import DEFAULT_MARGIN

    kept = int(memory * (1 - DEFAULT_MARGIN))
    return (
        f" (the whole memory; recommend's default budget keeps {DEFAULT_MARGIN:.0%} free: "
        f"{_size(kept)})"
    )


def _summary_lines(target, args, results, labels: Sequence[str]) -> list[str]:
    reports = [r for r in results if not isinstance(r, CompileError)]
    first = reports[0]
    budget = args.budget if args.budget is not None else target.memory_bytes
    lines = [
        f"{first.backend}{'; traced under jax_remat3' if first.remat_impl == 'remat3' else ''}"
        "; peak = "
        + (
            "XLA's peak_memory_in_bytes (per device; its temp figure leaves out temporaries)"
            if target.platform == "tpu"
            else "argument + output + temp - alias (per device)"
        )
        + (
            f"; budget {_size(budget)}" + (_margin_note(budget) if args.budget is None else "")
            if budget
            else "; target memory unknown (CPU): fits is '-', give --budget to judge it"
        ),
        "arguments: "
        + ", ".join(f"{k} {_size(v)}" for k, v in first.arguments.items())
        + (
            " (other: XLA's argument bytes beyond the arguments' values: on a TPU, the tiled "
            "layout's padding, T(8,128))"
            if target.platform == "tpu" and first.arguments.get("other", 0) > 0
            else ""
        ),
    ]
    if target.platform == "cpu":
        lines.append("CPU backend: these are XLA:CPU numbers, not GPU numbers; offload is not real")
    over = _residuals_over_peak(results, labels)
    if over:
        lines.append(over)
    time_line = _time_line(results)
    if time_line:
        lines.append(time_line)
    ok = [
        (label, r)
        for label, r in zip(labels, results, strict=True)
        if not isinstance(r, CompileError)
    ]
    lines += peak_inversions([r for _, r in ok], [label for label, _ in ok])
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


def _residuals_over_peak(results, labels: Sequence[str]) -> str | None:
    """The note for residual figures above their step's compiled peak, or None: the residuals
    column is the jaxpr's (``jax.ad_checkpoint.print_saved_residuals``: what the remat boundary
    keeps before XLA's fusion), and XLA fuses elementwise residuals into their consumers, so it
    can exceed everything the compiled step holds at once (jax#12792)."""
    over = [
        f"{label} {_size(r.activation_bytes)} against a {_size(r.peak_bytes)} peak"
        for label, r in zip(labels, results, strict=True)
        if not isinstance(r, CompileError)
        and r.activation_bytes is not None
        and r.peak_bytes is not None
        and r.activation_bytes > r.peak_bytes
    ]
    if not over:
        return None
    return (
        "residuals: what JAX's jaxpr keeps at the remat boundary (print_saved_residuals), "
        "before XLA fuses elementwise residuals away; above the compiled peak here ("
        + "; ".join(over)
        + "): the peak is what the step holds"
    )


def _labels(specs: Sequence[PolicySpec], chosen: PolicySet | None) -> list[str]:
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
    """Each report's warnings, XLA's long ones in one line
    (:func:`remat_kit.terminal.short_warnings`; ``--json`` keeps them whole), each said once
    with every policy that has it ("all policies" for all), a cause several share said once
    after them (:func:`remat_kit.terminal.group_notes`)."""
    items = [
        (
            label,
            short_warnings(
                w
                for w in r.warnings
                # the table's row says "(same program as X)"
                if "offloading did not" not in w and not w.startswith(SAME_PROGRAM)
            ),
        )
        for label, r in zip(labels, results, strict=True)
        if not isinstance(r, CompileError)
    ]
    return group_notes(items)


def print_reports(
    program, target, args, results, layers, specs: Sequence[PolicySpec], chosen=None
) -> None:
    """The reports as tables: one row per policy, the shared figures, XLA's warnings, the
    largest buffers at the peak (one policy) and the per-layer comparison (``--per-layer``);
    for a program (``chosen``: its :class:`PolicySet`), the notes on which policies were
    compiled and the residuals by its own checkpoint names."""
    out = console()
    labels = _labels(specs, chosen)
    out.print(_policy_table(program, target, args, results, labels))
    for label, r in zip(labels, results, strict=True):
        if isinstance(r, CompileError) and r.out_of_memory:
            out.print(_refused_line(r, label, target), highlight=False, markup=False)
    reports = [r for r in results if not isinstance(r, CompileError)]
    if not reports:
        return
    if chosen is not None:
        for t in residual_tag_tables(results, labels, chosen.tags):
            out.print(t)
    notes = []
    if chosen is not None:
        names = ", ".join(sorted(chosen.tags)) or "none"
        notes = [f"checkpoint names {program.name!r} emits: {names}", *chosen.notes]
    for line in _summary_lines(target, args, results, labels) + notes:
        out.print(line, highlight=False, markup=False)
    for line in _warning_lines(results, labels):
        out.print(line, highlight=False, markup=False)
    if len(reports) == 1 and (args.buffers is None or args.buffers > 0):
        out.print(buffer_table(reports[0]))
    elif len(reports) > 1 and args.buffers:  # asked for, but one table per policy is too many
        out.print(
            f"--buffers shows the buffers of one policy: give one --policy (analysed "
            f"{len(reports)})", highlight=False, markup=False,
        )  # fmt: skip
    if layers:
        out.print(_layer_table(layers))
        for x in layers:
            out.print(f"{x.policy}: {x.note}", highlight=False, markup=False)
