"""Arguments shared by the ``remat-kit`` commands, defined once, and the parser that turns bad
input into one line on stderr with exit code 2.

argparse ``type=`` functions wrap the library's own parsers (:mod:`remat_kit.units`,
:mod:`remat_kit.validation`, :func:`remat_kit.policies.parse_policy_arg`): a ``ValueError``
becomes ``argparse.ArgumentTypeError`` with the library's one-line message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from remat_kit import units, validation
from remat_kit.models.config import ModelConfig
from remat_kit.policies import POLICY_ARG_HELP as POLICY_ARG_HELP
from remat_kit.policies import parse_policy_arg
from remat_kit.sharding import MeshSpec

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
#: argparse type: a positive integer or ``auto``.
batch_or_auto = arg_type(_batch_or_auto, "batch")
#: argparse type: one ``--policy`` value (:func:`remat_kit.policies.parse_policy_arg`).
policy_arg = arg_type(parse_policy_arg, "policy")


def add_model(p: argparse.ArgumentParser, example: str = "llama3-8b") -> None:
    """``--model``: a preset name (required)."""
    p.add_argument("--model", required=True, help=f"model preset, e.g. {example}")


def add_batch(p: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--batch``: sequences per step (required unless ``default`` is given)."""
    kw: dict[str, Any] = {"required": True} if default is None else {"default": default}
    p.add_argument("--batch", type=positive_int, help="sequences per step", **kw)


def add_seq(p: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--seq``: tokens per sequence (required unless ``default`` is given)."""
    kw: dict[str, Any] = {"required": True} if default is None else {"default": default}
    p.add_argument("--seq", type=positive_int, help="tokens per sequence", **kw)


def add_target(p: argparse.ArgumentParser, default: str) -> None:
    """``--target``: a compile target name."""
    p.add_argument(
        "--target",
        default=default,
        help=f"compile target (see `remat-kit targets`; default {default})",
    )


def add_policy(p: argparse.ArgumentParser, what: str) -> None:
    """``--policy`` (repeatable), parsed by :func:`remat_kit.policies.parse_policy_arg`."""
    p.add_argument(
        "--policy", action="append", type=policy_arg, default=None, metavar="POLICY",
        help=f"{what} (repeat for several): {POLICY_ARG_HELP}",
    )  # fmt: skip


def add_optimizer(p: argparse.ArgumentParser) -> None:
    """``--optimizer``: adamw, sgd or adafactor."""
    p.add_argument("--optimizer", default="adamw", help="adamw, sgd or adafactor")


def add_budget(p: argparse.ArgumentParser, default: str) -> None:
    """``--budget``: bytes per device, parsed by :func:`remat_kit.units.parse_bytes`."""
    p.add_argument(
        "--budget", type=parse_bytes, default=None,
        help=f"per-device memory budget (80GiB, 80GB, 8e10); default: {default}",
    )  # fmt: skip


def add_workers(p: argparse.ArgumentParser) -> None:
    """``--workers``: concurrent compiles."""
    p.add_argument("--workers", type=positive_int, default=None, help="concurrent compiles")


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--json``: machine-readable output (never through rich, so never wrapped)."""
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def check_shape(config: ModelConfig, batch: int, seq: int, mesh: MeshSpec | None = None) -> None:
    """``--seq`` within the model's ``max_seq_len`` and ``--batch`` split evenly over the mesh's
    dp*fsdp devices (:mod:`remat_kit.validation`'s wording).

    Raises:
      ValueError: either check fails.
    """
    validation.check_seq_len(seq, config.max_seq_len, config.name)
    if mesh is not None:
        validation.check_batch_split(batch, mesh.dp * mesh.fsdp, mesh=str(mesh))
