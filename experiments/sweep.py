"""Sweep remat policies: predicted and measured memory and step time, per policy, on real text.

A thin command line over :func:`remat_kit.sweep.run_sweep`. ``--config`` names a file in
``experiments/configs/`` (or a path); the default picks ``gpu`` on a GPU machine and ``cpu``
otherwise. Rows go to ``runs/<config name>/sweep.jsonl`` (git-ignored; the committed run under
``experiments/results/cpu/`` was written with ``--out``) as each point finishes;
at the end the summary table is printed and written beside them (``summary.md``) with the
figures (:func:`remat_kit.plots.save_figures`) and ``report.html`` (every row in one interactive,
offline page: :mod:`remat_kit.report_html`): ``pareto.png`` (peak memory against step time,
one point per policy, frontier drawn), ``slowdown_vs_flops.png``, ``memory_breakdown.png``;
``pareto_analysis.png`` when the config has analysis-only points (a program sweep has none);
with option grids (rows of one shape differing in ``overrides``,
``--config options``) also ``options.png`` and an options table in ``summary.md``.

Command (the default CPU config: ~6 CPU-minutes; the committed run took 4 min 43 s on 2 cores
shared with other jobs, jax 0.10.2)::

    python experiments/sweep.py                      # or --config quick for a 30 s smoke run
    python experiments/sweep.py --resume             # continue a killed run
    python experiments/sweep.py --data my_texts/     # train on your own text

Your own program: ``--model FILE.py:FACTORY`` (or ``MODULE:FACTORY``), a function of no
arguments returning a :class:`remat_kit.Program`, instead of ``--config``
(:func:`remat_kit.sweep.run_program_sweep`): every policy acting on the program's
``checkpoint_name`` tags (or those given with ``--policy``) is analysed and its step run on the
local device (the program's own arrays, or values materialised from its ``ShapeDtypeStruct`` s;
``--warmup-steps`` / ``--timed-steps``); rows go to ``runs/<program name>/sweep.jsonl``::

    python experiments/sweep.py --model remat_kit.examples.plain_jax:program

Several devices: on a machine with GPUs, measured points run side by side, one GPU each, in
worker processes (``CUDA_VISIBLE_DEVICES`` set per worker), or each on a group of GPUs with
``--mesh fsdp=4`` / ``dp=2,fsdp=2,tp=2`` (which also sets the mesh GPU targets are analysed on);
``XLA_PYTHON_CLIENT_PREALLOCATE=true`` keeps every point in this process on every GPU. On a CPU
the points run on every device JAX sees (``JAX_NUM_CPU_DEVICES=4`` gives 4), data parallel or on
the ``--mesh``; figures are per device. ``--workers N``: N processes analyse the analysis-only
points side by side (a line every 10 s says what runs). Several processes: the same
command once per process with ``--coordinator HOST:PORT --num-processes N --process-id I`` (or
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``; nothing under SLURM's
``srun``); process 0 writes the results.

A Ray cluster: ``--engine ray`` (``pip install 'remat-kit[ray]'``) runs each task as a Ray task
asking for its GPUs or a CPU, on a Ray instance started for the run or on ``--address`` /
``RAY_ADDRESS``; rows come back to this process, so ``--resume`` continues a killed driver.

A SLURM job array (or any N processes, on any machines that share a folder): array task I of
N runs ``--shard I/N``, the I-th of N deterministic parts of the points, into its own part
file beside ``--out`` (``sweep.part-I-of-N.jsonl``; ``--resume`` continues a part); then
``--merge`` joins the parts into ``--out`` and writes the summary, the figures and the report
(``--merge PART ...``: the part files named; docs/multi-device.md has an sbatch script)::

    python experiments/sweep.py --config cpu --out /shared/s/sweep.jsonl --shard 0/2
    python experiments/sweep.py --config cpu --out /shared/s/sweep.jsonl --shard 1/2
    python experiments/sweep.py --config cpu --out /shared/s/sweep.jsonl --merge

Exit codes: 0 done (rows with status ``oom`` included: a policy that does not fit is a result);
1 done, but a point failed with status ``error`` (its row and the last lines say why; every
other row is written), or a merge found points in no part yet (a note names the part to
resume); 2 bad input, one line on
stderr before anything compiles (unknown preset or policy, invalid grid values, unwritable
output, resuming onto another config's results (the line names the first field that differs;
the file is left as it was), a missing, empty or binary ``--data`` path, a ``--shard`` not
``I/N`` with ``0 <= I < N``, a part file missing or of another config at ``--merge``; with
``--model``: a module, file or factory that cannot be loaded, a factory not returning a
Program, ``--config`` / ``--data`` / ``--mesh`` beside it, a ``--policy`` naming a tag the
program does not emit, or no policy acting on its tags).

Ctrl-C: one line (``interrupted: N rows kept in FILE; --resume continues``), exit 130.

Crash safety: each row is one write, flushed and fsync-ed, as its point finishes. Killed at any
moment, ``--resume`` keeps every finished row, drops a torn last line, runs only the missing
points, and rebuilds ``summary.md`` and the figures from all the rows (they are written to a
temporary name and renamed, so a kill never leaves them torn either).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

try:
    import remat_kit  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# experiments/trainer, imported as `trainer`: this folder is sys.path[0] when run as a script, not
# when loaded by path (tests: importlib, runpy)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer import distributed

from remat_kit import files
from remat_kit.cli.args import arg_type, nonnegative_int, positive_int
from remat_kit.policies import parse_policy_arg
from remat_kit.sweep.fanout import FanOut
from remat_kit.sweep.shard import merge_parts, parse_shard, part_path
from remat_kit.units import format_span
from remat_kit.validation import closest

EXIT_BAD_INPUT = 2
HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
RESULTS = HERE / "results"  # committed runs (written with --out)
RUNS = HERE.parent / "runs"  # a user's runs (git-ignored)
#: The name before every error line, as the remat-kit CLI writes ``remat-kit: error: ...``.
PROG = "sweep.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints the usage too)
        self.exit(EXIT_BAD_INPUT, f"{PROG}: error: {message}\n")


def _policy_text(text: str) -> str:
    """A ``--policy`` value checked as every remat-kit command reads it
    (:func:`remat_kit.policies.parse_policy_arg`: a misspelled name is refused before a program
    is traced), kept as the text given (a config's grids hold policies as text)."""
    parse_policy_arg(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    names = sorted(p.stem for p in CONFIGS.glob("*.py") if not p.stem.startswith("_"))
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--config",
        default=None,
        help=f"a config name ({', '.join(names)}) or a .py path (default: auto, i.e. gpu on "
        "a GPU machine, else cpu)",
    )
    p.add_argument(
        "--model",
        help="sweep your own program instead of a config: MODULE:FACTORY or FILE.py:FACTORY, a "
        "function of no arguments returning a remat_kit.Program",
    )
    p.add_argument("--warmup-steps", type=nonnegative_int, default=None,
                   help="--model: untimed steps per policy (default 2)")  # fmt: skip
    p.add_argument("--timed-steps", type=positive_int, default=None,
                   help="--model: timed steps per policy (default 5)")  # fmt: skip
    p.add_argument(
        "--out",
        help="results file (default: runs/<config>/sweep.jsonl); summary.md and the figures "
        "are written in its folder, so give each sweep its own folder",
    )
    p.add_argument(
        "--policy", action="append", default=None, type=arg_type(_policy_text, "policy"),
        help="run these policies instead of the config's (repeatable): a name or a per-tag spec "
        "'query_proj=offload,out_proj=save' / its JSON form",
    )  # fmt: skip
    p.add_argument("--resume", action="store_true", help="skip points already in --out")
    p.add_argument("--overwrite", action="store_true", help="empty --out first")
    p.add_argument("--data", help="text file or folder to train on (default: Python's stdlib)")
    p.add_argument("--max-data-bytes", type=int, help="cap on the corpus size, in bytes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true",
                   help="skip the figures (pareto.png, ...) and report.html")  # fmt: skip
    p.add_argument(
        "--engine", choices=("local", "ray"), default="local",
        help="what runs the points: local (this machine: --workers processes, every GPU) or "
        "ray (Ray tasks, each asking for its GPUs or a CPU; pip install 'remat-kit[ray]')",
    )  # fmt: skip
    p.add_argument(
        "--address", default=None,
        help="--engine ray: the Ray cluster to run on (default: $RAY_ADDRESS, else a Ray "
        "instance started on this machine)",
    )  # fmt: skip
    p.add_argument(
        "--workers", type=positive_int, default=1, metavar="N",
        help="processes analysing the analysis-only points side by side (JAX_PLATFORMS=cpu; "
        "default 1: this process). Measured points run side by side on every GPU JAX sees, one "
        "GPU each (a --mesh point: a group of as many GPUs)",
    )  # fmt: skip
    p.add_argument(
        "--shard", type=arg_type(parse_shard, "shard"), metavar="I/N",
        help="run part I of N of the points (a SLURM array task: "
        "--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT) into its own part file beside "
        "--out (sweep.part-I-of-N.jsonl); no summary or figures until --merge",
    )  # fmt: skip
    p.add_argument(
        "--merge", nargs="*", metavar="PART", default=None,
        help="join the part files (default: every sweep.part-I-of-N.jsonl beside --out) into "
        "--out, then write the summary, the figures and the report",
    )  # fmt: skip
    distributed.add_arguments(p)
    return p


#: Options of a preset sweep that a program sweep (``--model``) does not take.
_PRESET_ONLY = ("config", "data", "max_data_bytes", "mesh", "coordinator", "num_processes",
                "process_id", "shard")  # fmt: skip


def _program_sweep(args: argparse.Namespace, console, where: list[Path]):
    """``--model``: load the program and sweep it (:func:`measured.run_program_sweep`);
    the results file is appended to ``where`` before the sweep starts.

    Raises:
      ValueError: a preset-sweep option given with ``--model``; a program that cannot be
        loaded; what :func:`run_program_sweep` raises.
    """
    from measured import run_program_sweep

    from remat_kit.cli.console import console as make_console
    from remat_kit.loading import load_program
    from remat_kit.sweep.output import check_output_flags

    given = [f"--{o.replace('_', '-')}" for o in _PRESET_ONLY if getattr(args, o, None)]
    given += ["--merge"] if args.merge is not None else []
    given += ["--workers"] if args.workers != 1 else []
    given += ["--engine"] if args.engine != "local" else []
    given += ["--address"] if args.address is not None else []
    if given:
        raise ValueError(f"{', '.join(given)}: not with --model (a program sweep runs the "
                         "program's own arguments on this device)")  # fmt: skip
    if ":" not in args.model:  # a preset name: those are swept through a config
        raise ValueError(
            f"--model takes your program as MODULE:FACTORY or FILE.py:FACTORY, got "
            f"{args.model!r}; bundled presets are swept with --config (see experiments/configs)"
        )
    program = load_program(args.model)
    out = Path(args.out) if args.out else RUNS / program.name / "sweep.jsonl"
    where.append(out)
    check_output_flags(out, args.resume, args.overwrite)  # before the banner
    console.print(f"sweep of program [bold]{program.name}[/] ({args.model})")
    run = run_program_sweep(
        program, out, policies=args.policy,
        warmup_steps=2 if args.warmup_steps is None else args.warmup_steps,
        timed_steps=5 if args.timed_steps is None else args.timed_steps,
        resume=args.resume, overwrite=args.overwrite,
        ref=args.model, progress=not args.no_progress, console=make_console(stderr=True),
    )  # fmt: skip
    console.print(f"results: {out}")  # once written: a bad policy is refused before any row
    for note in run.notes:
        console.print(f"note: {note}")
    return run, out


def config_path(name: str) -> Path:
    """``auto`` / a name in ``experiments/configs`` / a path -> the config file."""
    if name == "auto":
        import jax

        name = "gpu" if jax.default_backend() == "gpu" else "cpu"
    path = Path(name)
    if path.suffix == ".py" or path.exists():
        return path
    return CONFIGS / f"{name}.py"


def _summary_header(run, argv: list[str] | None, legend: str, source: str | None) -> str:
    """Where and how the rows were made, for the top of summary.md, and what the columns of its
    tables mean (``legend``: :func:`measured.summary.summary_legend`; ``source``: the device
    figures of the local estimates, :func:`measured.summary.local_estimate_source`)."""
    from measured import summary

    args = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python experiments/sweep.py {args}".rstrip()
    r = run.rows[-1] if run.rows else {}
    data = f"{r.get('data_source')} (sha256 {r.get('data_fingerprint')})"
    return "\n".join(
        [
            f"# Sweep `{r.get('sweep')}`",
            "",
            f"- Command: `{command}`",
            f"- Last run: {r.get('time')}; {len(run.new_rows)} point(s) in {run.wall_s:.0f} s, "
            f"{run.skipped} kept from earlier runs",
            f"- Machine: {_machine(r, run.rows)}",
            *([f"- Estimates on 'local' from {source}"] if source else []),
            *([f"- Note: {note}"] if (note := summary.load_note(run.rows)) else []),
            *([f"- Note: {fast}"] if (fast := summary.cpu_faster_note(run.rows)) else []),
            *([f"- Note: {small}"] if (small := summary.small_step_note(run.rows)) else []),
            *([f"- Note: {slow}"] if (slow := summary.no_remat_slower_note(run.rows)) else []),
            *([f"- Note: {peak}"] if (peak := summary.measured_peak_note(run.rows)) else []),
            _measured_line(r, data),
            *(f"- Note: {n}" for n in run.notes),
            *([f"- {legend}"] if legend else []),
            "",
            "",
        ]
    )


def _machine(r: dict, rows: list[dict] | None = None) -> str:
    """Where the rows' figures come from: backend, devices, CPUs, library versions, and the
    1-minute load average when the measured ``rows`` were timed (other work slows steps)."""
    loads = [x["load_average"][0] for x in rows or () if x.get("load_average")]
    load = f"; load average {format_span(loads)} when timed" if loads else ""
    return (
        f"{r.get('backend')} backend, {r.get('device_count')} x {r.get('device_kind')} in "
        f"{r.get('process_count', 1)} process(es), {r.get('cpu_count')} CPUs "
        f"({r.get('machine')}{', ' + r['cpu_model'] if r.get('cpu_model') else ''}); "
        f"jax {r.get('jax')}, jaxlib {r.get('jaxlib')}, flax {r.get('flax')}, "
        f"optax {r.get('optax')}{load}"
    )


def _measured_line(r: dict, data: str) -> str:
    """What the measured rows ran on: the corpus, or a program's own arguments."""
    if r.get("data_source"):
        return f"- Measured rows train on {data}"
    if r.get("arguments"):
        note = f" ({r['arguments_note']})" if r.get("arguments_note") else ""
        return f"- Program `{r.get('program')}`, run on its arguments: {r['arguments']}{note}"
    return "- Analysis only"


def _write_outputs(run, out: Path, args, argv: list[str] | None, console) -> int:
    """The table, summary.md and the figures, rebuilt from every row of the run's file; the
    exit code (1 when a point of this run failed with status ``error``)."""
    from measured import summary

    from remat_kit import plots
    from remat_kit.sweep import results
    from remat_kit.sweep.output import warning_lines

    summary.print_summary(run.rows, console)
    if run.rows:  # every figure says where it comes from ("local": this machine's backend)
        console.print(
            f"measured and analysed on: {_machine(run.rows[-1], run.rows)} "
            "('local' is this machine)",
            highlight=False, markup=False,
        )  # fmt: skip
    source = summary.local_estimate_source(run.rows)
    if source:  # a calibration timed on a busy machine misprices memory traffic: say which
        from remat_kit.memory.calibration import cache_dir

        # its figures (name=value, ...) are in summary.md: the terminal gets where and when
        brief = re.sub(r": \w+=[^,]+(, \w+=[^,]+)*$", "", source)
        console.print(
            f"est. on 'local' from {brief} (figures in summary.md; to time it again on a quiet "
            f"machine, delete {cache_dir() / 'calibration'})",
            highlight=False, markup=False,
        )  # fmt: skip
    for note in (
        summary.load_note(run.rows),  # the machine's load while the steps were timed
        summary.cpu_faster_note(run.rows),  # why remat can time faster than no-remat on a CPU
        summary.small_step_note(run.rows),  # the small-step caveat as analyze and recommend say it
        summary.no_remat_slower_note(run.rows),  # the datasheet estimate's order, as analyze says
        summary.measured_peak_note(run.rows),  # a null measured peak
    ):
        if note:
            console.print(f"note: {note}", highlight=False, markup=False)
    legend = summary.summary_legend(run.rows)
    if legend:  # what the columns mean, under the table as at the top of summary.md
        console.print(f"columns: {legend}", highlight=False, markup=False)
    warnings = warning_lines(run.rows)  # each policy's analysis warnings, shared ones once
    if warnings:
        console.print("analysis warnings (summary.md has XLA's messages whole):")
    for line in warning_lines(run.rows, short=True):
        console.print(f"  - {line}", highlight=False, markup=False)
    # Rebuilt from every row on each run (a resumed one too); written beside, then renamed.
    options = results.option_markdown(run.rows)  # "" unless rows differ in overrides
    listed = "".join(f"- {line}\n" for line in warnings)
    files.write_text(
        out.parent / "summary.md",
        _summary_header(run, argv, legend, source)
        + summary.summary_markdown(run.rows)
        + (f"\nAnalysis warnings:\n\n{listed}" if warnings else "")
        + ("\n" + options if options else ""),
    )
    written = [out.parent / "summary.md"]
    if not args.no_plot:
        written += plots.save_figures(run.rows, out.parent)
        html = _write_html(run, out, argv)
        written += [html] if html else []
    bad = [r for r in run.new_rows if r["status"] != "ok"]
    console.print(
        f"{len(run.new_rows)} point(s) run, {run.skipped} skipped (already in {out.name}), "
        f"{len(bad)} failed; {run.wall_s:.0f} s. Wrote {', '.join(str(w) for w in written)}"
    )
    for r in bad:
        seq = f" s={r['seq_len']}" if r.get("seq_len") is not None else ""
        console.print(f"  [red]{r['status']}[/] {r['model']}{seq} {r['policy']}: {r['error']}")
    return 1 if any(r["status"] == "error" for r in bad) else 0


def _write_html(run, out: Path, argv: list[str] | None) -> Path | None:
    """``report.html`` beside the rows (:mod:`remat_kit.report_html`): every group of rows,
    rebuilt from all of them; None when no row has an analysis to show."""
    from remat_kit import report_html

    groups = report_html.groups_of_rows(run.rows)
    if not any(e.report is not None for g in groups for e in g.entries):
        return None
    args = " ".join(sys.argv[1:] if argv is None else argv)
    r = run.rows[-1]
    hardware = f"{r.get('device_count')} x {r.get('device_kind')} ({r.get('backend')} backend)"
    path = out.parent / "report.html"
    report_html.write_report(
        path, groups, command=f"python experiments/sweep.py {args}".rstrip(),
        title=f"sweep {r.get('sweep') or r.get('program')}", hardware=hardware,
    )  # fmt: skip
    return path


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd command


def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C ends it with one line and exit 130 (rows written stay)."""
    where: list[Path] = []  # the results file, once known
    try:
        return _main(argv, where)
    except KeyboardInterrupt:
        if not where:
            print("interrupted before the sweep started", file=sys.stderr)
        else:
            from remat_kit.sweep import results

            kept = len(results.read_rows(where[0])) if where[0].is_file() else 0
            print(f"interrupted: {kept} rows kept in {where[0]}; --resume continues",
                  file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None, where: list[Path]) -> int:
    args = build_parser().parse_args(argv)
    try:  # before anything starts JAX's backends
        several = distributed.initialize_from_args(args)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    worker_env = {} if several or args.model is not None or args.merge is not None else (
        _leave_gpu_memory())  # fmt: skip
    from measured import TextMeasurer

    from remat_kit import sweep
    from remat_kit.cli.console import console as make_console
    from remat_kit.sweep.output import check_output_flags

    primary = distributed.is_primary()
    console = make_console(quiet=not primary)  # COLUMNS, else the terminal's width (100 when piped)
    if args.model is not None:
        try:
            run, out = _program_sweep(args, console, where)
        except ValueError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return _write_outputs(run, out, args, argv, console)
    try:
        _fan_out(args).check()
        steps = [o for o in ("warmup_steps", "timed_steps") if getattr(args, o) is not None]
        if steps:
            names = ", ".join(f"--{o.replace('_', '-')}" for o in steps)
            raise ValueError(f"{names}: only with --model (a config sets its grids' steps)")
        if args.max_data_bytes is not None and args.max_data_bytes < 1:
            raise ValueError(f"--max-data-bytes must be >= 1, got {args.max_data_bytes}")
        path = config_path(args.config or "auto")
        if not path.is_file():
            names = sorted(p.stem for p in CONFIGS.glob("*.py") if not p.stem.startswith("_"))
            near = closest(str(args.config), names)
            raise ValueError(
                f"no sweep config {args.config!r} (looked for {path}); valid: "
                f"{', '.join(names)}, or a path to a .py file."
                + (f" Did you mean {near!r}?" if near else "")
            )
        config = sweep.load_config(path)
        if args.mesh is not None:
            grids = tuple(dataclasses.replace(g, mesh=args.mesh) for g in config.grids)
            config = dataclasses.replace(config, grids=grids)
        if args.policy:
            grids = tuple(dataclasses.replace(g, policies=tuple(args.policy)) for g in config.grids)
            config = dataclasses.replace(config, grids=grids)
            sweep.validate(config)
        out = Path(args.out) if args.out else RUNS / config.name / "sweep.jsonl"
        merged = out
        if args.shard is not None:
            out = part_path(out, args.shard)
        where.append(out)
        if args.merge is None:  # a merge replaces the rows of its parts' keys, keeps the rest
            check_output_flags(out, args.resume, args.overwrite)  # before the banner
        console.print(f"sweep [bold]{config.name}[/]: {config.description}")
        console.print(f"results: {out}")
        if args.merge is not None:
            if not primary:
                return 0
            run = merge_parts(config, out, args.merge or None, data=args.data)
        else:
            run = sweep.run_sweep(
                config,
                out,
                resume=args.resume,
                overwrite=args.overwrite,
                measurer=TextMeasurer(args.data, args.max_data_bytes),
                progress=not args.no_progress,
                console=make_console(stderr=True, quiet=not primary),
                shard=args.shard,
                engine=_fan_out(args).make_engine(worker_env),
            )
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not primary:
        return 0
    if args.shard is not None:
        return _part_done(run, args.shard, merged, console)
    code = _write_outputs(run, out, args, argv, console)
    for note in run.notes if args.merge is not None else ():
        console.print(f"note: {note}", highlight=False, markup=False)
    return max(code, 1) if args.merge is not None and run.notes else code


def _leave_gpu_memory() -> dict[str, str | None]:
    """Start JAX in this process without it taking most of each GPU's memory, so the GPUs can
    go to worker processes, one point each (:func:`remat_kit.sweep.engine.shareable_gpus`);
    the environment overrides that give the workers the user's own setting back. Nothing when
    the user set it (``XLA_PYTHON_CLIENT_PREALLOCATE=true``: the points run in this process,
    on every GPU together, as before)."""
    from remat_kit.sweep.engine import PREALLOCATE

    if PREALLOCATE in os.environ:
        return {}
    os.environ[PREALLOCATE] = "false"
    return {PREALLOCATE: None}


def _fan_out(args: argparse.Namespace) -> FanOut:
    """The run's fan-out as the flags ask for it (:class:`remat_kit.sweep.fanout.FanOut`:
    its ``check`` refuses a combination that cannot go together, its ``make_engine`` makes
    the engine)."""
    return FanOut(
        args.engine, args.address, args.workers, args.shard, args.merge, args.resume,
        args.overwrite,
    )  # fmt: skip


def _part_done(run, shard, merged: Path, console) -> int:
    """One part of a sharded sweep finished: what it wrote and what comes next (the summary and
    the figures come from the merged parts); 1 when a point failed with status ``error``."""
    bad = [r for r in run.new_rows if r["status"] != "ok"]
    console.print(
        f"part {shard}: {len(run.new_rows)} point(s) run, {run.skipped} skipped (already in "
        f"{run.path.name}), {len(bad)} failed; {run.wall_s:.0f} s. When every part is done: "
        f"--merge (with --out {merged})",
        highlight=False, markup=False,
    )  # fmt: skip
    return 1 if any(r["status"] == "error" for r in bad) else 0


if __name__ == "__main__":
    code = main()
    if code == EXIT_INTERRUPTED:  # XLA's threads, stopped mid-step, can crash the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
