"""A failed run on a TPU slice: which worker failed first and why; and the count of the retries it spent.

    budget = RetryBudget(cfg.retries)           # RETRIES: reruns after a failure; a preemption never spends one
    failure = find_failure(cfg, runner, code)   # asks every worker how its job ended
    failure.describe()                          # 'exit code 137 (SIGKILL) on worker 2: step 7: loss 2.301'
    failure.where()                             # 'pod-a worker 2': the node attempts.jsonl names
    budget = budget.spend()                     # '1 of 3 retries used'

Whether a failure is rerun is the attempt policy's (deploy/policy.py): the pod loop (deploy/tpu/cli.py)
asks it with `budget.used` and the failure's code.

The exit code `tpu-pod` follows is worker 0's, which is often only its reaction to losing a peer.
Every worker keeps its own job's exit code and when it wrote it (remote.EXIT), so `find_failure` asks
them all (one read-only `ssh --worker=all` per slice) and names the cause as the local launcher does
(job.runtime.procgroup): a worker that crashed (killed by SIGKILL, SIGSEGV, SIGBUS, ...) rather than one
that exited in reaction, else the first to end with a failure.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from deploy.runner import Runner
from deploy.tpu import gcloud, remote
from deploy.tpu.config import TpuConfig
from job.core import exits

_LINE = re.compile(r"^worker (\d+): (?:ended (\d+) ([0-9.]+)|running|none)(?: (.*))?$")


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How the job ended on one worker, as that worker said."""

    process: int  # the worker's JAX process index: slice index x workers per slice + worker
    node: str  # its slice
    worker: int  # its index in the slice
    code: int | None  # its job's exit code; None while the job runs, or when it left none
    ended_at: float  # when the exit code was written (seconds since the epoch); 0 when unknown
    last_line: str  # the last line of its log

    @classmethod
    def parse(cls, line: str, node: str, first_process: int) -> WorkerExit | None:
        """One line of remote.outcome_script's output; None for anything else (ssh's own chatter)."""
        found = _LINE.fullmatch(line.strip())
        if found is None:
            return None
        worker, code, at, last = found.groups()
        return cls(first_process + int(worker), node, int(worker), None if code is None else int(code),
                   float(at or 0), (last or "").strip())


def first_failure(outcomes: Iterable[WorkerExit]) -> WorkerExit | None:
    """The cause among the workers that failed: a crash if any (the others' exits are reactions to it), else the
    first to end; None when no worker ended with a failure."""
    failed = [o for o in outcomes if o.code not in (None, exits.COMPLETED, exits.REQUEUE)]
    crashed = [o for o in failed if o.code is not None and exits.is_crash(o.code)]
    candidates = crashed or failed
    return min(candidates, key=lambda o: (o.ended_at, o.process)) if candidates else None


@dataclasses.dataclass(frozen=True)
class Failure:
    """A run that ended with an exit code other than 0 or 75 on a slice that is still there."""

    code: int  # the failing worker's exit code (worker 0's when no worker said)
    cause: WorkerExit | None  # the worker that failed first; None when no worker said
    multislice: bool = False  # name the slice as well

    @property
    def configuration_error(self) -> bool:
        """Exit 2: bad input, found the same way on every rerun."""
        return self.code == exits.BAD_INPUT

    def describe(self) -> str:
        """'exit code 1 on worker 2: ValueError: ...' (the failing worker's last log line)."""
        if self.cause is None:
            return f"exit code {exits.describe(self.code)} (no worker said which failed first: see every worker's log)"
        where = f"worker {self.cause.process}"
        if self.multislice:
            where += f" (worker {self.cause.worker} of {self.cause.node})"
        return f"exit code {exits.describe(self.code)} on {where}" + (f": {self.cause.last_line}"
                                                                   if self.cause.last_line else "")

    def where(self) -> str | None:
        """The failed worker's host as attempts.jsonl names a node: 'pod-a worker 2'; None when no worker said."""
        return f"{self.cause.node} worker {self.cause.worker}" if self.cause is not None else None


def find_failure(cfg: TpuConfig, runner: Runner, code: int) -> Failure:
    """Ask every worker of every slice how its job ended; the failure that caused the others."""
    outcomes: list[WorkerExit] = []
    for index, node in enumerate(cfg.slice_names):
        argv = gcloud.ssh_all(cfg, remote.outcome_script(cfg), node)
        proc = runner.run(argv, check=False, capture=True, mutating=False)
        outcomes += [o for line in (proc.stdout or "").splitlines()
                     if (o := WorkerExit.parse(line, node, index * cfg.workers)) is not None]
    cause = first_failure(outcomes)
    return Failure(cause.code if cause is not None and cause.code is not None else code, cause,
                   multislice=len(cfg.slice_names) > 1)


@dataclasses.dataclass(frozen=True)
class RetryBudget:
    """RETRIES: how many times a failed run is rerun from its newest checkpoint, and how many it used. A
    preemption (exit 75, or a preempted slice) never spends it; a configuration error (exit 2) is never retried."""

    retries: int  # 0 turns retries off
    used: int = 0

    def spend(self) -> RetryBudget:
        return dataclasses.replace(self, used=self.used + 1)

    def describe(self) -> str:
        """'1 of 3 retries used', 'retries off (RETRIES=0)'."""
        return f"{self.used} of {self.retries} retries used" if self.retries else "retries off (RETRIES=0)"
