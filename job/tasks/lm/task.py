"""The lm task's TASK: what the training loop needs to know about it (see job/task.py)."""

from __future__ import annotations

import sys

from job.errors import ConfigError
from job.task import Task
from job.tasks.lm import data, model


def _validate(model_cfg: model.ModelConfig, data_cfg: data.DataConfig, *, rule: str, model_axis: int) -> None:
    model.validate(model_cfg, rule=rule, model_axis=model_axis)
    data.check_source(data_cfg.source)


def _tokenize(args: list[str]) -> int:
    """`python -m job tokenize INPUT.txt OUTPUT.npy`."""
    if len(args) != 2:
        found = " ".join(["tokenize", *args])
        print(f"usage: python -m job tokenize INPUT.txt OUTPUT.npy\nexpected two paths, found {found!r}",
              file=sys.stderr)
        return 2
    try:
        count = data.tokenize_text(args[0], args[1])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} byte-level tokens to {args[1]}")
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
    commands={"tokenize": _tokenize},
)
