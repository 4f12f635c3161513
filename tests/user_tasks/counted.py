"""The regression task (tests/user_tasks/regression.py) with a source that notes every rows() call.

    ROWS_ASKED=/tmp/asked python -m job train --task tests.user_tasks.counted:TASK ...

Each process appends "split step start stop" to ROWS_ASKED.PROCESS for every call: what a source that
reads files or a network would pay for. Without ROWS_ASKED it is the regression task exactly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax

from tests.user_tasks.regression import TASK as REGRESSION
from tests.user_tasks.regression import Rows

ASKED = "ROWS_ASKED"


class CountedRows(Rows):
    def rows(self, split: str, step: int, start: int, stop: int) -> Mapping[str, Any]:
        if os.environ.get(ASKED):
            with open(f"{os.environ[ASKED]}.{jax.process_index()}", "a", encoding="utf-8") as f:
                f.write(f"{split} {step} {start} {stop}\n")
        return super().rows(split, step, start, stop)


TASK = dataclasses.replace(REGRESSION, source=lambda data_cfg, model_cfg: CountedRows(model_cfg.features))
