"""A user's first data source written the torch way: each call draws from a generator made once, unseeded,
so asking for the same rows twice gives other rows (the mistake `job` stops at the first step).

    python -m job train --task tests.user_tasks.unseeded:TASK          # exit 2: the rows are not a pure function
    python -m job train --task tests.user_tasks.unseeded:LATE_ROWS     # only rows from 8 on drawn that way
"""

from __future__ import annotations

import dataclasses

import numpy as np

import job.task
from tests.user_tasks import regression


class Rows:
    """x drawn from one generator kept across calls, as a DataLoader's sampler keeps its state."""

    def __init__(self, features: int, fresh_from: int = 0) -> None:
        self.features, self.fresh_from = features, fresh_from
        self.generator = np.random.default_rng()

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        x = np.stack([(self.generator if r >= self.fresh_from else np.random.default_rng([step, r]))
                      .normal(size=self.features) for r in range(start, stop)]).astype(np.float32)
        return {"x": x, "y": x.sum(axis=1)}


TASK = dataclasses.replace(regression.TASK, name="unseeded",
                           source=lambda data_cfg, model_cfg: Rows(model_cfg.features))
# the rows of the second half of a 16-row batch only: on 2 processes, only process 1 asks for them
LATE_ROWS = dataclasses.replace(TASK, source=lambda data_cfg, model_cfg: Rows(model_cfg.features, fresh_from=8))
