"""Tests for the lm task's data (job.tasks.lm.data): rows, topology invariance, token files, tokenizer."""

from __future__ import annotations

import json

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from job.tasks.lm import data, token_files
from job.errors import ConfigError

# --------------------------------------------------------------------------- helpers


def global_batch(source, *, split="train", step=0, process_count=1, batch=8) -> data.Batch:
    """The global batch as the concatenation of every process's block of rows."""
    n = batch // process_count
    parts = [source.rows(split, step, p * n, (p + 1) * n) for p in range(process_count)]
    for part in parts:
        assert part["tokens"].shape == (batch // process_count, source.seq_len + 1)  # seq_len positions train
    return {k: np.concatenate([part[k] for part in parts]) for k in ("tokens", "mask")}


def write_tokens(path: Path, tokens: np.ndarray) -> Path:
    if path.suffix == ".npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    return path


@pytest.fixture
def arange_file(tmp_path: Path) -> data.TokenFile:
    """1000 tokens 0..999, eval_fraction 0.25: train = [0, 750), eval = [750, 1000)."""
    path = write_tokens(tmp_path / "arange.npy", np.arange(1000, dtype=np.uint16))
    return data.TokenFile(path, seq_len=16, seed=0, eval_fraction=0.25)


SOURCES = ["reverse", "file"]


def rebuild(source, seed: int) -> data.ReverseTask | data.TokenFile:
    """A new source like `source`, with this seed."""
    if isinstance(source, data.ReverseTask):
        return data.ReverseTask(source.vocab_size, source.seq_len, seed=seed)
    return data.TokenFile(source.path, seq_len=source.seq_len, seed=seed)


@pytest.fixture(params=SOURCES)
def source(request: pytest.FixtureRequest, tmp_path: Path) -> data.ReverseTask | data.TokenFile:
    if request.param == "reverse":
        return data.ReverseTask(vocab_size=16, seq_len=12, seed=3)
    tokens = np.random.default_rng(0).integers(0, 500, size=5000).astype(np.uint16)
    return data.TokenFile(write_tokens(tmp_path / "t.npy", tokens), seq_len=12, seed=3)


# --------------------------------------------------------------------------- reverse task


@pytest.mark.parametrize(("vocab", "seq_len"), [(4, 4), (10, 9), (16, 16), (50, 33)])
def test_reverse_rows_structure(vocab: int, seq_len: int) -> None:
    task = data.ReverseTask(vocab, seq_len, seed=1)
    batch = global_batch(task, batch=32, step=2)
    tokens, mask = batch["tokens"], batch["mask"]
    k = (seq_len - 1) // 2  # a row of seq_len + 1 tokens: BOS, k symbols, SEP, their reverse
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    assert tokens.shape == mask.shape == (32, seq_len + 1)
    assert task.vocab_size == vocab
    np.testing.assert_array_equal(tokens[:, 0], data.BOS)
    np.testing.assert_array_equal(tokens[:, 1 + k], data.SEP)
    first, reversed_part = tokens[:, 1:1 + k], tokens[:, 2 + k:2 + 2 * k]
    np.testing.assert_array_equal(reversed_part, first[:, ::-1])
    assert first.min() >= 3 and first.max() <= vocab - 1
    np.testing.assert_array_equal(tokens[:, 2 + 2 * k:], data.PAD)
    assert tokens.shape[1] - (2 + 2 * k) == (seq_len + 1) % 2  # one PAD exactly when seq_len is even
    expected_mask = np.zeros(seq_len + 1, np.float32)
    expected_mask[2 + k:2 + 2 * k] = 1
    np.testing.assert_array_equal(mask, np.broadcast_to(expected_mask, mask.shape))
    if vocab == 4:
        np.testing.assert_array_equal(first, 3)
    else:  # symbols are spread over the range and rows differ
        assert first.min() == 3 and first.max() == vocab - 1
        assert len({row.tobytes() for row in tokens}) > 24


def test_the_reverse_task_scales_its_length_and_alphabet_to_a_large_vocabulary() -> None:
    task = data.ReverseTask(50304, 1024, seed=0, reverse_len=64, symbols=256)
    tokens, mask = task.rows("train", 0, 0, 8)["tokens"], task.rows("train", 0, 0, 8)["mask"]
    assert tokens.shape == (8, 1025) and mask.sum(1).tolist() == [64.0] * 8
    np.testing.assert_array_equal(tokens[:, 66:130], tokens[:, 1:65][:, ::-1])
    assert tokens[:, 1:65].min() >= 3 and tokens[:, 1:65].max() <= 258
    np.testing.assert_array_equal(tokens[:, 130:], data.PAD)


@pytest.mark.parametrize(("kwargs", "says"), [({"reverse_len": 16}, "--data.reverse-len: expected 0..15"),
                                              ({"symbols": 30}, "--data.symbols: expected 0..29")])
def test_a_reverse_task_that_cannot_fit_names_the_limit(kwargs: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        data.ReverseTask(32, 32, seed=0, **kwargs)


@pytest.mark.parametrize(("vocab", "seq_len", "bad"), [(3, 8, 3), (16, 3, 3), (0, 8, 0)])
def test_reverse_task_rejects_small(vocab: int, seq_len: int, bad: int) -> None:
    with pytest.raises(ConfigError, match=rf"expected >= 4.*found {bad}\b"):
        data.ReverseTask(vocab, seq_len, seed=0)


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("split", data.SPLITS)
def test_same_global_batch_for_every_topology(source, split: str) -> None:
    for step in (0, 1, 7):
        one = global_batch(source, split=split, step=step, process_count=1)
        for process_count in (2, 4):
            other = global_batch(source, split=split, step=step, process_count=process_count)
            np.testing.assert_array_equal(other["tokens"], one["tokens"])
            np.testing.assert_array_equal(other["mask"], one["mask"])


@pytest.mark.parametrize("split", data.SPLITS)
def test_rows_do_not_depend_on_how_the_range_is_cut(source, split: str) -> None:
    for step in (0, 1, 9, 2**40):
        whole = source.rows(split, step, 0, 8)
        for cut in (0, 1, 3, 7, 8):
            head, tail = source.rows(split, step, 0, cut), source.rows(split, step, cut, 8)
            for key in ("tokens", "mask"):
                np.testing.assert_array_equal(np.concatenate([head[key], tail[key]]), whole[key])
        np.testing.assert_array_equal(source.rows(split, step, 5, 6)["tokens"], whole["tokens"][5:6])


def test_steps_splits_and_seeds_differ(source) -> None:
    base = global_batch(source, step=0)["tokens"]
    assert not np.array_equal(global_batch(source, step=1)["tokens"], base)
    assert not np.array_equal(global_batch(source, split="eval", step=0)["tokens"], base)
    assert not np.array_equal(global_batch(rebuild(source, source.seed + 1), step=0)["tokens"], base)


def test_same_seed_reproduces_and_resume_matches(source) -> None:
    uninterrupted = [global_batch(source, step=s)["tokens"] for s in range(6)]
    fresh = rebuild(source, source.seed)  # a restarted process
    np.testing.assert_array_equal(global_batch(fresh, step=5)["tokens"], uninterrupted[5])  # resume at step 5
    np.testing.assert_array_equal(global_batch(fresh, step=0)["tokens"], uninterrupted[0])


def test_make_source_seed_from_config(tmp_path: Path) -> None:
    a = data.make_source(data.DataConfig(seed=1), vocab_size=32, seq_len=16)
    b = data.make_source(data.DataConfig(seed=1), vocab_size=32, seq_len=16)
    c = data.make_source(data.DataConfig(seed=2), vocab_size=32, seq_len=16)
    assert isinstance(a, data.ReverseTask) and a.vocab_size == 32 and a.seq_len == 16
    np.testing.assert_array_equal(global_batch(a)["tokens"], global_batch(b)["tokens"])
    assert not np.array_equal(global_batch(a)["tokens"], global_batch(c)["tokens"])


# --------------------------------------------------------------------------- token files


@pytest.mark.parametrize(("suffix", "dtype", "base"), [(".npy", "uint16", 0), (".npy", "uint32", 70_000),
                                                       (".bin", "uint16", 0), (".bin", "uint32", 70_000)])
def test_token_file_windows_lie_in_their_split(tmp_path: Path, suffix: str, dtype: str, base: int) -> None:
    content = np.arange(base, base + 1000).astype(dtype)  # a window's first token gives its offset
    path = write_tokens(tmp_path / f"tokens{suffix}", content)
    source = data.TokenFile(path, seq_len=16, seed=0, dtype=dtype, eval_fraction=0.25)
    assert source.vocab_size is None  # no FILE.json beside it, and opening never reads the tokens
    for split, (lo, hi) in (("train", (0, 750)), ("eval", (750, 1000))):
        offsets = []
        for step in range(4):
            batch = global_batch(source, split=split, step=step, process_count=2, batch=16)
            np.testing.assert_array_equal(batch["mask"], 1.0)
            for window in batch["tokens"]:
                offset = int(window[0]) - base
                np.testing.assert_array_equal(window, content[offset:offset + 17].astype(np.int32))
                assert lo <= offset and offset + 17 <= hi, (split, offset)
                offsets.append(offset)
        assert len(set(offsets)) > 32  # offsets are drawn, not fixed
        assert max(offsets) - min(offsets) > (hi - lo) // 2  # and spread over the split


def test_opening_a_token_file_reads_none_of_its_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tokens(tmp_path / "t.npy", np.arange(1000).astype(np.uint16))
    real_load = np.load
    opened = []

    def load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a memory map whose reads are recorded
        tokens = real_load(*args, **kwargs)
        opened.append(tokens)
        return tokens

    monkeypatch.setattr(np, "load", load)
    data.TokenFile(path, seq_len=8)
    assert len(opened) == 1 and isinstance(opened[0], np.memmap)
    assert opened[0].offset == 128  # the mapping starts after the header


@pytest.mark.parametrize("where", [0, 500, 999])
def test_a_token_above_the_vocabulary_of_an_undescribed_file_stops_the_batch_that_reads_it(
        tmp_path: Path, where: int) -> None:
    content = np.random.default_rng(1).integers(0, 50, size=1000).astype(np.uint16)
    content[where] = 777
    source = data.make_source(data.DataConfig(source=str(write_tokens(tmp_path / "t.bin", content)),
                                              eval_fraction=0.5), vocab_size=100, seq_len=8)
    with pytest.raises(ConfigError, match="pass --model.vocab-size 778 or more") as info:
        for step in range(200):
            for split in ("train", "eval"):
                source.rows(split, step, 0, 16)
    assert "777 is in a" in str(info.value) and "python -m job tokenize" in str(info.value)


def test_a_description_beside_the_file_gives_its_vocabulary_and_a_stale_one_is_refused(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.npy", np.arange(100).astype(np.uint16))
    data.sidecar(path).write_text(json.dumps({"tokens": 100, "vocab_size": 300}))
    assert data.TokenFile(path, seq_len=8).vocab_size == 300
    data.sidecar(path).write_text(json.dumps({"tokens": 99, "vocab_size": 300}))
    with pytest.raises(ConfigError, match="stale t.npy.json"):
        data.TokenFile(path, seq_len=8)


def _error(path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        data.TokenFile(path, **{"seq_len": 16, **kwargs})
    return str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.npy")
    assert str(tmp_path / "nope.npy") in message
    assert "python -m job tokenize INPUT.txt OUTPUT.npy" in message


@pytest.mark.parametrize("array", [np.arange(100, dtype=np.float32), np.arange(100, dtype=np.int64),
                                   np.zeros((10, 40), np.uint16)])
def test_npy_of_wrong_dtype_or_shape(tmp_path: Path, array: np.ndarray) -> None:
    path = write_tokens(tmp_path / "bad.npy", array)
    message = _error(path)
    assert str(path) in message and str(array.dtype) in message and "uint16 or uint32" in message


def test_npy_that_is_not_an_array(tmp_path: Path) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(b"not a numpy file at all")
    assert str(path) in _error(path)


def test_bin_size_not_a_multiple_of_dtype(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(4003))
    message = _error(path, dtype="uint32")
    assert str(path) in message and "4003 bytes" in message and "multiple of 4" in message


def test_bin_with_unknown_dtype(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", np.arange(100, dtype=np.uint16))
    assert "'int8'" in _error(path, dtype="int8")


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("hello")
    message = _error(path)
    assert str(path) in message and "'.txt'" in message


@pytest.mark.parametrize(("n", "fraction", "split", "length"), [
    (100, 0.1, "eval", 10), (100, 0.9, "train", 10), (16, 0.5, "train", 8), (0, 0.1, "train", 0)])
@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_split_shorter_than_a_window(tmp_path: Path, n: int, fraction: float, split: str, length: int,
                                     suffix: str) -> None:
    path = write_tokens(tmp_path / f"short{suffix}", np.arange(n, dtype=np.uint16))
    message = _error(path, eval_fraction=fraction)
    assert str(path) in message and f"the {split} split" in message
    assert "seq_len + 1 = 17" in message and f"{length} tokens" in message


def test_split_of_exactly_seq_len_plus_one_works(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.npy", np.arange(34, dtype=np.uint16))
    source = data.TokenFile(path, seq_len=16, eval_fraction=0.5)  # 17 + 17 tokens
    eval_rows = global_batch(source, split="eval", batch=8)["tokens"]
    assert set(eval_rows[:, 0].tolist()) <= {17, 18}


# --------------------------------------------------------------------------- make_source, rows, config


def test_make_source_checks_the_model_vocab_before_the_first_step(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.npy", np.r_[np.zeros(200), 99].astype(np.uint16))
    data.sidecar(path).write_text(json.dumps({"tokens": 201, "vocab_size": 100}))
    cfg = data.DataConfig(source=str(path))
    with pytest.raises(ConfigError) as info:
        data.make_source(cfg, vocab_size=50, seq_len=8)
    message = str(info.value)
    assert "100" in message and "50" in message and "--model.vocab-size 100" in message and str(path) in message
    source = data.make_source(cfg, vocab_size=100, seq_len=8)
    assert isinstance(source, data.TokenFile) and source.vocab_size == 100


def test_make_source_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="revrese"):
        data.make_source(data.DataConfig(source="revrese"), vocab_size=32, seq_len=8)


def test_rows_reject_bad_arguments() -> None:
    task = data.ReverseTask(16, 8, seed=0)
    for args, pattern in [(("test", 0, 0, 4), "found 'test'"), (("train", -1, 0, 4), "found -1"),
                          (("train", 0, 4, 2), r"found \(4, 2\)")]:
        with pytest.raises(ConfigError, match=pattern):
            task.rows(*args)


@pytest.mark.parametrize(("field", "value"), [("global_batch", 0), ("eval_batches", -1), ("eval_fraction", 0.0),
                                              ("eval_fraction", 1.0), ("seed", -1), ("dtype", "int32")])
def test_data_config_rejects_bad_values(field: str, value: object) -> None:
    flag = "--data." + field.replace("_", "-")  # every message spells the flag as the command line does
    with pytest.raises(ConfigError, match=rf"{flag}.*found {value!r}"):
        data.DataConfig(**{field: value})


# --------------------------------------------------------------------------- tokenizer


def test_tokenize_text_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_files, "CHUNK_TOKENS", 7)  # many chunks, split inside multi-byte characters
    text = "héllo wörld ✓ 日本語 🚀\nzweite Zeile: ÄÖÜß\n" * 5
    raw = text.encode("utf-8")
    src, dst = tmp_path / "in.txt", tmp_path / "out.npy"
    src.write_bytes(raw)
    assert data.tokenize_text(src, dst) == len(raw)
    tokens = np.load(dst)
    assert tokens.dtype == np.uint16 and tokens.shape == (len(raw),)
    assert tokens.astype(np.uint8).tobytes() == raw and tokens.max() > 127
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.npy", "out.npy.json"]  # no partial file
    assert json.loads((tmp_path / "out.npy.json").read_text())["tokens"] == len(raw)
    source = data.make_source(data.DataConfig(source=str(dst)), vocab_size=256, seq_len=16)
    assert source.vocab_size == 256
    with pytest.raises(ConfigError, match="--model.vocab-size 256"):  # known before any batch
        data.make_source(data.DataConfig(source=str(dst)), vocab_size=200, seq_len=16)


def test_tokenize_text_errors_and_empty_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.txt"):
        data.tokenize_text(tmp_path / "missing.txt", tmp_path / "out.npy")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"out\.bin.*Fix: use .*out\.npy"):
        data.tokenize_text(tmp_path / "empty.txt", tmp_path / "out.bin")
    assert data.tokenize_text(tmp_path / "empty.txt", tmp_path / "out.npy") == 0
    assert np.load(tmp_path / "out.npy").shape == (0,)


# --------------------------------------------------------------------------- jax


def test_module_imports_without_jax() -> None:
    code = "import sys, job.tasks.lm.data; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
