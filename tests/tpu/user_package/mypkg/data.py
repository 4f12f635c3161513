"""The rows: points around one centre per class, each row a pure function of (seed, split, step, row)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from job.random import below, row_bits, uniform
from job.task import SPLITS
from mypkg.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 16  # rows per step, summed over all processes: --data.global-batch
    eval_batches: int = 2  # --data.eval-batches
    seed: int = 0  # the data's own seed: --data.seed
    centres: str = ""  # a JSON file, one list of `features` numbers per class (relative: to the working folder, on a
    # TPU pod the unpacked code's, where `make tpu-pod SHIP=data` puts data/); empty: drawn from the seed


class Clusters:
    """rows(split, step, start, stop) -> {"x": float32 [n, features], "label": int32 [n]}."""

    def __init__(self, cfg: DataConfig, model: ModelConfig) -> None:
        self.cfg, self.features, self.classes = cfg, model.features, model.classes
        shape = (model.classes, model.features)
        if cfg.centres:
            self.centres = np.asarray(json.loads(Path(cfg.centres).read_text()), np.float64)
            if self.centres.shape != shape:
                raise ValueError(f"--data.centres {cfg.centres}: expected {shape[0]} centres of {shape[1]} numbers, "
                                 f"found the shape {self.centres.shape}")
        else:
            self.centres = 2.0 * np.random.default_rng(cfg.seed).normal(size=shape)

    def rows(self, split: str, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        f = self.features
        bits = row_bits(self.cfg.seed, SPLITS.index(split), step, start, stop, 1 + 2 * f)
        label = below(bits[:, 0], self.classes)
        u1, u2 = uniform(bits[:, 1:1 + f]), uniform(bits[:, 1 + f:])
        noise = np.sqrt(-2 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)  # Box-Muller: standard normal
        return {"x": (self.centres[label] + noise).astype(np.float32), "label": label.astype(np.int32)}
