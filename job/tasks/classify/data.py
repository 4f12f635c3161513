"""Generated data for the classifier: points on interleaved spiral arms, one class per arm.

Row ``r`` of step ``s`` is a pure function of (seed, split, s, r), drawn from
``np.random.default_rng([seed, split_id, s, r])``: the same global batches on
every topology, and after a resume. Coordinates beyond the first two are noise.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from job.errors import ConfigError
from job.task import SPLITS


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 64  # points per step, summed over all processes
    eval_batches: int = 2  # held-out batches per evaluation (0: no evaluation)
    noise: float = 0.05  # standard deviation of the noise added to every coordinate
    turns: float = 1.0  # how far each arm winds around the centre
    seed: int = 0  # data seed


class Spirals:
    """`rows(split, step, start, stop)` -> {"x": float32 [n, features], "label": int32 [n]}."""

    def __init__(self, cfg: DataConfig, *, features: int, classes: int) -> None:
        self.cfg, self.features, self.classes = cfg, features, classes

    def _row(self, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        label = int(rng.integers(self.classes))
        t = rng.uniform(0.1, 1.0)
        angle = 2 * np.pi * (self.cfg.turns * t + label / self.classes)
        x = rng.normal(0.0, self.cfg.noise, self.features)
        x[:2] += t * np.cos(angle), t * np.sin(angle)
        return x, label

    def rows(self, split: str, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        if split not in SPLITS or step < 0 or not 0 <= start <= stop:
            raise ConfigError("rows", expected=f"split in {SPLITS}, step >= 0, 0 <= start <= stop",
                              found=(split, step, start, stop), fix="pass split='train' or 'eval' and a row range")
        split_id = SPLITS.index(split)
        x = np.empty((stop - start, self.features), np.float32)
        label = np.empty(stop - start, np.int32)
        for i in range(stop - start):
            x[i], label[i] = self._row(np.random.default_rng([self.cfg.seed, split_id, step, start + i]))
        return {"x": x, "label": label}


def validate(cfg: DataConfig) -> None:
    checks = (
        (cfg.global_batch >= 1, "--data.global-batch", "an integer >= 1", cfg.global_batch, "--data.global-batch 64"),
        (cfg.eval_batches >= 0, "--data.eval-batches", "an integer >= 0", cfg.eval_batches, "--data.eval-batches 2"),
        (0 <= cfg.noise < 10, "--data.noise", "a standard deviation 0..10", cfg.noise, "--data.noise 0.05"),
        (0 < cfg.turns <= 10, "--data.turns", "a number of turns in (0, 10]", cfg.turns, "--data.turns 1"),
        (cfg.seed >= 0, "--data.seed", "an integer >= 0", cfg.seed, "--data.seed 0"),
    )
    for ok, flag, expected, found, fix in checks:
        if not ok:
            raise ConfigError(flag, expected=expected, found=found, fix=f"pass {fix}")
