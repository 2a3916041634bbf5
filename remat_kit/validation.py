"""Leaf validation helpers: one wording per kind of bad input.

Imports nothing from remat_kit. Every check raises a one-line ``ValueError`` that names the bad
value and what is valid; the CLI turns ``ValueError`` into exit code 2.

Example::

    >>> positive_int("batch_size", 4)
    4
    >>> closest("save-dot", ["save-dots", "save-nothing"])
    'save-dots'
"""

from __future__ import annotations

import difflib
import numbers
import os
from collections.abc import Iterable


class MissingExtraError(RuntimeError):
    """A target needs an optional dependency that is not installed: JAX's CUDA plugin for a GPU
    model (``pip install 'remat-kit[cuda12]'``), libtpu for a TPU slice (``[tpu]``). The message
    names the extra; the command line prints it in one line and exits 2."""


def closest(name: str, valid: Iterable[str]) -> str | None:
    """The closest valid string to ``name``: a near-exact one (difflib ratio >= 0.85: a dropped
    or doubled character), else a valid one that ``name`` extends or abbreviates
    (``mlpwi_typo`` -> ``mlpwi``; the longest such), else the best difflib ratio >= 0.5, or None.

    >>> closest("mlpwi_typo", ["mlpwo", "mlpwi", "mlpwi_0"])
    'mlpwi'
    >>> closest("save-dots-nobatch", ["save-dots", "save-dots-no-batch"])
    'save-dots-no-batch'
    """
    valid = list(valid)
    near = difflib.get_close_matches(name, valid, n=1, cutoff=0.85)
    if near:
        return near[0]
    nested = [v for v in valid if v and (name.startswith(v) or v.startswith(name))]
    if name and nested:
        return max(nested, key=lambda v: (len(os.path.commonprefix([v, name])), -len(v)))
    matches = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_value_error(
    kind: str, value: object, valid: Iterable[str], meant: str | None = None
) -> ValueError:
    """A one-line ``ValueError`` naming the bad value, the valid ones and the closest match.

    Args:
      kind: what the value names, e.g. ``"policy"`` or ``"checkpoint name"``.
      value: the value given.
      valid: the accepted values, in the order to print them.
      meant: what the value is known to mean, said instead of the closest spelling (another
        tool's name for a valid value: MaxText's ``save_dot_except_mlp``).
    """
    valid = list(valid)
    hint = closest(str(value), valid) if isinstance(value, str) and meant is None else None
    did_you_mean = f" {meant}" if meant else f" Did you mean {hint!r}?" if hint else ""
    return ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}.{did_you_mean}")


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1 (bool excluded).

    Raises:
      ValueError: ``"{name} must be a positive integer, got {value!r}"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def nonnegative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 0 (bool excluded): a count that may be zero,
    such as warm-up steps.

    Raises:
      ValueError: ``"{name} must be 0 or a positive integer, got {value!r}"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be 0 or a positive integer, got {value!r}")
    return int(value)


def parse_positive_int(name: str, text: str) -> int:
    """An integer >= 1 from text (a command-line value).

    Raises:
      ValueError: not an integer, or < 1 (same wording as :func:`positive_int`).
    """
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {text!r}") from None
    return positive_int(name, value)


class SeqLenError(ValueError):
    """A sequence longer than a model's ``max_seq_len`` (its learned positions table). The
    message says how to raise the limit in the caller's terms (``how``): a front end that
    knows its own (``--set max_seq_len=4096`` on the command line) says it with
    :meth:`with_how`.

    Attributes:
      seq_len: the sequence length asked for.
      max_seq_len: the model's limit.
      model: the model's name, when known.
    """

    def __init__(self, seq_len: int, max_seq_len: int, model: str | None = None,
                 how: str | None = None):  # fmt: skip
        self.seq_len, self.max_seq_len, self.model = seq_len, max_seq_len, model
        if how is None:  # the Python API's way
            name = f'"{model}", ' if model else ""
            how = f"get_config({name}max_seq_len={seq_len})"
        of = f" of {model!r}" if model else ""
        super().__init__(
            f"seq_len={seq_len} exceeds max_seq_len={max_seq_len}{of}; use a shorter sequence or "
            f"raise max_seq_len: {how}"
        )

    def with_how(self, how: str) -> SeqLenError:
        """The same error, saying ``how`` to raise the limit."""
        return SeqLenError(self.seq_len, self.max_seq_len, self.model, how)


def check_seq_len(
    seq_len: int, max_seq_len: int, model: str | None = None, how: str | None = None
) -> int:
    """Return ``seq_len`` if it is a positive integer no longer than ``max_seq_len``.

    Args:
      seq_len: tokens per sequence.
      max_seq_len: the model's limit.
      model: the model's name, for the message.
      how: how to raise ``max_seq_len`` where the caller's user set it (default: the Python
        API's ``get_config(model, max_seq_len=N)``).

    Raises:
      ValueError: ``seq_len`` is not a positive integer; :class:`SeqLenError` (a ValueError)
        when it exceeds ``max_seq_len``, saying how to raise it.
    """
    positive_int("seq_len", seq_len)
    if seq_len > max_seq_len:
        raise SeqLenError(seq_len, max_seq_len, model, how)
    return seq_len


def check_batch_split(
    batch_size: int, split: int, *, micro_batches: int = 1, mesh: str = ""
) -> int:
    """Return ``batch_size`` if each micro-batch splits evenly over ``split`` = dp*fsdp devices.

    Args:
      batch_size: global batch (sequences per step).
      split: product of the mesh's batch axes (dp * fsdp).
      micro_batches: gradient-accumulation micro-batches per step.
      mesh: the mesh's text form, for the message.

    Raises:
      ValueError: ``batch_size / micro_batches`` is not an integer multiple of ``split``.
    """
    positive_int("batch_size", batch_size)
    positive_int("micro_batches", micro_batches)
    if batch_size % micro_batches or (batch_size // micro_batches) % split:
        per = ""
        if micro_batches > 1:
            per = f" ({micro_batches} micro-batches of {batch_size / micro_batches:g})"
        of = f" of mesh {mesh}" if mesh else ""
        raise ValueError(
            f"batch_size={batch_size}{per} does not split evenly over dp*fsdp={split} devices{of}; "
            f"use a multiple of {split * micro_batches} or another mesh"
        )
    return batch_size
