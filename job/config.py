"""The training job's configuration: one typed, frozen dataclass tree.

    python -m job train --steps 200 --model.layers 4 --data.global-batch 64

Every field below is a command-line flag (nested ones as `--section.field`).
The resolved config is saved as `config.json` in the run directory.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from job.data import DataConfig
from job.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3  # peak learning rate, reached after the warmup
    warmup_steps: int = 20  # linear warmup from 0
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    clip_norm: float = 1.0  # global gradient norm clip
    b1: float = 0.9  # Adam beta1
    b2: float = 0.98  # Adam beta2


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # save every N steps (and always at the end and on preemption)
    keep: int = 3  # how many of the newest checkpoints to keep
    async_save: bool = True  # write in the background while training continues


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/example"  # checkpoints, metrics.jsonl, config.json, summary.json
    steps: int = 200  # total optimizer steps of the run (a resumed run continues to this)
    seed: int = 0  # parameter initialisation seed
    log_every: int = 10  # log and write metrics every N steps
    eval_every: int = 50  # evaluate on held-out data every N steps (and at the end)
    rule: str = "replicated"  # sharding rule: replicated, fsdp or tensor
    model_axis: int = 1  # devices per tensor-parallel group (the mesh's "model" axis)
    resume: bool = True  # continue from the newest complete checkpoint in run_dir
    watchdog_s: float = 600.0  # no step within this many seconds: dump every stack, exit 86 (0 = off)
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    ckpt: CheckpointConfig = CheckpointConfig()


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_json(cfg: TrainConfig) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def parse(args: list[str]) -> TrainConfig:
    """Command-line flags -> TrainConfig; an unknown flag exits with usage (code 2)."""
    import tyro

    return tyro.cli(TrainConfig, args=args, prog="python -m job train", description=__doc__.split("\n")[0])
