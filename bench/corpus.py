"""A real-text token file made offline: the Python standard library's own sources, through a byte-level BPE.

    python -m bench.corpus OUT_DIR [--tokens 6000000] [--vocab 16384]

Writes OUT_DIR/stdlib.txt (the sources of this interpreter's standard library, one file after another,
sorted by path), OUT_DIR/tokenizer.json (a byte-level BPE learnt from it, as docs/tokenizers.md builds
one) and OUT_DIR/stdlib.npy with its description (`python -m job tokenize`), at most --tokens tokens.
Nothing is downloaded. Train on it:

    python -m job train --preset gpt2-small --data.source OUT_DIR/stdlib.npy
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
from pathlib import Path

BYTES_PER_TOKEN = 3  # a generous guess for code under a 16k BPE: the text read is what the tokens need


def write_text(out: Path, tokens: int) -> int:
    """The standard library's .py files into `out` until about `tokens` tokens' worth; the bytes written."""
    root = Path(sysconfig.get_paths()["stdlib"])
    budget = tokens * BYTES_PER_TOKEN
    written = 0
    with out.open("w", encoding="utf-8") as f:
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            f.write(text + "\n")
            written += len(text.encode()) + 1
            if written >= budget:
                break
    return written


def train_tokenizer(text: Path, out: Path, vocab: int) -> None:
    """docs/tokenizers.md's byte-level BPE, learnt from `text`."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"], show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(text)], trainer)
    tokenizer.save(str(out))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.corpus")
    p.add_argument("out", type=Path)
    p.add_argument("--tokens", type=int, default=6_000_000, help="about how many tokens (default 6M)")
    p.add_argument("--vocab", type=int, default=16384, help="the BPE's vocabulary (default 16384)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    text, tok, npy = args.out / "stdlib.txt", args.out / "tokenizer.json", args.out / "stdlib.npy"
    size = write_text(text, args.tokens)
    train_tokenizer(text, tok, args.vocab)
    print(f"{size:,} bytes of the standard library's sources in {text}; tokenizer {tok}", flush=True)
    return subprocess.call([sys.executable, "-m", "job", "tokenize", str(text), str(npy), "--tokenizer", str(tok)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
