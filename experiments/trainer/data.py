"""Real-text input pipeline: byte-level tokens, a deterministic split and resumable batches.

The default corpus is the Python standard library's own ``.py`` source; any text file or folder
can be used instead. Tokens are raw UTF-8 bytes (:data:`VOCAB_SIZE` = 256, no tokenizer). The
files, in sorted path order, form one token stream whose last ``val_fraction`` is the
validation split (a contiguous tail: no token in both splits). :meth:`Batcher.batch_at` is a
pure function of ``(seed, step)``, so a run resumed at step ``k`` gets bitwise the same batches;
:meth:`Corpus.val_batches` walks the validation split in order. Which files, and why a tail
split: docs/training.md ("The corpus").

Example (``load_corpus()`` reads the stdlib, first 8 MiB; here its first 64 KiB)::

    >>> corpus = load_corpus(max_bytes=2**16)
    >>> batcher = corpus.batcher(batch_size=8, seq_len=256, seed=0)
    >>> inputs, targets = batcher.batch_at(0)
    >>> inputs.shape, inputs.dtype.name  # [batch, seq]
    ((8, 256), 'int32')
    >>> bool((inputs[:, 1:] == targets[:, :-1]).all())  # targets are inputs shifted by one
    True
    >>> len(list(corpus.val_batches(2, 256, max_batches=4)))
    4
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remat_kit.validation import positive_int

__all__ = [
    "DEFAULT_STDLIB_MAX_BYTES",
    "VOCAB_SIZE",
    "Batcher",
    "Corpus",
    "load_corpus",
    "sequential_batches",
]

VOCAB_SIZE = 256
"""Number of distinct tokens: one per byte value."""

DEFAULT_STDLIB_MAX_BYTES = 8 * 2**20
"""Default cap on the stdlib corpus, in bytes (8 MiB; loads in well under a second)."""

_SNIFF_BYTES = 8192  # how much of each file is checked for NUL bytes / invalid UTF-8
_FINGERPRINT_CHARS = 16  # hex characters of the sha256 kept in Corpus.fingerprint
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)

Batch = tuple[np.ndarray, np.ndarray]  # (inputs, targets), each int32 [batch, seq]


@dataclass(frozen=True, eq=False)
class Corpus:
    """A byte-level corpus split into train and validation token streams.

    Attributes:
        train: uint8 tokens of shape ``(num_train,)``, read-only; the head of the stream.
        val: uint8 tokens of shape ``(num_val,)``, read-only; the last ``val_fraction`` of it.
        source: where the text came from: ``"stdlib:<dir>"`` or the resolved user path.
        num_files: number of files that contributed bytes (the last one may be truncated).
        num_bytes: total bytes read, ``num_train + num_val``.
        val_fraction: fraction of the stream held out for validation.
        fingerprint: first 16 hex characters of the sha256 of all ``num_bytes`` bytes (before
            the split), so a results row can record exactly which data it used.
    """

    train: np.ndarray
    val: np.ndarray
    source: str
    num_files: int
    num_bytes: int
    val_fraction: float
    fingerprint: str

    @property
    def description(self) -> str:
        """One line for logs: source, files, bytes, split sizes and fingerprint."""
        return (
            f"{self.source} ({self.num_files} files, {self.num_bytes} bytes, "
            f"train {self.train.size} / val {self.val.size} tokens, sha256 {self.fingerprint})"
        )

    def info(self) -> dict[str, Any]:
        """JSON-ready metadata to store in a results row (no token arrays)."""
        return {
            "data_source": self.source,
            "data_num_files": self.num_files,
            "data_num_bytes": self.num_bytes,
            "data_val_fraction": self.val_fraction,
            "data_train_tokens": int(self.train.size),
            "data_val_tokens": int(self.val.size),
            "data_fingerprint": self.fingerprint,
        }

    def batcher(self, batch_size: int, seq_len: int, seed: int = 0) -> Batcher:
        """A :class:`Batcher` over the training split; see there for shapes and errors."""
        return Batcher(self.train, batch_size, seq_len, seed)

    def val_batches(
        self, batch_size: int, seq_len: int, max_batches: int | None = None
    ) -> Iterator[Batch]:
        """Sequential batches over the validation split; see :func:`sequential_batches`."""
        return sequential_batches(self.val, batch_size, seq_len, max_batches)


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    max_bytes: int | None = None,
    val_fraction: float = 0.05,
) -> Corpus:
    """Read a text corpus as byte tokens and split it into train and validation.

    Args:
        path: ``None`` for the Python standard library's ``.py`` files; a UTF-8 text file; or a
            folder, read recursively in sorted relative-path order (hidden files and folders are
            skipped, and so are binary files, judged on their first 8192 bytes).
        max_bytes: cap on the total bytes read, in bytes; the last file read is truncated to fit.
            ``None`` means :data:`DEFAULT_STDLIB_MAX_BYTES` for the stdlib and no cap for a path.
        val_fraction: fraction of the token stream, taken from its end, used for validation;
            ``0 <= val_fraction < 1``. The validation size is ``ceil(num_bytes * val_fraction)``.

    Returns:
        A :class:`Corpus` with uint8 ``train`` and ``val`` token arrays.

    Raises:
        ValueError: the path does not exist; a file or folder holds no text (empty, or every
            file binary); a file given directly is binary (NUL bytes or invalid UTF-8 in its first
            8192 bytes); ``max_bytes < 1``; ``val_fraction`` outside ``[0, 1)``; or the training
            split would be empty.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")

    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"]).resolve()
        source = f"stdlib:{root}"
        files = _list_files(root, stdlib=True)
        cap = DEFAULT_STDLIB_MAX_BYTES if max_bytes is None else max_bytes
        strict = False
    else:
        root = Path(path).expanduser().resolve()
        source = str(root)
        if root.is_file():
            files = [root]
            strict = True
        elif root.is_dir():
            files = _list_files(root, stdlib=False)
            strict = False
        else:
            raise ValueError(
                f"corpus path {str(path)!r} does not exist (or is not a file or folder); "
                "pass a UTF-8 text file or a folder of them, or no path (no --data) for the "
                "Python stdlib"
            )
        cap = max_bytes

    chunks, num_files = _read_files(files, cap, strict=strict)
    data = b"".join(chunks)
    if not data:
        what = "file" if strict else "folder"
        raise ValueError(f"corpus {what} {source!r} holds no text (empty or only binary files)")

    tokens = np.frombuffer(data, dtype=np.uint8)  # read-only view of the bytes, [num_bytes]
    num_val = int(np.ceil(tokens.size * val_fraction))
    num_train = tokens.size - num_val
    if num_train < 1:
        raise ValueError(
            f"corpus {source!r} has {tokens.size} bytes: too few to hold out "
            f"val_fraction={val_fraction} and keep any training tokens"
        )
    return Corpus(
        train=tokens[:num_train],
        val=tokens[num_train:],
        source=source,
        num_files=num_files,
        num_bytes=int(tokens.size),
        val_fraction=float(val_fraction),
        fingerprint=hashlib.sha256(data).hexdigest()[:_FINGERPRINT_CHARS],
    )


def _list_files(root: Path, *, stdlib: bool) -> list[Path]:
    """Files under ``root`` in sorted relative-path order (deterministic across file systems)."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if not d.startswith(".") and not (stdlib and d in _STDLIB_SKIP_DIRS)
        ]
        for name in filenames:
            if name.startswith(".") or (stdlib and not name.endswith(".py")):
                continue
            full = Path(dirpath, name)
            if full.is_file():
                found.append((full.relative_to(root).as_posix(), full))
    found.sort()
    return [full for _, full in found]


def _is_binary(head: bytes, whole_file: bool) -> bool:
    """True if ``head`` (a file's first bytes) has a NUL byte or is not valid UTF-8."""
    if b"\0" in head:
        return True
    try:
        # Incremental decoder: a multi-byte character cut at the sniff boundary is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=whole_file)
    except UnicodeDecodeError:
        return True
    return False


def _read_files(files: list[Path], cap: int | None, *, strict: bool) -> tuple[list[bytes], int]:
    """Read ``files`` until ``cap`` bytes; skip binary files, or raise if ``strict``."""
    chunks: list[bytes] = []
    remaining = cap
    for file in files:
        if remaining is not None and remaining <= 0:
            break
        with open(file, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            if _is_binary(head, whole_file=len(head) < _SNIFF_BYTES):
                if strict:
                    raise ValueError(
                        f"corpus file {str(file)!r} is binary (NUL bytes or invalid UTF-8 in its "
                        f"first {_SNIFF_BYTES} bytes); pass a UTF-8 text file"
                    )
                continue
            rest = f.read() if remaining is None else f.read(max(remaining - len(head), 0))
        data = head + rest
        if remaining is not None:
            data = data[:remaining]
            remaining -= len(data)
        if data:
            chunks.append(data)
    return chunks, len(chunks)


def _check_sizes(tokens: np.ndarray, batch_size: int, seq_len: int, what: str) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"{what} tokens must be 1-D [num_tokens], got shape {tokens.shape}")
    positive_int("batch_size", batch_size)
    positive_int("seq_len", seq_len)
    if tokens.size < seq_len + 1:
        raise ValueError(
            f"{what} tokens are too short: {tokens.size} tokens, need at least "
            f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len or a larger corpus"
        )


class Batcher:
    """Deterministic, resumable random batches of next-token-prediction windows.

    Each row is a window of ``seq_len + 1`` consecutive tokens starting at a uniformly random
    offset; ``inputs`` are its first ``seq_len`` tokens and ``targets`` its last ``seq_len``
    (``targets[:, t] == inputs[:, t + 1]``). Offsets for step ``s`` are drawn from
    ``np.random.default_rng((seed, s))``, so :meth:`batch_at` is a pure function of the step and
    resuming needs only the step (stored in :attr:`state`). Iterating yields ``batch_at(step)``
    and advances ``step``.

    Args:
        tokens: 1-D integer tokens of shape ``(num_tokens,)``, e.g. ``Corpus.train``.
        batch_size: rows per batch.
        seq_len: tokens per row.
        seed: non-negative integer seed.
        step: the step the iterator starts at (0 for a fresh run).

    Raises:
        ValueError: ``tokens`` is not 1-D or has fewer than ``seq_len + 1`` tokens;
            ``batch_size`` or ``seq_len`` is below 1; ``seed`` or ``step`` is negative.
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, step: int = 0
    ) -> None:
        tokens = np.asarray(tokens)
        _check_sizes(tokens, batch_size, seq_len, "training")
        if seed < 0 or step < 0:
            raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
        self.tokens = tokens
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.step = int(step)
        self._offsets = np.arange(self.seq_len + 1)  # [seq + 1]

    def batch_at(self, step: int) -> Batch:
        """The batch for ``step``: ``(inputs, targets)``, each int32 of shape [batch, seq].

        Depends only on the tokens, ``seed``, ``batch_size``, ``seq_len`` and ``step``; it does
        not read or change ``self.step``. Raises ValueError for a negative step.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng((self.seed, int(step)))
        # Start offsets such that start + seq_len is a valid index.
        starts = rng.integers(0, self.tokens.size - self.seq_len, size=self.batch_size)  # [batch]
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int32)  # [batch, seq+1]
        inputs = np.ascontiguousarray(windows[:, :-1])  # [batch, seq]
        targets = np.ascontiguousarray(windows[:, 1:])  # [batch, seq]
        return inputs, targets

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    @property
    def state(self) -> dict[str, int]:
        """JSON-ready state: the next step plus the settings that determine the batches."""
        return {
            "step": self.step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": int(self.tokens.size),
        }

    @classmethod
    def from_state(cls, tokens: np.ndarray, state: dict[str, int]) -> Batcher:
        """Rebuild a batcher from :attr:`state`; the next batch is ``batch_at(state["step"])``.

        Raises ValueError if ``tokens`` has a different length than the state was saved with
        (a sign of a different corpus, cap or split).
        """
        tokens = np.asarray(tokens)
        if tokens.size != state["num_tokens"]:
            raise ValueError(
                f"Batcher state was saved for {state['num_tokens']} tokens but got {tokens.size}; "
                "resume with the same corpus, max_bytes and val_fraction"
            )
        return cls(tokens, state["batch_size"], state["seq_len"], state["seed"], state["step"])


def sequential_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> Iterator[Batch]:
    """Walk ``tokens`` in order as non-overlapping windows, for evaluation.

    Window ``i`` covers tokens ``[i * seq_len, (i + 1) * seq_len]`` (inclusive: ``seq_len + 1``
    tokens, so consecutive windows share one boundary token). Windows fill batches row by row; a
    final incomplete batch is dropped so every batch has the same shape.

    Args:
        tokens: 1-D integer tokens of shape ``(num_tokens,)``, e.g. ``Corpus.val``.
        batch_size: rows per batch.
        seq_len: tokens per row.
        max_batches: stop after this many batches (``None``: all full batches); >= 0.

    Yields:
        ``(inputs, targets)``, each int32 of shape [batch, seq], ``targets`` shifted by one.

    Raises:
        ValueError: when called, not lazily: ``tokens`` is not 1-D or too short for even one
            full batch (``batch_size * seq_len + 1`` tokens); ``batch_size`` or ``seq_len``
            below 1; ``max_batches`` negative.
    """
    tokens = np.asarray(tokens)
    _check_sizes(tokens, batch_size, seq_len, "validation")
    num_batches = (tokens.size - 1) // seq_len // batch_size
    if num_batches == 0:
        raise ValueError(
            f"validation tokens are too short: {tokens.size} tokens, need at least "
            f"batch_size * seq_len + 1 = {batch_size * seq_len + 1} for one batch; "
            "use a smaller batch_size or seq_len, or a larger val_fraction"
        )
    if max_batches is not None:
        if max_batches < 0:
            raise ValueError(f"max_batches must be >= 0 or None, got {max_batches}")
        num_batches = min(num_batches, max_batches)
    return _sequential(tokens, batch_size, seq_len, num_batches)


def _sequential(
    tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int
) -> Iterator[Batch]:
    offsets = np.arange(seq_len + 1)  # [seq + 1]
    for b in range(num_batches):
        starts = (b * batch_size + np.arange(batch_size)) * seq_len  # [batch]
        windows = tokens[starts[:, None] + offsets].astype(np.int32)  # [batch, seq + 1]
        yield np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])
