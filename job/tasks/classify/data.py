"""Generated data for the classifier: points on interleaved spiral arms, one class per arm.

Row ``r`` of step ``s`` is a pure function of (seed, split, s, r), drawn from
``job.random.row_bits`` (a counter-based hash, computed for a block of rows at
once): the same global batches on every topology, and after a resume.
Coordinates beyond the first two are noise.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from job.errors import ConfigError
from job.random import below, row_bits, uniform
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

    def rows(self, split: str, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        if split not in SPLITS or step < 0 or not 0 <= start <= stop:
            raise ConfigError("rows", expected=f"split in {SPLITS}, step >= 0, 0 <= start <= stop",
                              found=(split, step, start, stop), fix="pass split='train' or 'eval' and a row range")
        # words a row: its arm, its position along the arm, then one per coordinate's noise
        bits = row_bits(self.cfg.seed, SPLITS.index(split), step, start, stop, 2 + self.features)
        label = below(bits[:, 0], self.classes)
        t = 0.1 + 0.9 * uniform(bits[:, 1])
        angle = 2 * np.pi * (self.cfg.turns * t + label / self.classes)
        x = self.cfg.noise * _normal(bits[:, 2:])
        x[:, 0] += t * np.cos(angle)
        x[:, 1] += t * np.sin(angle)
        return {"x": x.astype(np.float32), "label": label.astype(np.int32)}


def _normal(bits: np.ndarray) -> np.ndarray:
    """Standard normal float64, one per word (Box-Muller on its two 32-bit halves)."""
    u1 = ((bits >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32  # in (0, 1): the log is finite
    u2 = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)


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
