"""The lm task's ArrayRecord token files, read through grain: `python -m job tokenize` writes records of
N tokens and their description; rows are a pure function of (step, row range), each epoch of the train
split covers every train window once in its own order, the eval split is finite and read in order,
and what cannot work is one clear error before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from job.errors import ConfigError
from job.tasks.lm import data

TEXT = np.random.default_rng(0).integers(0, 256, 3800, dtype=np.uint8).tobytes()  # 14 records of 256, 216 left out


@pytest.fixture
def record_file(tmp_path: Path) -> Path:
    (tmp_path / "text.txt").write_bytes(TEXT)
    data.tokenize_text(tmp_path / "text.txt", tmp_path / "tok.arrayrecord", record_tokens=RECORD)
    return tmp_path / "tok.arrayrecord"


RECORD = 257  # tokens a record: 8 rows of 33 (32 positions and the last target), neighbours sharing one


def window(record: int, i: int) -> np.ndarray:
    """Row i of a record, as the text holds it: 33 tokens from 32 * i."""
    start = record * RECORD + 32 * i
    return np.frombuffer(TEXT[start:start + 33], np.uint8).astype(np.int32)


def record_source(path: Path, **kw: object) -> data.RecordFile:
    return data.RecordFile(path, **{"seq_len": 32, "global_batch": 16, "seed": 0, "eval_fraction": 0.1, **kw})


def test_tokenize_writes_whole_records_and_their_description(record_file: Path) -> None:
    described = json.loads(data.sidecar(record_file).read_text())
    assert described == {"tokens": 14 * RECORD, "record_tokens": RECORD, "records": 14,
                         "left_out_tokens": 3800 - 14 * RECORD,
                         "vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes"}
    import grain

    read = grain.sources.ArrayRecordDataSource([str(record_file)])
    assert len(read) == 14
    assert np.array_equal(np.frombuffer(read[3], np.uint16), np.frombuffer(TEXT[3 * RECORD:4 * RECORD], np.uint8))


def test_train_rows_are_a_pure_function_of_step_and_row_range(record_file: Path) -> None:
    one, other = record_source(record_file), record_source(record_file)
    whole = one.rows("train", 5, 0, 16)["tokens"]
    parts = np.concatenate([other.rows("train", 5, a, b)["tokens"] for a, b in ((0, 4), (4, 11), (11, 16))])
    assert np.array_equal(whole, parts)  # any split of the batch over processes sees the same rows
    assert whole.shape == (16, 33) and whole.dtype == np.int32  # seq_len + 1 tokens: 32 positions train
    assert np.array_equal(one.rows("train", 5, 0, 16)["mask"], np.ones((16, 33), np.float32))


def test_each_epoch_covers_every_train_window_once_in_its_own_order(record_file: Path) -> None:
    s = record_source(record_file)
    windows = s.train_windows  # 13 train records x 8 windows of 33 tokens
    assert windows == 13 * 8
    text = np.stack([window(w // 8, w % 8) for w in range(14 * 8)])  # window w of the file
    stream = np.concatenate([s.rows("train", step, 0, 16)["tokens"] for step in range(2 * windows // 16)])
    first, second = stream[:windows], stream[windows:2 * windows]

    def ids(rows: np.ndarray) -> list[int]:
        return [int(np.flatnonzero((text == row).all(axis=1))[0]) for row in rows]

    assert sorted(ids(first)) == list(range(windows)) == sorted(ids(second))
    assert ids(first) != ids(second) and ids(first) != list(range(windows))  # shuffled, differently per epoch
    assert ids(record_source(record_file, seed=1).rows("train", 0, 0, 16)["tokens"]) != ids(first[:16])


def test_the_train_stream_is_grains_shuffled_and_repeated_dataset(record_file: Path) -> None:
    import grain

    s = record_source(record_file)
    windows = grain.MapDataset.range(s.train_windows).shuffle(seed=0).repeat()  # the same order, grain's own way
    assert [s.train_window(g) for g in range(3 * s.train_windows)] == [windows[g] for g in range(3 * s.train_windows)]


def test_the_eval_split_is_finite_and_read_in_order(record_file: Path) -> None:
    s = record_source(record_file)
    assert s.split_size("eval") == 8 and s.split_size("train") is None  # the last record: 8 windows
    tail = np.stack([window(13, i) for i in range(8)])
    assert np.array_equal(np.concatenate([s.rows("eval", 0, 0, 3)["tokens"], s.rows("eval", 0, 3, 8)["tokens"]]),
                          tail)
    with pytest.raises(ConfigError, match="eval rows: expected within its 8 windows"):
        s.rows("eval", 0, 4, 9)


def test_the_lm_reads_an_arrayrecord_source_and_checks_its_vocabulary(record_file: Path) -> None:
    cfg = data.DataConfig(source=str(record_file), global_batch=16)
    assert isinstance(data.make_source(cfg, vocab_size=256, seq_len=32), data.RecordFile)
    with pytest.raises(ConfigError, match=r"at least the file's vocab_size 256 \(tok.arrayrecord.json\)"):
        data.make_source(cfg, vocab_size=100, seq_len=32)


@pytest.mark.parametrize(("change", "needle"), [
    ({"seq_len": 300}, "--model.seq-len for records file .*: expected at most its 257 tokens a record less one, "
                       "found 300. Fix: pass --model.seq-len 256 or less, or tokenize again with --record-tokens 301"),
    ({"eval_fraction": 0.01}, "expected at least one record in each split"),
    ({"seed": -1}, "--data.seed: expected an integer 0..2\\*\\*32-1"),
])
def test_what_cannot_work_is_one_clear_error(record_file: Path, change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        record_source(record_file, **change)


def test_a_records_file_without_its_description_is_refused_with_the_fix(record_file: Path) -> None:
    data.sidecar(record_file).unlink()
    with pytest.raises(ConfigError, match="records file description .*Fix: write the file again with"):
        record_source(record_file)
