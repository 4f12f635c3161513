"""The lm task's TASK: what the training loop needs to know about it (see job/task.py)."""

from __future__ import annotations

import sys

from job.core import values
from job.errors import ConfigError
from job.task import Task
from job.tasks.lm import data, model, presets, token_files, tokenizer


def _validate(model_cfg: model.ModelConfig, data_cfg: data.DataConfig, *, rule: str, model_axis: int) -> None:
    model.validate(model_cfg, rule=rule, model_axis=model_axis)
    data.check_source(data_cfg.source)


TOKENIZE_USAGE = ("python -m job tokenize INPUT.txt OUTPUT.npy|OUTPUT.arrayrecord [--record-tokens N] "
                  "[--tokenizer tokenizer.json]")
_TOKENIZE_FLAGS = ("--record-tokens", "--tokenizer")


def _tokenize_args(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the paths, the flags given) of tokenize's arguments; no paths for a flag it does not know (or one
    without its value), so the usage is printed."""
    paths: list[str] = []
    flags: dict[str, str] = {}
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        name, equals, value = arg.partition("=")
        if name in _TOKENIZE_FLAGS and (equals or rest):
            flags[name] = value if equals else rest.pop(0)
        elif arg.startswith("-"):
            return [], flags
        else:
            paths.append(arg)
    return paths, flags


def _tokenize(args: list[str]) -> int:
    """`python -m job tokenize INPUT.txt OUTPUT.npy` (one array), or `OUTPUT.arrayrecord [--record-tokens N]`
    (records of N tokens for grain); byte-level tokens, or `--tokenizer tokenizer.json`'s ids."""
    paths, flags = _tokenize_args(args)
    try:
        record_tokens = values.whole(flags.get("--record-tokens", str(token_files.RECORD_TOKENS)), minimum=1)
    except values.BadValue:
        paths = []  # a count that is no whole number >= 1: the usage
    if len(paths) != 2:
        print(f"usage: {TOKENIZE_USAGE}\nexpected two paths, found {' '.join(['tokenize', *args])!r}",
              file=sys.stderr)
        return 2
    try:
        count = token_files.tokenize_text(paths[0], paths[1], record_tokens=record_tokens,
                                          tokenizer=flags.get("--tokenizer"))
        described = token_files.description(paths[1]) or {}
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "--tokenizer" not in flags:
        print(f"wrote {count} byte-level tokens to {paths[1]}")
    else:
        print(f"wrote {count} tokens of {flags['--tokenizer']} to {paths[1]}: a model of them needs "
              f"--model.vocab-size {described['vocab_size']} or more")
    return 0


def _sample(args: list[str]) -> int:
    """`python -m job sample --run-dir D [--prompt TEXT] [--tokens N] [--top-k K] [--tokenizer FILE]`: continue
    a prompt with the trained LM. A run whose token file was written with a tokenizer file reads TEXT and
    prints text through that tokenizer (the file's description names it; --tokenizer when it moved); else
    a byte-level model (vocab >= 256) reads TEXT as UTF-8 bytes and prints text, and a smaller vocabulary
    reads TEXT as token ids ("1 5 7 2") and prints ids."""
    # orbax only to sample: tokenize and every sweep check load this task too
    from job.train import trained

    p = trained.run_dir_parser("sample")  # --run-dir and --step, as eval and export read them
    p.add_argument("--prompt", default="", help="text (a tokenizer's or byte-level models) or space-separated "
                   "token ids")
    p.add_argument("--tokens", type=values.for_argparse(values.whole, fix="pass e.g. --tokens 32"), default=32,
                   help="how many tokens to add (default 32)")
    p.add_argument("--top-k", type=values.for_argparse(values.whole, minimum=1, fix="pass e.g. --top-k 8 (1: greedy)"),
                   default=8, help="sample among the k likeliest tokens (1: greedy)")
    p.add_argument("--seed", type=values.for_argparse(values.integer, fix="pass e.g. --seed 0"), default=0)
    p.add_argument("--ema", action="store_true", help="the EMA's parameters (runs with --ema.decay)")
    p.add_argument("--tokenizer", default=None, help="the tokenizer.json the run's token file was written with "
                   "(default: the one its description names)")
    opts = p.parse_args(args)
    try:
        net, cfg = trained.load_model(opts.run_dir, opts.step, ema=opts.ema)
        if not isinstance(net, model.Transformer):  # the run of another task: its model has no tokens to sample
            raise ConfigError("--run-dir", expected="a run of the lm task (its model a Transformer)",
                              found=f"{opts.run_dir}, a run of task {cfg.task} (its model a {type(net).__name__})",
                              fix="pass the --run-dir of an lm run (python -m job train --task lm)")
        vocab = cfg.model.vocab_size
        tok = tokenizer.of_token_file(token_files.description(cfg.data.source), cfg.data.source, opts.tokenizer,
                                      vocab)
        prompt = tok.encode(opts.prompt) if tok else model.encode_prompt(opts.prompt, vocab)
        out = model.sample(net, prompt, tokens=opts.tokens, top_k=opts.top_k, seed=opts.seed)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(tok.decode(out) if tok else model.decode(out, vocab))
    return 0


TASK = Task(
    name="lm",
    model_config=model.ModelConfig,
    data_config=data.DataConfig,
    build=lambda cfg, rngs: model.Transformer(cfg, rngs=rngs),
    loss=lambda m, batch: model.loss_fn(m, batch["tokens"], batch["mask"]),
    source=lambda data_cfg, model_cfg: data.make_source(data_cfg, vocab_size=model_cfg.vocab_size,
                                                        seq_len=model_cfg.seq_len),
    validate=_validate,
    shown=("loss", "accuracy"),
    weight="tokens",
    items_per_row=lambda model_cfg: model_cfg.seq_len,
    unit="tok",
    commands={"tokenize": _tokenize, "sample": _sample},
    presets=presets.PRESETS,
)
