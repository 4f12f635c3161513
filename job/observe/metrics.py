"""Where metrics go: one writer interface, three writers. Process 0 creates them (job/observe/report.py).

    writers = open_writers(run_dir, start_step=0, wandb=cfg.wandb, config=to_dict(cfg))
    for w in writers:
        w.scalars(10, "train", {"loss": 2.3, "lr": 1e-3})

- `JsonlWriter`: RUN_DIR/metrics.jsonl, one JSON record per call (what `python -m job plot` reads).
- `TensorBoardWriter`: TensorBoard event files in RUN_DIR (tensorboardX; no TensorFlow needed),
  tags `train/loss`, `eval/loss`, ...: `tensorboard --logdir RUN_DIR`.
- `WandbWriter`: the same scalars and the resolved config to Weights & Biases (`--wandb.project`,
  `WandbConfig`: `TrainConfig.wandb`).

A resumed run starts at its checkpoint's step: records of later steps (written
before a crash, then redone) are dropped from metrics.jsonl, TensorBoard is
told to purge them, and the W&B run of the first attempt is resumed (its id is
kept in RUN_DIR/wandb_run_id).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from etils import epath

from job.core import rundir, storage
from job.core.errors import ConfigError

log = logging.getLogger("job.train")

WANDB_ID_FILE = rundir.WANDB_ID


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    project: str = ""  # also log to this Weights & Biases project ("" = off; needs the `wandb` extra)
    entity: str = ""  # W&B team or user ("" = your default)
    name: str = ""  # display name of the run ("" = W&B picks one)


class MetricWriter(Protocol):
    def scalars(self, step: int, split: str, values: Mapping[str, float]) -> None:
        """Record `values` (name -> number) of `split` ("train" or "eval") at `step`."""

    def flush(self) -> None:
        """Write out whatever is held back (a run that stops early keeps every record so far)."""

    def close(self) -> None: ...


class JsonlWriter:
    """RUN_DIR/metrics.jsonl: `{"step": N, "split": "train", name: value, ...}` per line."""

    def __init__(self, run_dir: Path | epath.Path, start_step: int) -> None:
        path = rundir.metrics(run_dir)
        if start_step and path.exists():  # steps past the checkpoint are trained again: drop their records
            found = rundir.text(path)
            kept = "".join(rundir.line(r) for r in rundir.parse(found) if 0 <= _step_of(r) <= start_step)
            if kept != found:  # and a torn last line, which the next record would join
                path.write_text(kept, encoding="utf-8")
        self._out = storage.Appender(path)  # in gs://, rewritten whole at most every 30 s and at the end

    def scalars(self, step: int, split: str, values: Mapping[str, float]) -> None:
        self._out.write(rundir.line({"step": step, "split": split, **values}))

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self._out.close()


def _step_of(record: Mapping[str, Any]) -> int:
    try:
        return int(record["step"])
    except (ValueError, KeyError, TypeError):
        return -1  # a record without a step: dropped


class TensorBoardWriter:
    """TensorBoard event files in RUN_DIR; a resumed run purges what earlier attempts logged past its start."""

    def __init__(self, run_dir: Path | epath.Path, start_step: int) -> None:
        # ~1 s to import: job/train/config.py imports this module
        from tensorboardX import SummaryWriter

        # the suffix keeps two attempts started within one second (same name otherwise) in two files
        self._writer = SummaryWriter(logdir=str(run_dir), purge_step=start_step + 1 if start_step else None,
                                     flush_secs=30, filename_suffix=f".{time.time_ns()}")

    def scalars(self, step: int, split: str, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(f"{split}/{name}", value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """A W&B run per run directory: requeued attempts resume it (`resume="allow"` with the stored id)."""

    def __init__(self, run_dir: Path | epath.Path, wandb_cfg: WandbConfig, config: Mapping[str, Any]) -> None:
        try:
            import wandb  # optional (the wandb extra): only with --wandb.project
        except ImportError:
            raise ConfigError("--wandb.project", expected="the wandb package installed (the `wandb` extra)",
                              found=f"{wandb_cfg.project} but no wandb module",
                              fix="pip install 'jax-cluster-job[wandb]', or leave --wandb.project out") from None
        id_file = rundir.wandb_id(run_dir)
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
        if not id_file.exists():
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity or None,
                               name=wandb_cfg.name or None, id=run_id, resume="allow", config=dict(config),
                               dir=os.environ.get("WANDB_DIR") or None)
        log.info("W&B run %s (project %s)", run_id, wandb_cfg.project)

    def scalars(self, step: int, split: str, values: Mapping[str, float]) -> None:
        self._run.log({f"{split}/{name}": value for name, value in values.items()}, step=step)

    def flush(self) -> None:
        """W&B sends on its own thread; `close` finishes the run."""

    def close(self) -> None:
        self._run.finish()


def open_writers(run_dir: Path | epath.Path, *, start_step: int, wandb: WandbConfig | None = None,
                 config: Mapping[str, Any] | None = None) -> list[MetricWriter]:
    """The writers of a run: metrics.jsonl and TensorBoard always, W&B when `wandb.project` is set."""
    storage.make_dirs(run_dir)
    writers: list[MetricWriter] = [JsonlWriter(run_dir, start_step), TensorBoardWriter(run_dir, start_step)]
    if wandb is not None and wandb.project:
        writers.append(WandbWriter(run_dir, wandb, config or {}))
    return writers
