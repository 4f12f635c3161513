"""The lm task with a fault keyed by node name, for the retry tests on the local Slurm cluster.

    NODE_FAULT=node2 NODE_FAULT_STEP=15 python -m job train --task tests.user_tasks.node_fault:TASK ...

The process running on Slurm node NODE_FAULT (SLURMD_NODENAME; '*': on any node) kills itself with SIGKILL
when it is asked for its rows of a train step at or past NODE_FAULT_STEP: on every attempt that runs there,
as a broken host fails every job it gets. With NODE_FAULT_AFTER (a path, such as a checkpoint's folder) it
first waits, up to 120 s, for that path to exist: rows are asked for ahead of the step, so without it the
fault could come while another process still commits an earlier step's save (a path that never appears
ends the process with 97 and a line saying so, not with the fault); NODE_FAULT_SETTLE_S then waits that many
seconds more (a node-local save's copy on its way to a peer). Its last line, `node_fault: SIGKILL at UNIX_TIME`,
dates the kill (bench/recovery.py measures from it). Elsewhere, and without NODE_FAULT, it
is the lm task exactly (the same model, rows and losses), so a retried run can be compared with an
uninterrupted lm run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from job.tasks.lm.task import TASK as LM

NODE, STEP, AFTER, SETTLE = "NODE_FAULT", "NODE_FAULT_STEP", "NODE_FAULT_AFTER", "NODE_FAULT_SETTLE_S"


class FaultyRows:
    """The lm task's rows, but for the faulty node's process past the fault's step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def rows(self, split: str, step: int, start: int, stop: int) -> Mapping[str, Any]:
        node = os.environ.get(NODE)
        if (split == "train" and node in ("*", os.environ.get("SLURMD_NODENAME"))
                and step >= int(os.environ.get(STEP, "1"))):
            deadline = time.monotonic() + 120
            while os.environ.get(AFTER) and not os.path.exists(os.environ[AFTER]):
                if time.monotonic() > deadline:  # not the fault the test waits for: say so, and end otherwise
                    print(f"node_fault: {AFTER}={os.environ[AFTER]} did not appear within 120 s; exiting 97, "
                          "not faulting", file=sys.stderr, flush=True)
                    os._exit(97)
                time.sleep(0.05)
            time.sleep(float(os.environ.get(SETTLE, "0")))  # what runs beside the save it waited for, done too
            print(f"node_fault: SIGKILL at {time.time():.3f}", file=sys.stderr, flush=True)  # the kill's time
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.rows(split, step, start, stop)

    def __getattr__(self, name: str) -> Any:  # the rest of the source's protocol (split sizes), as the lm task's
        return getattr(self.inner, name)


TASK = dataclasses.replace(LM, name="node_fault", source=lambda data, model: FaultyRows(LM.source(data, model)))
