"""The lm task with a Hugging Face tokenizer file: docs/tokenizers.md's blocks run as a user runs them (a BPE
tokenizer trained on a local corpus, `python -m job tokenize --tokenizer`, a few training steps, `sample`),
and what the page says of them holds: the token file is the tokenizer's ids of the whole text, training
ends with a finite loss, sample prints the tokenizer's text of the model's tokens, and a vocabulary too small
for the tokenizer is refused before training. Then the edges: records, long lines, text that is not UTF-8,
a tokenizer that changed, `tokenizers` not installed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from job import __main__ as job_cli
from job.errors import ConfigError
from job.tasks.lm import token_files, tokenizer
from tests import launching
from tests.docs_examples import DOCS, code_blocks
from tests.records import summary, train_losses

PAGE = "tokenizers.md"
PROMPT = "the quick"


def _run_block(argv: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    """One block of the page in `folder`, with this venv's python first on PATH and JAX on the CPU."""
    env = launching.child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                              PYTHONPATH=str(launching.ROOT))
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The page's python blocks, then its bash blocks, in order, in one empty folder: what each printed."""
    folder = tmp_path_factory.mktemp("tokenizers-page")
    said: dict[str, object] = {"folder": folder}
    for block in code_blocks(PAGE, "python"):
        proc = _run_block([sys.executable, "-c", block], folder)
        assert proc.returncode == 0, launching.explain(proc)
    bash = code_blocks(PAGE, "bash")
    assert [b.split()[3] for b in bash] == ["tokenize", "train", "sample"], bash
    for block in bash:
        said[block.split()[3]] = _run_block(["bash", "-e", "-c", block], folder)
    return said


def test_the_page_writes_a_tokenizer_and_a_token_file_of_its_ids_that_decode_to_the_whole_corpus(
        page: dict) -> None:
    folder, made = page["folder"], page["tokenize"]
    assert made.returncode == 0, launching.explain(made)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = np.load(folder / "tokens.npy")
    corpus = (folder / "corpus.txt").read_text(encoding="utf-8")
    assert tokens.dtype == np.uint16 and len(tokens) < len(corpus) / 2  # merges: far fewer tokens than bytes
    assert tok.decode(tokens.tolist()) == corpus
    described = json.loads((folder / "tokens.npy.json").read_text())
    assert described == {"tokens": len(tokens), "vocab_size": tok.get_vocab_size(), "dtype": "uint16",
                         "tokenizer": str((folder / "tokenizer.json").resolve()),
                         "tokenizer_sha256": hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()}
    assert int(tokens.max()) < described["vocab_size"] == 320
    line = f"wrote {len(tokens)} tokens of tokenizer.json to tokens.npy: a model of them needs --model.vocab-size 320"
    assert made.stdout.startswith(line)
    assert made.stdout.strip() in " ".join((DOCS / PAGE).read_text().split()), "the page quotes what tokenize prints"


def test_the_page_trains_the_lm_on_the_token_file_to_a_finite_falling_loss(page: dict) -> None:
    trained = page["train"]
    assert trained.returncode == 0, launching.explain(trained)
    losses = train_losses(page["folder"] / "run")
    assert sorted(losses) == [50, 100] and all(math.isfinite(v) for v in losses.values())
    assert losses[100] < losses[50]
    assert summary(page["folder"] / "run")["completed"] is True


def test_sample_prints_the_run_tokenizers_text_of_the_models_tokens(page: dict) -> None:
    folder, sampled = page["folder"], page["sample"]
    assert sampled.returncode == 0, launching.explain(sampled)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # the model's tokens, drawn as sample draws them (same devices, seed and top-k), decoded here
    script = ("import json, sys; from job.train import trained; from job.tasks.lm import model; "
              "net, cfg = trained.load_model('run'); "
              "print(json.dumps(model.sample(net, json.loads(sys.argv[1]), tokens=16, top_k=8, seed=0)))")
    drawn = _run_block([sys.executable, "-c", script, json.dumps(tok.encode(PROMPT).ids)], folder)
    assert drawn.returncode == 0, launching.explain(drawn)
    ids = json.loads(drawn.stdout.splitlines()[-1])
    assert len(ids) == len(tok.encode(PROMPT).ids) + 16 and max(ids) < tok.get_vocab_size()
    assert sampled.stdout == tok.decode(ids) + "\n"
    assert sampled.stdout.startswith(PROMPT) and "\ufffd" not in sampled.stdout


def test_a_model_vocabulary_below_the_tokenizers_is_refused_before_training_naming_the_flag(page: dict) -> None:
    folder = page["folder"]
    proc = _run_block([sys.executable, "-m", "job", "train", "--run-dir", "small", "--data.source", "tokens.npy",
                       "--model.vocab-size", "64", "--steps", "2"], folder)
    assert proc.returncode == 2, launching.explain(proc)
    error = [line for line in proc.stderr.splitlines() if "--model.vocab-size" in line]
    assert error and "expected at least the file's vocab_size 320" in error[0], proc.stderr
    assert "found '--model.vocab-size 64'" in error[0] and "Fix: pass --model.vocab-size 320" in error[0]
    assert "Traceback" not in proc.stderr and not list((folder / "small").glob("checkpoints/*"))
    assert error[0].removeprefix("ConfigError: ") in " ".join((DOCS / PAGE).read_text().split()), "the page quotes it"


def test_sample_refuses_a_tokenizer_file_that_is_not_the_one_the_data_was_written_with(page: dict) -> None:
    folder = page["folder"]
    other = json.loads((folder / "tokenizer.json").read_text())
    other["added_tokens"][0]["content"] = "[OTHER]"
    (folder / "other.json").write_text(json.dumps(other))
    proc = _run_block([sys.executable, "-m", "job", "sample", "--run-dir", "run", "--tokenizer", "other.json"], folder)
    assert proc.returncode == 2, launching.explain(proc)
    assert "--tokenizer: expected the tokenizer the token file was written with (SHA-256" in proc.stderr
    assert "Fix: pass --tokenizer with that tokenizer.json" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- the writer's edges, in process


def _bpe_file(folder: Path, text: str) -> Path:
    """A small byte-level BPE tokenizer.json trained on `text`, as the page makes one."""
    (folder / "train.txt").write_text(text, encoding="utf-8")
    tok = Tokenizer(BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(folder / "train.txt")], BpeTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


TEXT = "héllo wörld ✓ 日本語 🚀\r\nzweite Zeile: ÄÖÜß\n\n  indented, then a long line " + "abc " * 40 + "\n"


def test_lines_longer_than_a_chunk_and_characters_cut_between_chunks_still_decode_to_the_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer, "CHUNK_TEXT", 7)  # every line in pieces, cut inside multi-byte characters
    path = _bpe_file(tmp_path, TEXT * 20)
    (tmp_path / "in.txt").write_text(TEXT * 3, encoding="utf-8", newline="")
    count = token_files.tokenize_text(tmp_path / "in.txt", tmp_path / "out.npy", tokenizer=path)
    tokens = np.load(tmp_path / "out.npy")
    assert count == len(tokens) > 0 and Tokenizer.from_file(str(path)).decode(tokens.tolist()) == TEXT * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.npy", "out.npy.json", "tokenizer.json",
                                                          "train.txt"]  # no partial or raw file left


def test_records_hold_the_tokenizers_ids_in_order_and_count_the_ones_left_out(tmp_path: Path) -> None:
    path = _bpe_file(tmp_path, TEXT * 20)
    (tmp_path / "in.txt").write_text(TEXT * 5, encoding="utf-8", newline="")
    token_files.tokenize_text(tmp_path / "in.txt", tmp_path / "whole.npy", tokenizer=path)
    token_files.tokenize_text(tmp_path / "in.txt", tmp_path / "t.arrayrecord", tokenizer=path, record_tokens=16)
    whole = np.load(tmp_path / "whole.npy")
    described = json.loads((tmp_path / "t.arrayrecord.json").read_text())
    assert (described["records"], described["left_out_tokens"]) == divmod(len(whole), 16)
    assert described["vocab_size"] == 300 and described["tokenizer"] == str(path.resolve())
    read = grain.sources.ArrayRecordDataSource([str(tmp_path / "t.arrayrecord")])
    stored = np.concatenate([np.frombuffer(read[i], np.uint16) for i in range(len(read))])
    assert np.array_equal(stored, whole[:described["records"] * 16])


def test_text_that_is_not_utf8_is_refused_with_where_and_the_fix_and_nothing_is_written(tmp_path: Path) -> None:
    path = _bpe_file(tmp_path, TEXT)
    (tmp_path / "in.txt").write_bytes(b"fine text\nthen \xff a bad byte\n")
    with pytest.raises(ConfigError) as raised:
        token_files.tokenize_text(tmp_path / "in.txt", tmp_path / "out.npy", tokenizer=path)
    assert raised.value.found == "invalid start byte at byte 15"
    assert "tokenize it without --tokenizer" in raised.value.fix
    assert not list(tmp_path.glob("out.npy*"))


def test_sample_finds_the_run_tokenizer_by_its_description_or_a_moved_copy_and_says_what_is_wrong(
        tmp_path: Path) -> None:
    path = _bpe_file(tmp_path, TEXT)
    recorded = {"tokenizer": str(tmp_path / "gone.json"), "tokenizer_sha256": tokenizer.load(path).sha256}
    assert tokenizer.of_token_file(None, "reverse", None, 32) is None  # synthetic: ids
    assert tokenizer.of_token_file({"tokenizer": "bytes"}, "b.npy", None, 256) is None  # byte-level
    assert tokenizer.of_token_file({**recorded, "tokenizer": str(path)}, "t.npy", None, 300).path == path
    assert tokenizer.of_token_file(recorded, "t.npy", str(path), 300).vocab_size == 300  # moved: --tokenizer
    for described, given, vocab, says in [
        (recorded, None, 300, "Fix: pass --tokenizer PATH: that tokenizer.json where it is now"),
        ({"tokenizer": "bytes"}, str(path), 300, "--tokenizer: expected none: token file t.npy holds byte-level"),
        (recorded, str(path), 256, "expected at most the model's 256 ids (--model.vocab-size), found '300 ids"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            tokenizer.of_token_file(described, "t.npy", given, vocab)


def test_without_the_tokenizers_package_a_tokenizer_file_names_the_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _bpe_file(tmp_path, TEXT)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ConfigError) as raised:
        tokenizer.load(path)
    assert raised.value.fix == tokenizer.INSTALL and "pip install 'tokenizers" in raised.value.fix


def test_the_job_and_the_lm_task_import_without_tokenizers() -> None:
    code = "import sys, job.__main__, job.tasks.lm.task; print([m for m in sys.modules if m.startswith('tokenizers')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("flags", "says"), [
    (["--tokenizer", "missing.json"], "--tokenizer: expected an existing tokenizer.json"),
    (["--tokenizer"], "usage: python -m job tokenize"),
    (["--tokenizer=bad.json"], "--tokenizer: expected a tokenizer.json the tokenizers library reads"),
])
def test_tokenize_with_a_missing_unreadable_or_valueless_tokenizer_is_exit_2_with_the_fix(
        flags: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("some text\n")
    (tmp_path / "bad.json").write_text("{}")
    assert job_cli.main(["tokenize", "in.txt", "out.npy", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("out.npy*"))
