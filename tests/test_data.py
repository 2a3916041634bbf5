"""Tests for the experiments' corpus (experiments/trainer/data.py): corpus loading, the train/val
split and the batchers."""

from __future__ import annotations

import numpy as np
import pytest
from trainer.data import (
    DEFAULT_STDLIB_MAX_BYTES,
    VOCAB_SIZE,
    Batcher,
    Corpus,
    load_corpus,
    sequential_batches,
)

SMALL = 256 * 1024  # bytes: enough stdlib text for every test, fast to read


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(max_bytes=SMALL)


def test_stdlib_corpus_loads(corpus: Corpus) -> None:
    assert corpus.source.startswith("stdlib:")
    assert corpus.num_bytes == SMALL
    assert corpus.num_files > 1
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert corpus.train.size > 0 and corpus.val.size > 0
    assert corpus.train.size + corpus.val.size == corpus.num_bytes
    assert int(corpus.train.max()) < VOCAB_SIZE
    assert len(corpus.fingerprint) == 16
    assert corpus.info()["data_fingerprint"] == corpus.fingerprint
    assert str(corpus.num_bytes) in corpus.description


def test_default_stdlib_cap() -> None:
    assert load_corpus().num_bytes <= DEFAULT_STDLIB_MAX_BYTES


def test_split_is_deterministic_and_disjoint(corpus: Corpus) -> None:
    again = load_corpus(max_bytes=SMALL)
    assert again.fingerprint == corpus.fingerprint
    np.testing.assert_array_equal(again.train, corpus.train)
    np.testing.assert_array_equal(again.val, corpus.val)
    # Disjoint and complete: val is exactly the tail of the stream, train the head.
    assert corpus.val.size == int(np.ceil(SMALL * 0.05))
    whole = np.concatenate([corpus.train, corpus.val])
    assert whole.size == corpus.num_bytes
    assert not np.shares_memory(corpus.train, corpus.val)
    assert not corpus.train.flags.writeable and not corpus.val.flags.writeable


def test_batch_at_is_deterministic_and_shifted(corpus: Corpus) -> None:
    batcher = corpus.batcher(batch_size=4, seq_len=32, seed=7)
    inputs, targets = batcher.batch_at(3)
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    again = Batcher(corpus.train, 4, 32, seed=7).batch_at(3)
    np.testing.assert_array_equal(again[0], inputs)
    np.testing.assert_array_equal(again[1], targets)
    other_step = batcher.batch_at(4)[0]
    other_seed = Batcher(corpus.train, 4, 32, seed=8).batch_at(3)[0]
    assert not np.array_equal(other_step, inputs)
    assert not np.array_equal(other_seed, inputs)


def test_resume_gives_identical_batches(corpus: Corpus) -> None:
    full = [b for _, b in zip(range(6), corpus.batcher(2, 16, seed=1), strict=False)]
    killed = corpus.batcher(2, 16, seed=1)
    for _ in range(3):
        next(killed)
    resumed = Batcher.from_state(corpus.train, killed.state)
    for expected in full[3:]:
        got = next(resumed)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    with pytest.raises(ValueError, match="same corpus"):
        Batcher.from_state(corpus.val, killed.state)


def test_val_batches_are_sequential(corpus: Corpus) -> None:
    batches = list(corpus.val_batches(batch_size=2, seq_len=16, max_batches=3))
    assert len(batches) == 3
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (2, 16)
    np.testing.assert_array_equal(inputs[0], corpus.val[:16])
    np.testing.assert_array_equal(targets[0], corpus.val[1:17])
    np.testing.assert_array_equal(inputs[1], corpus.val[16:32])
    # Without a cap, every full batch; the incomplete tail is dropped.
    tokens = np.arange(50, dtype=np.uint8)
    assert len(list(sequential_batches(tokens, 2, 8))) == (50 - 1) // 8 // 2


def test_user_text_file(tmp_path) -> None:
    path = tmp_path / "text.txt"
    text = "héllo wörld, a small corpus of text.\n" * 20
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(path, val_fraction=0.1)
    data = text.encode("utf-8")
    assert corpus.source == str(path.resolve())
    assert corpus.num_files == 1 and corpus.num_bytes == len(data)
    np.testing.assert_array_equal(
        np.concatenate([corpus.train, corpus.val]), np.frombuffer(data, np.uint8)
    )
    assert load_corpus(str(path), max_bytes=10).num_bytes == 10


def test_user_folder_skips_binary_and_sorts(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "sub" / "c.txt").write_text("third\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / ".hidden").write_text("hidden\n")
    corpus = load_corpus(tmp_path, val_fraction=0.0)
    assert corpus.num_files == 3
    assert corpus.train.tobytes() == b"first\nsecond\nthird\n"


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "empty_file", "nul", "not_utf8"])
def test_bad_paths_raise_with_path(tmp_path, kind: str) -> None:
    if kind == "missing":
        path = tmp_path / "does_not_exist.txt"
    elif kind == "empty_dir":
        path = tmp_path / "empty"
        path.mkdir()
    elif kind == "empty_file":
        path = tmp_path / "empty.txt"
        path.write_bytes(b"")
    elif kind == "nul":
        path = tmp_path / "nul.dat"
        path.write_bytes(b"text\x00more text")
    else:
        path = tmp_path / "latin1.txt"
        path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError) as info:
        load_corpus(path)
    message = str(info.value)
    assert str(path) in message or str(path.resolve()) in message
    assert "\n" not in message


def test_folder_of_only_binary_files_raises(tmp_path) -> None:
    (tmp_path / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="no text"):
        load_corpus(tmp_path)


def test_too_short_corpus_raises(tmp_path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("0123456789")
    corpus = load_corpus(path, val_fraction=0.0)
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 11"):
        corpus.batcher(batch_size=1, seq_len=10)
    Batcher(corpus.train, batch_size=1, seq_len=9).batch_at(0)  # exactly long enough
    with pytest.raises(ValueError, match="too short"):
        sequential_batches(corpus.train, batch_size=2, seq_len=8)


@pytest.mark.parametrize(
    "kwargs", [{"max_bytes": 0}, {"val_fraction": 1.0}, {"val_fraction": -0.1}]
)
def test_bad_arguments_raise(kwargs) -> None:
    with pytest.raises(ValueError):
        load_corpus(**kwargs)
