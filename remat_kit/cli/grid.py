"""``remat-kit analyze`` over a grid: several ``--model`` / ``--batch`` / ``--seq`` / ``--mesh``
values (or ``--out``) run as the sweep's tasks (:mod:`remat_kit.sweep`), one table at the end.

The grid becomes a :class:`~remat_kit.sweep.SweepConfig` of analysis-only grids (one per model
and mesh: a model's own default policy differs from another's), run by
:func:`~remat_kit.sweep.run_sweep` through the engine the flags name
(:class:`~remat_kit.sweep.fanout.FanOut`): each point (model x batch x seq x mesh, all its
policies) a task keyed by its rows' keys, each row appended to ``--out`` as it finishes,
``--resume``, ``--shard I/N`` into a part file and ``--merge`` of the parts
(:mod:`remat_kit.sweep.shard`). The rows are the sweep's (:mod:`remat_kit.sweep.rows`), with
the figures ``remat-kit analyze`` prints for one point.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.text import Text

from remat_kit import targets
from remat_kit.cli import args as A
from remat_kit.cli.console import add_row, console, table
from remat_kit.units import format_seconds, in_unit, table_unit

#: The grid's axes: repeatable flags (argparse ``dest``), one value each per point.
AXES = ("model", "batch", "seq", "mesh")
#: Flags of a single point's analysis that a grid does not take (``dest``: flag).
SINGLE_ONLY = {
    "json": "--json", "html": "--html", "timeline": "--timeline", "doctor": "--doctor",
    "per_layer": "--per-layer", "buffers": "--buffers",
    "policy_alone_peak": "--policy-alone-peak", "budget": "--budget", "workers": "--workers",
}  # fmt: skip
#: What the rows of a grid are stored under (the sweep's name in each row).
NAME = "analyze"
#: Exit code of a run stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


def _fan_out(args: argparse.Namespace):
    from remat_kit.sweep.fanout import FanOut

    return FanOut(
        args.engine, args.address, args.grid_workers, args.shard, args.merge, args.resume,
        args.overwrite, workers_flag="--grid-workers",
    )  # fmt: skip


def is_grid(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for a grid: an axis given more than once, or any grid flag
    (``--out``, ``--resume``, ``--overwrite``, ``--shard``, ``--merge``, ``--grid-workers``,
    ``--engine``, ``--address``)."""
    if any(len(getattr(args, a, None) or ()) > 1 for a in AXES):
        return True
    return args.out is not None or any(getattr(args, k) != v for k, v in GRID_DEFAULTS.items())


#: The grid flags (``dest``) and their values when not given.
GRID_DEFAULTS = {"engine": "local", "address": None, "grid_workers": 1, "shard": None,
                 "merge": None, "resume": False, "overwrite": False}  # fmt: skip


def one_point(args: argparse.Namespace) -> None:
    """The axes' one-value lists as the single values a single point's analysis reads."""
    for a in AXES:
        values = getattr(args, a, None)
        if isinstance(values, list):
            setattr(args, a, values[0] if values else None)


def _check(args: argparse.Namespace) -> None:
    """Refuse what a grid cannot take (UsageError: one line)."""
    given = [flag for dest, flag in SINGLE_ONLY.items() if getattr(args, dest, None) not in
             (None, False)]  # fmt: skip
    if given:
        raise A.UsageError(
            f"{', '.join(given)}: for one point, not a grid (give one --model / --batch / "
            "--seq / --mesh and no --out; a grid writes every row to --out, and "
            "--grid-workers runs its points side by side)"
        )
    if getattr(args, "maxtext", None) is not None:
        raise A.UsageError("--maxtext: one point at a time, not a grid (no --out, one --seq)")
    if not args.model:
        raise A.UsageError("a grid needs --model (one or more presets)")
    programs = [m for m in args.model if A.is_program_ref(m)]
    if programs:
        raise A.UsageError(
            f"--model {programs[0]!r}: a grid takes presets (see remat_kit.preset_names()); "
            "analyze your own program one at a time"
        )
    missing = [f"--{f}" for f in ("batch", "seq") if not getattr(args, f)]
    if missing:
        raise A.UsageError(
            f"the following arguments are required for a preset: {', '.join(missing)}"
        )
    needs_out = [f for f, v in (("--resume", args.resume), ("--overwrite", args.overwrite),
                 ("--shard", args.shard), ("--merge", args.merge is not None)) if v]  # fmt: skip
    if needs_out and args.out is None:
        raise A.UsageError(f"{', '.join(needs_out)}: give --out PATH.jsonl (the grid's rows)")
    _fan_out(args).check()


def _meshes(args: argparse.Namespace, target: targets.Target) -> list[str | None]:
    """The grid's meshes as ``MeshSpec`` text (None: one device), each once."""
    devices = args.devices
    if target.tpu is not None and devices is None and not args.mesh:
        devices = target.tpu.num_devices  # a TPU slice: all its chips unless told
    out: list[str | None] = []
    for m in args.mesh or [None]:
        spec = targets.parse_mesh(m, devices)
        text = None if spec.num_devices == 1 else str(spec)
        if text not in out:
            out.append(text)
    return out


def build_config(args: argparse.Namespace):
    """The grid as a :class:`~remat_kit.sweep.SweepConfig`: one analysis-only grid per model
    and mesh, with the policies asked for (``--policy``, ``--all-policies``, else the preset's
    own), validated.

    Raises:
      UsageError: see :func:`_check`.
      ValueError: an unknown preset, policy, target, optimizer or field; a repeated value; a
        mesh the batch does not split over (the sweep's one-line messages).
    """
    from remat_kit.policies import policy_arg
    from remat_kit.sweep import ALL_POLICIES, Grid, SweepConfig, validate
    from remat_kit.training.step import make_optimizer
    from remat_kit.zoo import check_preset

    _check(args)
    if args.all_policies and args.policy:
        raise A.UsageError("give --policy or --all-policies, not both")
    target = targets.get_target(args.target)
    optimizer = args.optimizer or "adamw"
    make_optimizer(optimizer)
    overrides = A.parse_overrides(args.overrides)
    given = tuple(dict.fromkeys(policy_arg(s) for s in args.policy or ()))
    if len(set(args.model)) != len(args.model):
        raise ValueError(f"--model lists a value twice: {args.model}")
    grids = []
    for model in args.model:
        # the preset as one point's analysis reads it: its errors in the command line's terms
        for seq in args.seq:
            try:
                own = check_preset(model, seq, f"--set max_seq_len={seq}", **overrides)
            except ValueError as err:
                raise A.unknown_preset(err) from None
        if args.all_policies:
            policies = ALL_POLICIES
        elif given:
            policies = given
        else:  # the preset's own policy, as one point's analysis compiles it
            policies = (own if isinstance(own, str) else policy_arg(own),)
        for mesh in _meshes(args, target):
            grids.append(Grid(
                name=model + (f" mesh={mesh}" if mesh else ""), models=(model,),
                policies=policies, batch_sizes=tuple(args.batch), seq_lens=tuple(args.seq),
                targets=(args.target,), overrides=overrides, measure=False,
                optimizer=optimizer, mesh=mesh,
            ))  # fmt: skip
    config = SweepConfig(NAME, tuple(grids), f"remat-kit analyze on {target.name}")
    validate(config)
    return config


@contextlib.contextmanager
def _results_file(out: str | None) -> Iterator[Path]:
    """``--out``, or a file in a temporary folder removed at the end (rows for the table)."""
    if out is not None:
        yield Path(out)
        return
    with tempfile.TemporaryDirectory(prefix="remat-kit-grid-") as folder:
        yield Path(folder) / "grid.jsonl"


def run(args: argparse.Namespace) -> int:
    """Handle ``remat-kit analyze`` over a grid: 0 done, 1 a point failed (status ``error``)
    or a merge found points in no part yet, 2 bad input (raised as UsageError / ValueError,
    before any row is written or an old one dropped), 130 Ctrl-C (rows written are kept)."""
    from remat_kit.sweep import run_sweep
    from remat_kit.sweep.output import check_output_flags
    from remat_kit.sweep.shard import merge_parts, part_path

    config = build_config(args)
    points = config.points()
    fan = _fan_out(args)
    err = console(stderr=True)
    with _results_file(args.out) as out:
        path = out if args.shard is None else part_path(out, args.shard)
        if args.merge is not None:
            result = merge_parts(config, out, args.merge or None)
        else:
            check_output_flags(path, args.resume, args.overwrite)
            engine = fan.make_engine()
            shard = f", part {args.shard}" if args.shard else ""
            where = f" into {path}" if args.out else ""
            groups = len({p.group for p in points})
            err.print(f"{A.PROG} analyze: {groups} point(s), {len(points)} rows with their "
                      f"policies{shard}{where}", highlight=False)  # fmt: skip
            try:
                result = run_sweep(config, path, resume=args.resume, overwrite=args.overwrite,
                                   console=err, engine=engine, shard=args.shard)  # fmt: skip
            except KeyboardInterrupt:
                from remat_kit.sweep.results import read_rows

                kept = len(read_rows(path)) if args.out and path.is_file() else 0
                where = f": {kept} rows kept in {path}; --resume continues" if args.out else ""
                print(f"interrupted{where}", file=sys.stderr)
                return EXIT_INTERRUPTED
    out_console = console()
    out_console.print(grid_table(result.rows, args.target))
    bad = [r for r in result.new_rows if r.get("status") != "ok"]
    for r in bad:
        out_console.print(f"{_label(r)}: {r['status']}: {r.get('error')}", highlight=False,
                          markup=False)  # fmt: skip
    kept = f", {result.skipped} kept from {path.name}" if result.skipped else ""
    lines = [f"{len(result.new_rows)} row(s) analysed (a point's policies, a row each){kept}, "
             f"{len(bad)} failed; {result.wall_s:.0f} s"]  # fmt: skip
    if args.merge is not None:
        lines = [f"merged {len(result.new_rows)} rows into {out}", *result.notes]
    elif args.shard is not None:
        lines.append(f"part {args.shard} in {path}; when every part is done: --merge --out {out}")
    elif args.out:
        lines.append(f"rows in {out}")
    for line in lines:
        print(f"{A.PROG}: {line}", file=sys.stderr)
    failed = any(r.get("status") == "error" for r in bad)
    return 1 if failed or (args.merge is not None and result.notes) else 0


def _label(row: Mapping[str, Any]) -> str:
    mesh = f" [{row['mesh']}]" if row.get("mesh") else ""
    return f"{row['model']} b={row['batch_size']} s={row['seq_len']}{mesh} {_policy(row)}"


def _policy(row: Mapping[str, Any]) -> str:
    from remat_kit.sweep.results import row_label

    return row_label(row)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _mesh(text: str | None) -> str:
    """A mesh's axes over more than one device (``dp=1,fsdp=2,tp=1`` -> ``fsdp=2``), "-" for
    none."""
    if not text:
        return "-"
    return ",".join(a for a in text.split(",") if not a.endswith("=1")) or text


def grid_table(rows: Sequence[Mapping[str, Any]], target: str):
    """One table of the grid's rows, in point order, fitted to the terminal: model, batch,
    sequence length, mesh (where some point has one), policy, then the figures ``analyze``
    prints for one point (peak, residuals, recompute ratio, fits, estimated step; bytes per
    device in one unit); a failed point says its status in the peak column."""
    t_ = targets.get_target(target)
    ok = [r for r in rows if r.get("status") == "ok"]
    unit, name = table_unit([v for r in ok for v in (r.get("peak_bytes"), r.get("activation_bytes"))
                             if v is not None] or [0])  # fmt: skip
    mesh = any(r.get("mesh") for r in rows)
    cols = ("model", "b", "s", *(["mesh"] if mesh else []), "policy", "peak", "residuals",
            "recompute", "fits", "est. step")  # fmt: skip
    points = len({(r["model"], r["batch_size"], r["seq_len"], r.get("mesh")) for r in rows})
    n = f"{_count(points, 'point')}, {_count(len(rows), 'row')}"
    title = (f"{NAME} grid on {t_.name} ({t_.description}): {n}, bytes in "
             f"{name}{' per device' if mesh else ''}")  # fmt: skip
    t = table(title, cols, right=("b", "s", *cols[-5:]), optional=("est. step", "recompute"),
              why="--out's rows have them")  # fmt: skip
    for r in rows:
        head = [r["model"], r["batch_size"], r["seq_len"], *([_mesh(r.get("mesh"))] if mesh
                else []), _policy(r)]  # fmt: skip
        if r.get("status") != "ok":
            add_row(t, *head, Text(str(r.get("status")), style="red"), "", "", "", "")
            continue
        fits = r.get("fits")
        ratio = r.get("recompute_ratio")
        add_row(
            t, *head, in_unit(r["peak_bytes"], unit, 2),
            "-" if r.get("activation_bytes") is None else in_unit(r["activation_bytes"], unit, 2),
            "-" if ratio is None else f"{ratio:.2f}x",
            Text("-" if fits is None else ("yes" if fits else "no"),
                 style="" if fits is None else ("green" if fits else "red")),
            format_seconds(r.get("predicted_step_time_s"), 3),
        )  # fmt: skip
    return t


__all__ = ["build_config", "grid_table", "is_grid", "one_point", "run"]
