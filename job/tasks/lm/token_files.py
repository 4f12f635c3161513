"""`python -m job tokenize`: a text file to a token file the lm task reads, and its description beside it.

    from job.tasks.lm import token_files
    token_files.tokenize_text("corpus.txt", "tokens.npy")                               # byte-level: 0..255
    token_files.tokenize_text("corpus.txt", "tokens.npy", tokenizer="tokenizer.json")   # that tokenizer's ids
    token_files.tokenize_text("corpus.txt", "tokens.arrayrecord", record_tokens=1024)   # records for grain

The description (tokens.npy.json) says what was written: the token count, the vocabulary a model of them
needs (`vocab_size`), the dtype, and the tokenizer (`"bytes"`, or a tokenizer file's path and SHA-256), so
a run checks its --model.vocab-size before its first step and `python -m job sample` decodes with the
tokenizer the data was written with (`job.tasks.lm.tokenizer`). The text is streamed: no host holds it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from job.errors import ConfigError, require
from job.tasks.lm.tokenizer import BYTES, TextTokenizer
from job.tasks.lm.tokenizer import load as load_tokenizer

CHUNK_TOKENS = 1 << 24  # tokens (or bytes) touched at once when writing a file
BYTE_VOCAB = 256  # byte-level tokens: 0..255
RECORDS_SUFFIX = ".arrayrecord"  # a token file of ArrayRecord records, read through grain
RECORD_TOKENS = 1025  # tokens per record `python -m job tokenize` writes by default: one row of a 1024-position model


def sidecar(path: Path) -> Path:
    """FILE.json beside a token file: what `python -m job tokenize` knows of what it wrote."""
    return path.with_name(path.name + ".json")


def tokenize_text(text_path: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
                  record_tokens: int = RECORD_TOKENS, tokenizer: str | os.PathLike[str] | None = None) -> int:
    """The tokens of a text file, streamed; returns the count. Byte-level by default (uint16 values 0..255,
    any bytes kept as they are); with `tokenizer` (a tokenizer.json) that tokenizer's ids of the UTF-8 text
    (uint16, or uint32 above 65536 ids; `job.tasks.lm.tokenizer`).

    OUTPUT.npy: one array. OUTPUT.arrayrecord: records of `record_tokens` tokens each (the text's last
    tokens that fill no whole record are left out), for grain's ArrayRecord data source. The output
    appears only once complete, then its description (OUTPUT.npy.json, OUTPUT.arrayrecord.json) beside
    it (token count, vocabulary size, dtype, tokenizer, and for records the tokens per record), which
    lets a run check the vocabulary at start without reading the file, and `sample` decode its tokens.
    """
    src, dst = Path(text_path), Path(out_path)
    require(src.is_file(), "text file to tokenize", "an existing file", str(src), "check the input path")
    require(dst.suffix in (".npy", RECORDS_SUFFIX), "tokenized output path",
            f"a path ending in .npy or {RECORDS_SUFFIX}", str(dst), f"use {dst.with_suffix('.npy')}")
    require(record_tokens >= 1, "--record-tokens", "an integer >= 1", record_tokens, "pass --record-tokens 1024")
    text_tokenizer = None if tokenizer is None else load_tokenizer(tokenizer)
    n = src.stat().st_size
    dtype = "uint16" if text_tokenizer is None else text_tokenizer.dtype
    described = ({"vocab_size": BYTE_VOCAB, "dtype": dtype, "tokenizer": BYTES} if text_tokenizer is None else
                 {"vocab_size": text_tokenizer.vocab_size, "dtype": dtype, **text_tokenizer.description()})
    chunks = _tokens_of(src, n, text_tokenizer)
    partial = dst.with_name(dst.name + ".partial")
    try:
        if dst.suffix == ".npy":
            written = {"tokens": _write_npy(chunks, partial, dtype, n if text_tokenizer is None else None)}
        else:
            records, left_out = _write_records(chunks, partial, dtype, record_tokens)
            written = {"tokens": records * record_tokens, "record_tokens": record_tokens, "records": records,
                       "left_out_tokens": left_out}
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dst)
    sidecar(dst).write_text(json.dumps({**written, **described}) + "\n")
    return written["tokens"]


def _tokens_of(src: Path, n: int, text_tokenizer: TextTokenizer | None) -> Iterator[np.ndarray]:
    """The tokens of the first n bytes of src (the size it had when tokenizing started), chunk by chunk."""
    with src.open("rb") as f:
        if text_tokenizer is None:
            while f.tell() < n and (chunk := f.read(min(CHUNK_TOKENS, n - f.tell()))):  # never past n
                yield np.frombuffer(chunk, np.uint8).astype(np.uint16)
        else:
            yield from text_tokenizer.encode_file(f, n, name=str(src))
        if f.tell() != n:
            raise ConfigError(f"text file {src}", expected=f"{n} bytes", found=f"{f.tell()} bytes (it shrank while "
                              "read)", fix="tokenize it again once it stops changing")


def _write_npy(chunks: Iterable[np.ndarray], partial: Path, dtype: str, count: int | None) -> int:
    """The chunks' tokens as one .npy array at `partial`; returns their count. `count` unknown (None): they
    are written raw first, then behind the array's header."""
    if count is None:
        raw = partial.with_name(partial.name + ".raw")
        try:
            with raw.open("wb") as f:
                for chunk in chunks:
                    f.write(chunk.astype(dtype).tobytes())
            count = raw.stat().st_size // np.dtype(dtype).itemsize
            with partial.open("wb") as out, raw.open("rb") as f:
                header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (count,)}
                np.lib.format.write_array_header_1_0(out, header)
                shutil.copyfileobj(f, out, CHUNK_TOKENS)
            return count
        finally:
            raw.unlink(missing_ok=True)
    array = np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=(count,))
    pos = 0
    for chunk in chunks:
        array[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    array.flush()
    del array
    return pos


def _write_records(chunks: Iterable[np.ndarray], partial: Path, dtype: str, record_tokens: int) -> tuple[int, int]:
    """(records written, tokens left out): one record per `record_tokens` tokens of the chunks, in order."""
    # grain's dependency, not ours (none on Windows): only writing an .arrayrecord file needs it
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(partial), "group_size:1")  # each record readable on its own
    records, pending = 0, np.zeros(0, dtype)
    try:
        for chunk in chunks:
            pending = np.concatenate([pending, chunk.astype(dtype)])
            whole = len(pending) // record_tokens
            for row in pending[:whole * record_tokens].reshape(whole, record_tokens):
                writer.write(row.tobytes())
            records, pending = records + whole, pending[whole * record_tokens:]
    finally:
        writer.close()
    return records, len(pending)


def description(source: str) -> dict | None:
    """The description of token file `source`, or None (the synthetic task, no such file, or none written)."""
    path = Path(source)
    if source == "reverse" or not sidecar(path).is_file():
        return None
    try:
        found = json.loads(sidecar(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"token file description {sidecar(path)}", expected="the JSON `python -m job tokenize` "
                          "writes", found=str(err), fix=f"delete it, or write the file again with `python -m job "
                          f"tokenize INPUT.txt {path.name}`") from err
    return found if isinstance(found, dict) else None
