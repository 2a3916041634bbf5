"""The ``remat-kit`` command: ``analyze``, ``policies``, ``targets``, ``doctor``, ``recommend``.

Examples::

    remat-kit analyze --model llama3-8b --batch 1 --seq 8192 --target h100-sxm --all-policies
    remat-kit analyze --model tiny-gpt --batch 1 --seq 32 --target h100-sxm \\
        --policy 'query_proj=offload,out_proj=save'
    remat-kit doctor --model tiny-gpt --policy '{"query_proj": "offload"}'
    remat-kit recommend --model llama3-8b --seq 8192 --target h200 --solve

Every ``--policy`` takes one syntax (:func:`remat_kit.policies.parse_policy_arg`): a registered
name, per-tag actions ``query_proj=offload,out_proj=save``, or the JSON form
``{"query_proj": "offload"}``.

Layout: :mod:`remat_kit.cli.args` defines the shared arguments and the parser;
:mod:`remat_kit.cli.console` the rendering helpers; one module per command, each with
``add(subparsers)`` registering its parser with ``func`` set to its handler ``(args) -> exit
code``. Add a command by adding its module to :data:`COMMANDS`. Exit codes: 0 success, 1 a
compile failed (``doctor``: an error finding; ``recommend``: nothing fits), 2 bad input (one
line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence

from remat_kit.cli import analyze, doctor, policies, recommend, targets
from remat_kit.cli.args import PROG as PROG
from remat_kit.cli.args import Parser, resolve_slices
from remat_kit.cli.args import UsageError as UsageError
from remat_kit.cli.args import parse_bytes as parse_bytes
from remat_kit.cli.args import positive_int as positive_int
from remat_kit.validation import MissingExtraError, SeqLenError

#: Subcommand registrars, in help order.
COMMANDS: list[Callable[[argparse._SubParsersAction], object]] = [
    analyze.add,
    policies.add,
    targets.add,
    doctor.add,
    recommend.add,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``remat-kit`` parser with every command of :data:`COMMANDS`."""
    parser = Parser(
        prog=PROG,
        description="Choose, measure and verify rematerialization policies for JAX/Flax "
        "transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 compile failed, 2 bad input)."""
    try:
        given = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(_attach_negative_values(given))
        args.argv = given  # the command, for reports
        resolve_slices(args)
        with _cache_off(getattr(args, "no_cache", False)):
            return args.func(args)
    except (UsageError, ValueError, MissingExtraError) as err:
        if isinstance(err, SeqLenError):  # said in the command line's terms
            err = err.with_how(f"--set max_seq_len={err.seq_len}")
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``--budget -5GiB`` as ``--budget=-5GiB``: argparse reads a value that starts with ``-``
    and is not a plain number as the next option ("expected one argument"), so the bad value
    would never reach the check that names it. A long option followed by ``-`` and a digit
    takes it as its value (no command has a negative positional argument)."""
    out: list[str] = []
    for token in argv:
        prev = out[-1] if out else ""
        if re.match(r"-\d", token) and prev.startswith("--") and "=" not in prev:
            out[-1] = f"{prev}={token}"
        else:
            out.append(token)
    return out


@contextlib.contextmanager
def _cache_off(off: bool) -> Iterator[None]:
    """``--no-cache``: the compile cache's off switch set for the command, then restored."""
    if not off:
        yield
        return
    from remat_kit.memory.compile_cache import ENV_OFF

    before = os.environ.get(ENV_OFF)
    os.environ[ENV_OFF] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_OFF, None)
        else:
            os.environ[ENV_OFF] = before


__all__ = ["COMMANDS", "PROG", "UsageError", "build_parser", "main", "parse_bytes", "positive_int"]
