"""The lm task with a fault keyed by node name, for the retry tests on the local Slurm cluster.

    NODE_FAULT=node2 NODE_FAULT_STEP=15 python -m job train --task tests.user_tasks.node_fault:TASK ...

The process running on Slurm node NODE_FAULT (SLURMD_NODENAME; '*': on any node) kills itself with SIGKILL
when it is asked for its rows of a train step at or past NODE_FAULT_STEP: on every attempt that runs there,
as a broken host fails every job it gets. Elsewhere, and without NODE_FAULT, it is the lm task exactly (the
same model, rows and losses), so a retried run can be compared with an uninterrupted lm run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from typing import Any

from job.tasks.lm.task import TASK as LM

NODE, STEP = "NODE_FAULT", "NODE_FAULT_STEP"


class FaultyRows:
    """The lm task's rows, but for the faulty node's process past the fault's step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def rows(self, split: str, step: int, start: int, stop: int) -> Mapping[str, Any]:
        node = os.environ.get(NODE)
        if (split == "train" and node in ("*", os.environ.get("SLURMD_NODENAME"))
                and step >= int(os.environ.get(STEP, "1"))):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.rows(split, step, start, stop)

    def __getattr__(self, name: str) -> Any:  # the rest of the source's protocol (split sizes), as the lm task's
        return getattr(self.inner, name)


TASK = dataclasses.replace(LM, name="node_fault", source=lambda data, model: FaultyRows(LM.source(data, model)))
