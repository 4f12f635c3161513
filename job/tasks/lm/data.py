"""The example LM's input: token rows, synthetic or from a token file; a process makes only its own rows.

    from job.tasks.lm import data
    cfg = data.DataConfig(source="reverse", global_batch=32)   # or "tokens.npy", "tokens.arrayrecord"
    source = data.make_source(cfg, vocab_size=32, seq_len=32)
    rows = source.rows("train", step, start, stop)             # {"tokens", "mask"}, rows [start, stop)

The loop turns rows into global arrays with `job.train.batches.global_batch`.

Row ``r`` of step ``s`` is a pure function of (seed, split, s, r): it is drawn
from ``job.random.row_bits`` (a counter-based hash of seed, split_id, s, r and
the position in the row), computed for a process's whole block of rows at once.
So every topology (1 x 4, 2 x 2, 4 x 1 processes x devices) sees the same global
batches, and a run resumed at step s sees exactly the batches an uninterrupted run would.
No host holds the dataset or the global batch: token files are memory-mapped
and a host reads only the windows of its own rows. An .arrayrecord file is read
through grain's ArrayRecord data source, a window per row, its train split in
epochs each shuffled in its own order, its eval split finite (a full pass).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TypedDict

import numpy as np

from job.errors import ConfigError, require
from job.random import below, row_bits
from job.task import SPLITS  # a split's index is its id in the row hash
# what writes token files, and the names its callers have always read here (bench/records.py, the tests)
from job.tasks.lm.token_files import BYTE_VOCAB, RECORDS_SUFFIX, sidecar, tokenize_text

TOKEN_DTYPES = ("uint16", "uint32")
PAD, BOS, SEP = 0, 1, 2
_TOKENIZE = "`python -m job tokenize INPUT.txt OUTPUT.npy`"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how many sequences each step takes."""

    # "reverse" (synthetic, learnable) or a token file path: .npy, .bin with `dtype`, or .arrayrecord (grain)
    source: str = "reverse"
    dtype: str = "uint16"  # token dtype of a raw .bin file ("uint16" or "uint32"); .npy files carry their own
    global_batch: int = 32  # sequences per step, summed over all processes
    eval_batches: int = 2  # held-out batches per evaluation (0: no evaluation)
    eval_fraction: float = 0.1  # share of a token file held out for evaluation (its tail)
    seed: int = 0  # data seed
    # the reverse task: symbols reversed a row (0: as many as fit, (seq_len - 1) // 2), drawn from how many
    # distinct symbols (0: the whole vocabulary but PAD, BOS and SEP); a large model learns it in minutes at
    # 64 of 256 (--preset gpt2-small), not at 511 of 50,301
    reverse_len: int = 0
    symbols: int = 0

    def __post_init__(self) -> None:
        require(self.global_batch >= 1, "--data.global-batch", "an integer >= 1", self.global_batch,
                 "pass --data.global-batch N with N >= 1")
        require(self.eval_batches >= 0, "--data.eval-batches", "an integer >= 0", self.eval_batches,
                 "pass --data.eval-batches N with N >= 0")
        require(0.0 < self.eval_fraction < 1.0, "--data.eval-fraction", "a fraction strictly between 0 and 1",
                 self.eval_fraction, "pass e.g. --data.eval-fraction 0.1")
        require(self.seed >= 0, "--data.seed", "an integer >= 0", self.seed, "pass --data.seed 0 or any N >= 0")
        require(self.reverse_len >= 0 and self.symbols >= 0, "--data.reverse-len / --data.symbols",
                "integers >= 0 (0: as many as fit)", (self.reverse_len, self.symbols),
                "pass --data.reverse-len 0 --data.symbols 0")
        require(self.dtype in TOKEN_DTYPES, "--data.dtype", " or ".join(TOKEN_DTYPES), self.dtype,
                 "pass --data.dtype uint16 (or uint32 for vocabularies above 65536)")


class Batch(TypedDict):
    """Rows of a batch: the model predicts tokens[:, 1:] from tokens[:, :-1], weighted by mask[:, 1:]. A row
    holds seq_len + 1 tokens, so the model sees seq_len positions (a length the kernels' tiles divide)."""

    tokens: np.ndarray  # int32 [n, seq_len + 1]
    mask: np.ndarray  # float32 [n, seq_len + 1], 1 where a token is a prediction target


class _Source:
    """Rows keyed by (seed, split, step, global row index); subclasses turn `width` random words a row into tokens."""

    seed: int
    seq_len: int
    width: int  # random words (uint64) each row is drawn from
    _mask: np.ndarray

    def _tokens(self, bits: np.ndarray, split: str) -> np.ndarray:
        """int32 [n, seq_len + 1] from uint64 bits [n, width], row by row (row i only from bits[i])."""
        raise NotImplementedError

    def rows(self, split: str, step: int, start: int, stop: int) -> Batch:
        """Global rows [start, stop) of batch `step` of `split` ("train", or "eval" with step = eval batch)."""
        require(split in SPLITS, "split", " or ".join(map(repr, SPLITS)), split, "pass split='train' or 'eval'")
        require(step >= 0, "step", "an integer >= 0", step, "count steps from 0")
        require(0 <= start <= stop, "row range", "0 <= start <= stop", (start, stop), "pass a valid row range")
        bits = row_bits(self.seed, SPLITS.index(split), step, start, stop, self.width)
        mask = np.repeat(self._mask[None, :], stop - start, axis=0)
        return {"tokens": self._tokens(bits, split), "mask": mask}


class ReverseTask(_Source):
    """Synthetic, learnable: rows [BOS, x1..xk, SEP, xk..x1, PAD...] of seq_len + 1 tokens, k = `reverse_len`
    (0: (seq_len - 1) // 2, as many as fit).

    Symbols are 3..2 + `symbols` (0: every token but PAD, BOS and SEP); the loss falls exactly on the k
    reversed positions.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, *, reverse_len: int = 0,
                 symbols: int = 0) -> None:
        require(vocab_size >= 4, "--model.vocab-size for the reverse task",
                 ">= 4 (PAD, BOS, SEP and at least one symbol)", vocab_size, "pass --model.vocab-size 4 or more")
        require(seq_len >= 4, "--model.seq-len for the reverse task", ">= 4 (BOS, a symbol, SEP, its reverse)",
                 seq_len, "pass --model.seq-len 4 or more")
        require(seed >= 0, "--data.seed", "an integer >= 0", seed, "pass --data.seed 0 or any N >= 0")
        most = (seq_len - 1) // 2
        require(0 <= reverse_len <= most, "--data.reverse-len", f"0..{most} (BOS, k symbols, SEP and their reverse "
                f"in seq_len + 1 = {seq_len + 1} tokens)", reverse_len, f"pass --data.reverse-len {most} or less")
        require(0 <= symbols <= vocab_size - 3, "--data.symbols", f"0..{vocab_size - 3} (the vocabulary but PAD, "
                "BOS and SEP)", symbols, "pass --data.symbols 0 (all of them) or fewer")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.symbols = symbols or vocab_size - 3
        self.k = self.width = reverse_len or most
        self._mask = np.zeros(seq_len + 1, np.float32)
        self._mask[2 + self.k:2 + 2 * self.k] = 1.0

    def _tokens(self, bits: np.ndarray, split: str) -> np.ndarray:
        k = self.k
        x_nk = 3 + below(bits, self.symbols)
        tokens = np.full((len(bits), self.seq_len + 1), PAD, np.int32)
        tokens[:, 0], tokens[:, 1 + k] = BOS, SEP
        tokens[:, 1:1 + k], tokens[:, 2 + k:2 + 2 * k] = x_nk, x_nk[:, ::-1]
        return tokens


def check_source(source: str) -> None:
    """What can be checked of --data.source without reading it: the synthetic task, or an existing file."""
    if source == "reverse":
        return
    require(Path(source).is_file(), "--data.source (token file)", "an existing .npy, .bin or .arrayrecord file", source,
             "check the path (or pass --data.source reverse for the synthetic task), "
             f"or make one with {_TOKENIZE}")


def _open_tokens(path: Path, dtype: str) -> np.ndarray:
    """A read-only, memory-mapped 1-D uint16/uint32 view of a token file."""
    check_source(str(path))
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as err:
            raise ConfigError(f"token file {path}", expected="a readable .npy array", found=str(err),
                              fix=f"write it with np.save(path, tokens.astype(np.uint16)) or {_TOKENIZE}") from err
        require(tokens.dtype.name in TOKEN_DTYPES and tokens.ndim == 1, f"token file {path}",
                 "a 1-D uint16 or uint32 array", f"{tokens.dtype} array of shape {tokens.shape}",
                 f"save it as np.save(path, tokens.reshape(-1).astype(np.uint16 or np.uint32)) or use {_TOKENIZE}")
        return tokens
    if suffix == ".bin":
        require(dtype in TOKEN_DTYPES, "--data.dtype", " or ".join(TOKEN_DTYPES), dtype,
                 "pass --data.dtype with the dtype the .bin file was written with")
        size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
        require(size % itemsize == 0, f"token file {path}",
                 f"a size that is a multiple of {itemsize} bytes (--data.dtype {dtype})", f"{size} bytes",
                 "pass the --data.dtype the file was written with (uint16 or uint32), or rewrite the file")
        return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    raise ConfigError(f"token file {path}", expected="a .npy file, or a raw .bin file with --data.dtype",
                      found=suffix or "no extension", fix=f"convert it with {_TOKENIZE}")


def _described_vocab(path: Path, tokens: np.ndarray) -> int | None:
    """The vocabulary size FILE.json records for this very file (its token count must match), else None."""
    try:
        described = json.loads(sidecar(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"token file description {sidecar(path)}", expected="the JSON `python -m job tokenize` "
                          "writes", found=str(err), fix=f"delete it, or write the file again with {_TOKENIZE}") from err
    if not isinstance(described, dict) or described.get("tokens") != len(tokens):
        raise ConfigError(f"token file description {sidecar(path)}",
                          expected=f"a description of the {len(tokens)} tokens of {path}",
                          found=f"{described.get('tokens') if isinstance(described, dict) else described!r} tokens",
                          fix=f"delete the stale {sidecar(path).name}, or write both again with {_TOKENIZE}")
    vocab = described.get("vocab_size")
    require(isinstance(vocab, int) and vocab >= 1, f"token file description {sidecar(path)}",
            "an integer vocab_size >= 1", vocab, f"write it again with {_TOKENIZE}")
    return vocab


def _check_vocab(tokens: np.ndarray, limit: int | None, where: str, split: str, more: str = "") -> None:
    """Every token below `limit` (the model's vocabulary; None: unchecked), else one error with the fix."""
    if limit is not None and len(tokens) and int(tokens.max()) >= limit:
        raise ConfigError(f"--model.vocab-size for {where}",
                          expected=f"more than its largest token: {int(tokens.max())} is in a {split} batch",
                          found=f"--model.vocab-size {limit}", fix=f"pass --model.vocab-size {int(tokens.max()) + 1} "
                          f"or more{more}")


class TokenFile(_Source):
    """Memory-mapped tokens: train = head (1 - eval_fraction), eval = tail.

    A row is seq_len + 1 consecutive tokens at an offset drawn within its split; mask = all ones.
    """

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, seed: int = 0, dtype: str = "uint16",
                 eval_fraction: float = 0.1) -> None:
        require(0.0 < eval_fraction < 1.0, "--data.eval-fraction", "a fraction strictly between 0 and 1",
                 eval_fraction, "pass e.g. --data.eval-fraction 0.1")
        require(seed >= 0, "--data.seed", "an integer >= 0", seed, "pass --data.seed 0 or any N >= 0")
        self.path, self.seq_len, self.seed = Path(path), seq_len, seed
        self.tokens = _open_tokens(self.path, dtype)
        n = len(self.tokens)
        boundary = n - int(round(n * eval_fraction))
        self.splits = {"train": (0, boundary), "eval": (boundary, n)}
        for name, (lo, hi) in self.splits.items():
            require(hi - lo >= seq_len + 1, f"the {name} split of token file {self.path}",
                     f"at least seq_len + 1 = {seq_len + 1} tokens",
                     f"{hi - lo} tokens ({n} in the file, eval_fraction={eval_fraction})",
                     "use a longer file, a smaller --model.seq-len, or another --data.eval-fraction")
        # opening costs the same for any size: nothing reads the whole file; with no FILE.json beside it
        # (`python -m job tokenize` writes one) each batch's tokens are checked as they are read
        self.vocab_size: int | None = _described_vocab(self.path, self.tokens)  # None: no FILE.json
        self.limit = self.vocab_size
        self._mask = np.ones(seq_len + 1, np.float32)
        self.width = 1

    def _tokens(self, bits: np.ndarray, split: str) -> np.ndarray:
        lo, hi = self.splits[split]
        offsets = lo + below(bits[:, 0], hi - lo - self.seq_len)
        windows = offsets[:, None] + np.arange(self.seq_len + 1)  # fancy indexing reads only these windows' pages
        tokens = np.asarray(self.tokens[windows])
        _check_vocab(tokens, self.limit, f"token file {self.path}", split,
                     f" (write the file with {_TOKENIZE} to have its vocabulary checked before the first step)")
        return tokens.astype(np.int32)


class RecordFile:
    """Token windows of an ArrayRecord file (`python -m job tokenize IN OUT.arrayrecord`), read through
    grain's random-access ArrayRecord data source.

    Each record holds the file description's `record_tokens` tokens; a row is a window of seq_len + 1 of
    them (window w: tokens [i * seq_len, (i + 1) * seq_len + 1) of record w // k, i = w % k, k =
    (record_tokens - 1) // seq_len windows a record: neighbours share one token, the last target of one
    being the first input of the next). The head (1 - eval_fraction) of the records is the train split: epochs over its windows
    one after another, each in its own order, which is grain's `MapDataset.shuffle(seed).repeat()`
    (its index shuffle seeded by data.seed + the epoch) computed for a block of rows at once: global
    row g = step * global_batch + row of the run is window g of that stream, a pure function of (step,
    row). The tail is the eval split: finite (`size`), read in order, so an evaluation can be one full
    pass over it. Each record a block of rows needs is read once.
    """

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, global_batch: int, seed: int = 0,
                 eval_fraction: float = 0.1) -> None:
        import grain  # grain imports jax: this module imports without it (tests/unit/test_data.py)

        require(0.0 < eval_fraction < 1.0, "--data.eval-fraction", "a fraction strictly between 0 and 1",
                eval_fraction, "pass e.g. --data.eval-fraction 0.1")
        require(0 <= seed < 2**32, "--data.seed", "an integer 0..2**32-1 (grain's shuffle seed)", seed,
                "pass --data.seed 0")
        self.path, self.seq_len, self.global_batch, self.seed = Path(path), seq_len, global_batch, seed
        check_source(str(self.path))
        described = _record_description(self.path)
        self.vocab_size = described["vocab_size"]
        self.limit = self.vocab_size
        record_tokens, self.dtype = described["record_tokens"], described["dtype"]
        self.per_record = (record_tokens - 1) // seq_len
        require(self.per_record >= 1, f"--model.seq-len for records file {self.path}",
                f"at most its {record_tokens} tokens a record less one", seq_len,
                f"pass --model.seq-len {record_tokens - 1} or less, or tokenize again with --record-tokens "
                f"{seq_len + 1}")
        self.records = grain.sources.ArrayRecordDataSource([str(self.path)])
        records = len(self.records)
        held_out = int(round(records * eval_fraction))
        require(records - held_out >= 1 and held_out >= 1, f"records file {self.path}",
                "at least one record in each split", f"{records} records (eval_fraction={eval_fraction})",
                "use a longer file, fewer --record-tokens when tokenizing, or another --data.eval-fraction")
        self.train_windows = (records - held_out) * self.per_record
        self.eval_windows = held_out * self.per_record

    def split_size(self, split: str) -> int | None:
        """The eval split's rows (windows); the train split has no end."""
        return self.eval_windows if split == "eval" else None

    def train_window(self, g: int) -> int:
        """Window of position g of the train stream: epoch g // n in the order of grain's index shuffle."""
        # grain imports jax: this module imports without it
        from grain.experimental import index_shuffle

        epoch, i = divmod(g, self.train_windows)
        return index_shuffle(i, max_index=self.train_windows - 1, seed=(self.seed + epoch) % 2**32, rounds=4)

    def rows(self, split: str, step: int, start: int, stop: int) -> Batch:
        """Train: global rows step * global_batch + [start, stop) of the epoch stream; eval: windows
        [start, stop) of the held-out records (step 0: one pass)."""
        require(split in SPLITS, "split", " or ".join(map(repr, SPLITS)), split, "pass split='train' or 'eval'")
        require(step >= 0 and 0 <= start <= stop, "rows", "step >= 0 and 0 <= start <= stop", (step, start, stop),
                "pass a valid row range")
        if split == "train":
            base = step * self.global_batch
            windows = np.array([self.train_window(base + r) for r in range(start, stop)], np.int64)
        else:
            require(stop <= self.eval_windows, "eval rows", f"within its {self.eval_windows} windows",
                    (start, stop), "read the eval split by its size")
            windows = self.train_windows + np.arange(start, stop, dtype=np.int64)
        tokens = self._windows(windows)
        _check_vocab(tokens, self.limit, f"records file {self.path}", split)
        return {"tokens": tokens, "mask": np.ones(tokens.shape, np.float32)}

    def _windows(self, windows: np.ndarray) -> np.ndarray:
        """int32 [len(windows), seq_len + 1]: each record they lie in read once."""
        if not len(windows):
            return np.zeros((0, self.seq_len + 1), np.int32)
        record, within = np.divmod(windows, self.per_record)
        needed, where = np.unique(record, return_inverse=True)
        # one read each (`__getitems__` starts a thread pool per call: slower for a process's few rows)
        raw = [self.records[int(r)] for r in needed]
        table = np.stack([np.frombuffer(b, self.dtype) for b in raw]).astype(np.int32)
        return table[where[:, None], within[:, None] * self.seq_len + np.arange(self.seq_len + 1)]


def _record_description(path: Path) -> dict:
    """FILE.json of a records file: its dtype, tokens per record and vocabulary (`tokenize` writes it)."""
    try:
        described = json.loads(sidecar(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"records file description {sidecar(path)}", expected="the JSON `python -m job tokenize` "
                          "writes beside an .arrayrecord file (dtype, record_tokens, vocab_size)", found=str(err),
                          fix=f"write the file again with `python -m job tokenize INPUT.txt {path.name}`") from err
    ok = (isinstance(described, dict) and described.get("dtype") in TOKEN_DTYPES
          and isinstance(described.get("record_tokens"), int) and described["record_tokens"] >= 1
          and isinstance(described.get("vocab_size"), int) and described["vocab_size"] >= 1)
    require(ok, f"records file description {sidecar(path)}", "dtype (uint16 or uint32), record_tokens >= 1 and "
            "vocab_size >= 1", described, f"write it again with `python -m job tokenize INPUT.txt {path.name}`")
    return described


def make_source(cfg: DataConfig, *, vocab_size: int, seq_len: int) -> ReverseTask | TokenFile | RecordFile:
    """The source `cfg` names, checked against the model's vocabulary before training starts."""
    if cfg.source == "reverse":
        return ReverseTask(vocab_size, seq_len, cfg.seed, reverse_len=cfg.reverse_len, symbols=cfg.symbols)
    if Path(cfg.source).suffix.lower() == RECORDS_SUFFIX:
        source: TokenFile | RecordFile = RecordFile(cfg.source, seq_len=seq_len, global_batch=cfg.global_batch,
                                                    seed=cfg.seed, eval_fraction=cfg.eval_fraction)
    else:
        source = TokenFile(cfg.source, seq_len=seq_len, seed=cfg.seed, dtype=cfg.dtype,
                           eval_fraction=cfg.eval_fraction)
    if source.vocab_size is None:  # no description: every batch is checked against the model's vocabulary
        source.limit = vocab_size
    require(source.vocab_size is None or source.vocab_size <= vocab_size,
            f"--model.vocab-size for token file {source.path}",
            f"at least the file's vocab_size {source.vocab_size} ({sidecar(source.path).name})",
            f"--model.vocab-size {vocab_size}", f"pass --model.vocab-size {source.vocab_size} (or more)")
    return source
