"""A Hugging Face tokenizer file (`tokenizer.json`, the `tokenizers` library): text to the lm task's token ids and back.

    from job.tasks.lm import tokenizer
    tok = tokenizer.load("tokenizer.json")
    ids_n = tok.encode_lines(["first line\\n", "second line\\n"])  # uint16 (uint32 above 65536 ids), one after another
    tok.decode(ids_n.tolist())                                    # the text again (exactly, with a byte-level decoder)
    tok.vocab_size                                                # the smallest --model.vocab-size that holds its ids

`python -m job tokenize INPUT.txt OUTPUT.npy --tokenizer tokenizer.json` writes a token file with it; the
file's description (OUTPUT.npy.json) names the tokenizer and the SHA-256 of its contents, so `python -m job
sample` decodes a run's tokens with the very tokenizer its data was written with. `tokenizers` is imported
only when a tokenizer file is loaded: the byte-level default, training and `import job` never need it.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from job.errors import ConfigError, require

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BYTES = "bytes"  # a token file description's "tokenizer" when its tokens are the text's bytes
UINT16_IDS = 1 << 16  # a vocabulary up to this many ids is stored as uint16, a larger one as uint32
CHUNK_TEXT = 1 << 20  # bytes of text encoded at once (the library's encodings take many times their text's memory)
INSTALL = "pip install 'tokenizers>=0.23.3,<0.24' (the package's tokenizers extra: pip install -e '.[tokenizers]')"


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer file: its path, the SHA-256 of its contents and its vocabulary."""

    path: Path  # absolute
    sha256: str  # of the file's bytes: what a token file's description records
    vocab_size: int  # its largest id + 1, added tokens included
    backend: Tokenizer

    @property
    def dtype(self) -> str:
        """The token dtype its ids are stored as."""
        return "uint16" if self.vocab_size <= UINT16_IDS else "uint32"

    def encode_lines(self, lines: Sequence[str]) -> np.ndarray:
        """The ids of `lines`, each encoded on its own (no special tokens added), one after another."""
        encoded = self.backend.encode_batch_fast(list(lines), add_special_tokens=False)
        if not encoded:
            return np.zeros(0, self.dtype)
        return np.concatenate([np.asarray(e.ids, self.dtype) for e in encoded])

    def encode_file(self, f: BinaryIO, n: int, *, name: str) -> Iterator[np.ndarray]:
        """The ids of the UTF-8 text in binary file `f` up to byte n, about CHUNK_TEXT bytes of whole lines at
        a time (a line longer than that in pieces of CHUNK_TEXT bytes); `name` says which file in errors."""
        utf8 = codecs.getincrementaldecoder("utf-8")()  # a character cut between two pieces is carried over
        lines: list[str] = []
        size = 0
        while f.tell() < n and (piece := f.readline(min(CHUNK_TEXT, n - f.tell()))):
            lines.append(_decoded(utf8, piece, name, f.tell() - len(piece)))
            size += len(piece)
            if size >= CHUNK_TEXT:
                yield self.encode_lines(lines)
                lines, size = [], 0
        lines.append(_decoded(utf8, b"", name, f.tell(), final=True))
        yield self.encode_lines([line for line in lines if line])

    def encode(self, text: str) -> list[int]:
        """The ids of one text (a prompt)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; ids the tokenizer does not have (a model's vocabulary may be larger) are left out."""
        return self.backend.decode([int(i) for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def description(self) -> dict[str, str]:
        """What a token file's description records of the tokenizer that wrote it."""
        return {"tokenizer": str(self.path), "tokenizer_sha256": self.sha256}


def _decoded(utf8: codecs.IncrementalDecoder, piece: bytes, name: str, at: int, final: bool = False) -> str:
    """`piece` (read at byte `at` of file `name`) as text, or one error naming where it is not UTF-8."""
    try:
        return utf8.decode(piece, final=final)
    except UnicodeDecodeError as err:
        raise ConfigError(f"text file {name}", expected="UTF-8 text (a tokenizer file encodes text)",
                          found=f"{err.reason} at byte {at + err.start}",
                          fix="convert it to UTF-8 (iconv -t UTF-8), or tokenize it without --tokenizer "
                              "(byte-level tokens keep any bytes)") from err


def _tokenizers_class(what: str) -> type[Tokenizer]:
    """`tokenizers.Tokenizer`, or one error with the install line."""
    try:
        # only a tokenizer file needs the tokenizers package: the job imports without it
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ConfigError(what, expected="the tokenizers package installed (a tokenizer file is read with it)",
                          found=f"{err}", fix=INSTALL) from err
    return Tokenizer


def load(path: str | os.PathLike[str], *, what: str = "--tokenizer", sha256: str | None = None) -> TextTokenizer:
    """The tokenizer file at `path`; with `sha256` (a token file's description), it must be that very file."""
    file = Path(path).expanduser().resolve()
    require(file.is_file(), what, "an existing tokenizer.json (Tokenizer.save of the tokenizers library writes one)",
            str(path), "check the path")
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    if sha256 is not None and digest != sha256:
        raise ConfigError(what, expected=f"the tokenizer the token file was written with (SHA-256 {sha256[:16]}...)",
                          found=f"{file}, SHA-256 {digest[:16]}...", fix="pass --tokenizer with that tokenizer.json, "
                          "or tokenize the text again with this one and train on the new token file")
    tokenizer_class = _tokenizers_class(what)
    try:
        backend = tokenizer_class.from_file(str(file))
    except Exception as err:  # the library raises a bare Exception for a file it cannot read
        raise ConfigError(what, expected="a tokenizer.json the tokenizers library reads (Tokenizer.save writes one)",
                          found=f"{file}: {err}", fix="save the tokenizer again with tokenizer.save(PATH)") from err
    ids = backend.get_vocab(with_added_tokens=True).values()
    require(bool(ids), what, "a tokenizer with at least one token", f"{file}: an empty vocabulary",
            "train the tokenizer (tokenizer.train) before saving it")
    return TextTokenizer(path=file, sha256=digest, vocab_size=max(ids) + 1, backend=backend)


def of_token_file(described: dict | None, source: str, given: str | None, model_vocab: int) -> TextTokenizer | None:
    """The tokenizer token file `source` was written with (`described`: its description, None when it has
    none), `given` (--tokenizer) in its place, or None: its tokens are bytes or ids, not a tokenizer's."""
    recorded, sha256 = (described or {}).get("tokenizer"), (described or {}).get("tokenizer_sha256")
    if given is not None and recorded == BYTES:
        raise ConfigError("--tokenizer", expected=f"none: token file {source} holds byte-level tokens",
                          found=given, fix="leave out --tokenizer")
    what = "--tokenizer" if given is not None else f"the tokenizer of token file {source}"
    if given is not None:
        path = given
    elif recorded is None or recorded == BYTES:
        return None
    elif not Path(recorded).is_file():
        raise ConfigError(what, expected=f"{recorded}, as the file's description names it", found="no such file",
                          fix="pass --tokenizer PATH: that tokenizer.json where it is now")
    else:
        path = recorded
    tok = load(path, what=what, sha256=sha256 if isinstance(sha256, str) else None)
    require(tok.vocab_size <= model_vocab, what, f"at most the model's {model_vocab} ids (--model.vocab-size)",
            f"{tok.vocab_size} ids in {tok.path}", "pass --tokenizer with the tokenizer.json the run's token file "
            "was written with")
    return tok


__all__ = ["BYTES", "CHUNK_TEXT", "INSTALL", "TextTokenizer", "UINT16_IDS", "load", "of_token_file"]
