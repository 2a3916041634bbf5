"""Arguments shared by the ``remat-kit`` commands, and a parser that reports bad input as one
line on stderr with exit code 2 (``type=`` functions wrap the library's parsers:
:func:`arg_type`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from remat_kit import units, validation
from remat_kit.loading import load_program
from remat_kit.policies import POLICY_ARG_HELP as POLICY_ARG_HELP
from remat_kit.policies import parse_policy_arg
from remat_kit.program import Program
from remat_kit.targets import MeshSpec
from remat_kit.zoo import check_preset, preset

PROG = "remat-kit"
T = TypeVar("T")


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def arg_type(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse ``type=`` from a library parser: ``ValueError`` -> ``ArgumentTypeError``."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = name  # argparse names the type in its messages
    return convert


def _positive(text: str) -> int:
    try:
        return validation.parse_positive_int("value", text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None


def _nonnegative(text: str) -> int:
    try:
        return validation.nonnegative_int("value", int(text))
    except ValueError:
        raise ValueError(f"expected 0 or a positive integer, got {text!r}") from None


def _batch_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return validation.parse_positive_int("--batch", text)
    except ValueError:
        raise ValueError(f"--batch takes a positive integer or 'auto', got {text!r}") from None


#: argparse type: a size in bytes (:func:`remat_kit.units.parse_bytes`: 80GiB, 80GB, 8e10).
parse_bytes = arg_type(units.parse_bytes, "size")
#: argparse type: an integer > 0.
positive_int = arg_type(_positive, "positive integer")
#: argparse type: an integer >= 0.
nonnegative_int = arg_type(_nonnegative, "count")
#: argparse type: a positive integer or ``auto``.
batch_or_auto = arg_type(_batch_or_auto, "batch")
#: argparse type: one ``--policy`` value (:func:`remat_kit.policies.parse_policy_arg`).
policy_arg = arg_type(parse_policy_arg, "policy")


def _target(text: str) -> str:
    """``text`` if it names a compile target (:func:`remat_kit.targets.get_target`)."""
    from remat_kit import targets

    targets.get_target(text)
    return text


#: argparse type: a compile target's name, checked.
target_name = arg_type(_target, "target")


def add_model(
    p: argparse.ArgumentParser, example: str = "llama3-8b", *, several: bool = False
) -> None:
    """``--model`` (a preset, or ``MODULE:FACTORY`` / ``FILE.py:FACTORY``) and ``--set
    FIELD=VALUE``; ``several``: repeatable (:data:`SEVERAL`)."""
    p.add_argument(
        "--model",
        required=True,
        help=f"a model preset (e.g. {example}; see remat_kit.preset_names()) or your own "
        "program: MODULE:FACTORY or FILE.py:FACTORY, a function of no arguments returning a "
        "remat_kit.Program" + (SEVERAL if several else ""),
        **({"action": "append"} if several else {}),
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
        help="change a field of the preset (repeatable; a wrong name lists them), "
        "e.g. --set num_layers=4",
    )  # fmt: skip


def add_maxtext(p: argparse.ArgumentParser) -> None:
    """``--maxtext "KEY=VALUE ..."``: MaxText's step (:func:`remat_kit.maxtext.maxtext_program`)."""
    for action in p._actions:  # --model is then one of the two ways to name the program
        if action.dest == "model":
            action.required = False
    p.add_argument(
        "--maxtext", default=None, metavar="OVERRIDES",
        help="instead of --model: MaxText's training step for its base.yml plus these "
        "overrides, one string as its command line takes them (e.g. \"model_name=llama2-7b "
        "per_device_batch_size=1 max_target_length=8192\"), on MaxText's mesh of the target's "
        "chips; needs pip install 'remat-kit[maxtext]' (Python >= 3.12)",
    )  # fmt: skip


def read_maxtext(args: argparse.Namespace, preset_only: Mapping[str, Any] | None = None):
    """The program ``--maxtext`` names, for ``args.target``.

    Raises:
      UsageError: ``--model`` given too; a preset's flag given (one line saying which).
      ValueError: MaxText refusing the overrides. MissingExtraError: MaxText not installed.
    """
    if args.model is not None:
        raise UsageError("give --model or --maxtext, not both")
    given = [f"--{f}" for f in ("batch", "seq") if getattr(args, f, None) is not None]
    given += [f for f, v in (preset_only or {}).items() if v not in (None, False)]
    if getattr(args, "overrides", None):
        given.append("--set")
    if given:
        raise UsageError(
            f"{' and '.join(given)} apply to presets; with --maxtext set shapes as MaxText "
            "overrides (per_device_batch_size=..., max_target_length=...)"
        )
    from remat_kit.maxtext import maxtext_program

    return maxtext_program(args.maxtext, getattr(args, "target", "local"))


def maxtext_policies(program: Any) -> list[Any]:
    """``recommend --maxtext``'s default policies (:func:`remat_kit.maxtext.maxtext_candidates`)."""
    from remat_kit.maxtext import maxtext_candidates
    from remat_kit.memory.policy_set import program_tags

    return maxtext_candidates(program_tags(program))


def is_program_ref(model: str | None) -> bool:
    """True unless ``--model`` names a preset (None: ``--maxtext`` names the program); a
    ``FILE.py`` without its factory is a program reference too (its error lists them)."""
    return model is None or ":" in model or model.endswith(".py")


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["d_model=128", "norm=rmsnorm"]`` -> ``{"d_model": 128, "norm": "rmsnorm"}`` (values
    read as JSON where they parse, else strings; checked by :func:`remat_kit.preset`).

    Raises:
      ValueError: an item without ``=`` or without a field name.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set takes FIELD=VALUE (a model field), got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def preset_changes(args: argparse.Namespace, **fixed: Any) -> dict[str, Any]:
    """The model fields ``--set`` changes, with ``fixed`` fields.

    Raises:
      ValueError: a ``--set`` item without ``=`` or a field name.
    """
    return {**parse_overrides(args.overrides), **fixed}


def unknown_preset(err: ValueError) -> ValueError:
    """``err``, an unknown preset's, also saying how to give a program instead."""
    if str(err).startswith("unknown preset"):
        return ValueError(f"{err} For your own model give MODULE:FACTORY or FILE.py:FACTORY.")
    return err


def read_program(
    args: argparse.Namespace,
    *,
    needed: tuple[str, ...] = ("batch", "seq"),
    mesh: MeshSpec | None = None,
    preset_only: Mapping[str, Any] | None = None,
    **fixed: Any,
) -> Program:
    """The :class:`~remat_kit.program.Program` ``--model`` names: the user's (loaded) or a
    preset's (:func:`remat_kit.preset` with ``--set``, ``fixed``, ``--batch``, ``--seq``,
    ``--optimizer``, ``mesh``).

    Args:
      needed: which of ``--batch`` / ``--seq`` a preset requires.
      preset_only: preset-only flags -> values (``{"--per-layer": args.per_layer}``).

    Raises:
      UsageError: a preset's flag given with a program, or a preset missing one of ``needed``.
      ValueError: an unknown preset, a program that cannot be loaded, shapes the preset refuses.
    """
    if getattr(args, "maxtext", None) is not None:
        return read_maxtext(args, preset_only)
    if args.model is None:
        raise UsageError("one of --model or --maxtext is required")
    if is_program_ref(args.model):
        given = [f"--{f}" for f in ("batch", "seq") if getattr(args, f, None) not in (None, "auto")]
        given += [f for f, v in (preset_only or {}).items() if v not in (None, False)]
        if args.overrides:
            given.append("--set")
        if given:  # refused before the program is loaded and built (seconds to minutes)
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(
                f"{' and '.join(given)} {verb} to presets; program {args.model!r} carries its "
                "own arguments, layers and sharding (set shapes in its factory; shard inside "
                "its step, e.g. jax.jit with in_shardings over a jax.sharding.Mesh)"
            )
        return load_program(args.model)
    changes = preset_changes(args, **fixed)
    try:
        check_preset(args.model, **changes)  # the preset and its fields before the flags
    except ValueError as err:
        raise unknown_preset(err) from None
    missing = [f"--{f}" for f in needed if getattr(args, f, None) is None]
    if missing:
        raise UsageError(f"the following arguments are required for a preset: {', '.join(missing)}")
    optimizer = getattr(args, "optimizer", None) or "adamw"
    return preset(args.model, args.batch, args.seq, optimizer, mesh, **changes)


def _for_presets(preset_default: int | None) -> str:
    return "required for them" if preset_default is None else f"default {preset_default}"


#: Help text of a repeatable grid axis (``several=True``).
SEVERAL = "; repeat for a grid of points (see --out)"


def add_batch(
    p: argparse.ArgumentParser, preset_default: int | None = None, *, several: bool = False
) -> None:
    """``--batch`` (presets); ``preset_default`` None: required; ``several``: repeatable."""
    what = f"sequences per step (presets; {_for_presets(preset_default)})"
    p.add_argument("--batch", type=positive_int, default=None, help=what + (SEVERAL if several
                   else ""), **({"action": "append"} if several else {}))  # fmt: skip


def add_seq(
    p: argparse.ArgumentParser, preset_default: int | None = None, *, several: bool = False
) -> None:
    """``--seq`` (presets); as :func:`add_batch`."""
    what = f"tokens per sequence (presets; {_for_presets(preset_default)})"
    p.add_argument("--seq", type=positive_int, default=None, help=what + (SEVERAL if several
                   else ""), **({"action": "append"} if several else {}))  # fmt: skip


def add_target(p: argparse.ArgumentParser, default: str) -> None:
    """``--target``, and ``--slices K`` (folded in by :func:`resolve_slices`)."""
    p.add_argument(
        "--target",
        type=target_name,
        default=default,
        help=f"compile target (see `remat-kit targets`; default {default})",
    )
    p.add_argument(
        "--slices", type=positive_int, default=None,
        help="TPU targets: this many slices joined over the data-center network (multi-slice)",
    )  # fmt: skip


def resolve_slices(args: argparse.Namespace) -> None:
    """Fold ``--slices K`` into ``args.target`` (``v5p-8`` -> ``2xv5p-8``).

    Raises:
      UsageError: ``--slices`` on a target that is not a TPU slice.
    """
    slices = getattr(args, "slices", None)
    if slices is None or slices == 1 or not hasattr(args, "target"):
        return
    from remat_kit import targets

    target = targets.get_target(args.target)
    if target.tpu is None:
        raise UsageError(
            f"--slices applies to TPU slices (v5p-8, v6e-256, ...), not {target.name!r}"
        )
    base = target.name.split("x", 1)[1] if target.tpu.num_slices > 1 else target.name
    args.target = f"{slices}x{base}"


def add_policy(p: argparse.ArgumentParser, what: str) -> None:
    """``--policy`` (repeatable), parsed by :func:`remat_kit.policies.parse_policy_arg`."""
    p.add_argument(
        "--policy", action="append", type=policy_arg, default=None, metavar="POLICY",
        help=f"{what} (repeat for several): {POLICY_ARG_HELP}",
    )  # fmt: skip


def add_optimizer(p: argparse.ArgumentParser, default: str | None = "adamw") -> None:
    """``--optimizer``: adamw, sgd or adafactor (None: adamw for a preset, and a program's
    own optimizer can be told from one given)."""
    p.add_argument(
        "--optimizer", default=default, help="adamw, sgd or adafactor (presets; default adamw)"
    )


def add_budget(p: argparse.ArgumentParser, default: str) -> None:
    """``--budget``: bytes per device, parsed by :func:`remat_kit.units.parse_bytes`."""
    p.add_argument(
        "--budget", type=parse_bytes, default=None,
        help=f"per-device memory budget (80GiB, 80GB, 8e10); default: {default}",
    )  # fmt: skip


def add_workers(p: argparse.ArgumentParser) -> None:
    """``--workers``: concurrent compiles; ``--no-cache``: compile without the compile cache."""
    p.add_argument(
        "--workers", type=positive_int, default=None,
        help="concurrent compiles (default one per core, at most 4)",
    )  # fmt: skip
    add_no_cache(p)


def add_no_cache(p: argparse.ArgumentParser) -> None:
    """``--no-cache``: neither read nor write the persistent compile cache
    (:mod:`remat_kit.memory.compile_cache`; the same as ``REMAT_KIT_NO_CACHE=1``)."""
    p.add_argument(
        "--no-cache", action="store_true",
        help="compile everything, neither reading nor writing the compile cache "
        "(~/.cache/remat-kit or $REMAT_KIT_CACHE_DIR; also REMAT_KIT_NO_CACHE=1)",
    )  # fmt: skip


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--json``: machine-readable output (never through rich, so never wrapped)."""
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def add_timeline(parser: argparse.ArgumentParser) -> None:
    """Add ``--timeline PATH`` (a PNG of the live-bytes timeline of every analysed policy, one
    panel each: :func:`remat_kit.plots.timeline`) to a command's parser."""
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        default=None,
        help="write the live device bytes over XLA's schedule of each policy (stacked by "
        "parameters, optimizer state, residuals by tag, gradients, logits, temporaries; phases "
        "and the peak marked) as a PNG",
    )


def add_html(parser: argparse.ArgumentParser) -> None:
    """Add ``--html PATH``: the interactive report (:mod:`remat_kit.report_html`), one
    self-contained HTML file that works offline."""
    parser.add_argument(
        "--html",
        metavar="PATH",
        default=None,
        help="write an interactive report (one self-contained HTML file, works offline): "
        "sortable policy table, memory vs time, each policy's live-bytes timeline with the "
        "buffers live at each point, two policies side by side",
    )


def command_line(args: argparse.Namespace) -> str:
    """The command as a user would type it (``remat-kit analyze --model ...``), for the top of a
    report: ``args.argv`` (set by :func:`remat_kit.cli.main`)."""
    import shlex

    return " ".join([PROG, *(shlex.quote(a) for a in getattr(args, "argv", []))])


def check_output_path(path: str | None, flag: str) -> None:
    """A file the command will write at its end can be written, checked before compiling.

    Raises:
      UsageError: ``path`` is a folder, or its folder exists and is not writable.
    """
    import os

    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a folder; give a file name (report.html)")
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path!r}: cannot write in {folder!r}")


def _shard(text: str) -> Any:
    """``I/N`` as a :class:`~remat_kit.sweep.shard.Shard` (imported when a shard is given: the
    sweep's modules are not loaded to build the parser)."""
    from remat_kit.sweep.shard import parse_shard

    return parse_shard(text)


def add_grid(p: argparse.ArgumentParser) -> None:
    """The flags that run a grid of points as tasks (:mod:`remat_kit.sweep`): ``--out`` (the
    JSONL of rows), ``--resume`` / ``--overwrite``, ``--grid-workers`` (CPU worker
    processes), ``--engine`` / ``--address``, ``--shard I/N`` and ``--merge``."""
    g = p.add_argument_group(
        "grids",
        "several --model / --batch / --seq / --mesh values make a grid: each point (model x "
        "batch x seq x mesh, all its policies) one task, its rows appended to --out as it "
        "finishes, one table at the end",
    )
    g.add_argument(
        "--out", metavar="PATH.jsonl", default=None,
        help="write the grid's rows (one JSON line per point and policy) here, even for one "
        "point; needed by --resume, --shard and --merge (default: kept only for the table)",
    )  # fmt: skip
    g.add_argument("--resume", action="store_true", help="keep the rows --out has, run the rest")
    g.add_argument("--overwrite", action="store_true", help="empty --out first")
    g.add_argument(
        "--grid-workers", type=positive_int, default=1, metavar="N",
        help="worker processes analysing the grid's points side by side (JAX_PLATFORMS=cpu: "
        "deviceless targets and the local CPU; default 1: this process). Unlike --workers "
        "(concurrent compiles within one point)",
    )  # fmt: skip
    g.add_argument(
        "--engine", default="local", metavar="{local,ray}",
        help="what runs the points: local (this machine, --grid-workers processes) or ray "
        "(Ray tasks of one CPU each; pip install 'remat-kit[ray]')",
    )  # fmt: skip
    g.add_argument(
        "--address", default=None,
        help="--engine ray: the Ray cluster (default: $RAY_ADDRESS, else a local Ray instance)",
    )  # fmt: skip
    g.add_argument(
        "--shard", type=arg_type(_shard, "shard"), metavar="I/N",
        help="run part I of N of the points into its own part file beside --out "
        "(NAME.part-I-of-N.jsonl; a SLURM array: $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)",
    )  # fmt: skip
    g.add_argument(
        "--merge", nargs="*", metavar="PART", default=None,
        help="join the part files (default: every NAME.part-I-of-N.jsonl beside --out) into "
        "--out and print the grid's table",
    )  # fmt: skip
