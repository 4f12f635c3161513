"""A user's data source seeded by the range a process asks for, as one might write it first:
`np.random.default_rng([step, start])` for rows [start, stop). It is a pure function of (split, step, start,
stop), yet on 2 processes row 8 of a 16-row batch starts process 1's range and gets other values than on 1
process: `make rehearse` fails its topology check, naming the first such row and field.

    python -m deploy.rehearse train --task tests.user_tasks.range_seeded:TASK    # FAIL topology: ... global row 8
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tests.user_tasks import regression


class Rows:
    """x drawn from one generator per call, seeded by the call's (split, step, start): the rows of one range."""

    def __init__(self, features: int) -> None:
        self.features = features

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        x = np.random.default_rng([split == "eval", step, start]).normal(size=(stop - start, self.features))
        x = x.astype(np.float32)
        return {"x": x, "y": x.sum(axis=1)}


TASK = dataclasses.replace(regression.TASK, name="range_seeded",
                           source=lambda data_cfg, model_cfg: Rows(model_cfg.features))
