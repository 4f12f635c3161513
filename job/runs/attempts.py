"""How each attempt of a run ended, as the batch script that ran it saw it (slurm/requeue.sh).

On Slurm every attempt ends in the batch script: its exit code, the task that failed first and its node
(from srun's own messages), and what was done (requeued after a preemption, retried away from the node,
not retried). The script appends one `ended` line per attempt to JOB_ATTEMPTS (its log folder's
JOBID-attempts.jsonl, which counts the job's retries) and to RUN_DIR/attempts.jsonl. It learns the run
dir from the `started` line process 0 writes there at each start (`note_start`):

    {"event": "started", "attempt": 2, "time": 1764783000.1, "run_dir": "/shared/runs/lm1"}
    {"event": "ended", "job": "5123", "attempt": 1, "began": 1764782000, "ended": 1764782950, "code": 137,
     "outcome": "failed", "node": "node2", "process": "1", "cause": "Killed", "action": "retry 1 of 3, excluding node2"}

On a Cloud TPU slice the pod loop (deploy/tpu/cli.py) appends the same record after each attempt
(`append_ended`), its node the failed worker's host ("pod-a worker 2"), in a gs:// run dir too.

Outcomes: completed, preempted, failed, configuration error. `python -m job runs` shows a run whose newest
attempt failed and was not retried as failed (code); goodput counts the time lost after a failure apart
from the time lost after a preemption (`cause_of_end`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from job.core import rundir

log = logging.getLogger(__name__)

ENV = "JOB_ATTEMPTS"  # set by slurm/requeue.sh's watch_srun for the tasks
RECORD = rundir.ATTEMPTS
FAILURE, PREEMPTION = "failure", "preemption"


def note_start(run_dir: epath.Path, attempt: int, environ: Mapping[str, str] = os.environ) -> None:
    """Process 0, at an attempt's start: tell the batch script where this run's records are (no-op off Slurm)."""
    path = environ.get(ENV)
    if not path:
        return
    where = str(run_dir) if "://" in str(run_dir) else os.path.abspath(str(run_dir))
    line = json.dumps({"event": "started", "attempt": attempt, "time": round(time.time(), 3), "run_dir": where})
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as exc:
        log.warning("attempts: expected to note this attempt's start in %s=%s, found %s; its end is still in the "
                    "job's log but not in %s/%s", ENV, path, exc.strerror or exc, run_dir, RECORD)


def note_hang(process: int, node: str, where: str, environ: Mapping[str, str] = os.environ) -> None:
    """Process 0, when the watchdog's roll call named the process that is stuck: tell the batch script's supervisor,
    so the attempt's record names that process and node (and a retry moves away from it), not the first process
    whose watchdog ended it (no-op off Slurm)."""
    path = environ.get(ENV)
    if not path:
        return
    line = json.dumps({"event": "hang", "time": round(time.time(), 3), "process": str(process), "node": node,
                       "where": where})
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as exc:
        log.warning("attempts: expected to note the stuck process in %s=%s, found %s", ENV, path,
                    exc.strerror or exc)


def ended(run_dir: epath.Path) -> list[dict[str, Any]]:
    """RUN_DIR/attempts.jsonl's `ended` records, oldest first (none where no backend wrote them)."""
    return [r for r in rundir.records(rundir.attempts(run_dir)) if r.get("event") == "ended"]


def _ended_in(text: str) -> list[dict[str, Any]]:
    return [r for r in rundir.parse(text) if r.get("event") == "ended"]


def append_ended(run_dir: str | os.PathLike[str], record: Mapping[str, Any]) -> dict[str, Any] | None:
    """Append one `ended` record to RUN_DIR/attempts.jsonl: `record`'s fields (job, began, ended, code, outcome,
    node, process, cause, nodes, action) with "event" and "attempt" (the ended records already there + 1).
    The file is read and written back whole (an object in a bucket cannot be appended to): one writer at a time.
    The record written; None, with one warning, where the run dir cannot be written."""
    target = rundir.attempts(epath.Path(run_dir))
    try:
        old = rundir.text(target)
        numbered = {"event": "ended", "job": record.get("job"), "attempt": len(_ended_in(old)) + 1}
        numbered.update((key, value) for key, value in record.items() if key not in numbered)
        rundir.append(target, numbered, old)
    except Exception as exc:  # noqa: BLE001 - gcsfs's HTTP and credential errors are not OSError; the run goes on
        log.warning("attempts: expected to append how this attempt ended (exit %s, %s) to %s, found %s: "
                    "`python -m job runs` will not show it. Fix: a run dir this machine can write (a gs:// URL, or a "
                    "folder it shares with the workers)", record.get("code"), record.get("outcome"), target,
                    getattr(exc, "strerror", None) or exc)
        return None
    return numbered


def note_resumed(run_dir: str | os.PathLike[str], step: int, start: int, tier: str, now: float | None = None
                 ) -> dict[str, Any] | None:
    """Process 0, at the first step an attempt completes after resuming: one `resumed` record in
    RUN_DIR/attempts.jsonl, with the restart gap (from the previous attempt's recorded end to this step, the time
    a failure cost before training went on) and the tier the state came from. None where no attempt's end is on
    record (the first attempt, a run off Slurm and TPU) or the run dir cannot be written."""
    now = time.time() if now is None else now
    target = rundir.attempts(epath.Path(run_dir))
    try:
        old = rundir.text(target)
    except OSError:
        return None
    previous = _ended_in(old)
    if not previous:
        return None
    record = {"event": "resumed", "attempt": len(previous) + 1, "time": round(now, 3), "step": step,
              "from_step": start, "tier": tier, "gap_s": round(now - float(previous[-1].get("ended", now)), 3)}
    try:
        rundir.append(target, record, old)
    except Exception as exc:  # noqa: BLE001 - gcsfs's errors are not OSError; the run goes on
        log.warning("attempts: expected to record the restart gap in %s, found %s", target,
                    getattr(exc, "strerror", None) or exc)
        return None
    return record


def cause_of_end(records: list[dict[str, Any]], previous_ended_cleanly: bool, since: float) -> str:
    """Why the previous attempt ended: FAILURE or PREEMPTION. The batch script's record of an attempt that
    ended after `since` (the previous attempt's start) says it where there is one; otherwise an attempt
    that wrote its `end` goodput record had stopped on purpose (a preemption signal), one that did not was
    ended by a failure (an exception, a crash, a kill)."""
    for record in reversed(records):
        if float(record.get("ended", 0)) >= since:
            return PREEMPTION if record.get("outcome") in ("preempted", "completed") else FAILURE
    return PREEMPTION if previous_ended_cleanly else FAILURE


__all__ = ["ENV", "FAILURE", "PREEMPTION", "RECORD", "append_ended", "cause_of_end", "ended", "note_hang", "note_resumed", "note_start"]
