"""How each attempt of a run went: the one record every backend writes, typed, with its JSON form, one numbering
per run dir, and one rule for a line that cannot be written.

    record = Ended(job="5123", began=1764782000.0, ended=1764782950.0, code=137, outcome=Outcome.FAILED,
                   action=Action.REQUEUE, says="retry 1 of 3, excluding node2", node="node2", process="1",
                   cause="Killed", nodes="node1,node2")
    attempt = note_start(run_dir)  # process 0, at an attempt's start: its number, on record
    append(run_dir, record)        # numbered as the attempt it ends; None, and one warning, where the run dir
                                   # cannot be written (a gs:// error included)
    ended(run_dir)                 # the ended records, oldest first: [Ended(...), ...]
    number(rundir.records(rundir.attempts(run_dir)))  # the attempt in progress (or next): THE attempt number

RUN_DIR/attempts.jsonl, one line per event:

    {"event": "started", "attempt": 1, "time": 1764782001.5}
    {"event": "ended", "job": "5123", "attempt": 1, "began": 1764782000, "ended": 1764782950, "code": 137,
     "outcome": "failed", "node": "node2", "process": "1", "cause": "Killed", "nodes": "node1,node2",
     "action": "requeue", "says": "retry 1 of 3, excluding node2"}
    {"event": "started", "attempt": 2, "time": 1764783010.0}
    {"event": "resumed", "attempt": 2, "time": ..., "step": 41, "from_step": 40, "tier": "persistent", "gap_s": 61.2}

`action` is what was done next (Action: none, requeue, restart, stop), `says` the decision in words. Records
written before `says` existed hold those words in `action`; they are read the same (`Ended.from_json`). An
attempt's number is `number`'s, the one count of the run dir (goodput, the runs table and the Slurm supervisor
all read it): it counts the attempts the record shows, whichever job id or backend wrote them, so a run
submitted again under a new job id, or trained again by hand, goes on from the last number.

Who writes: process 0, at each attempt's start (`note_start`, also in the Slurm job's own record, where the
supervisor learns the run dir) and at the first step after a resume (`note_resumed`: the restart gap); the
Slurm supervisor (deploy/slurm/supervise.py) after each step, through `JobLog`, which keeps a copy in the job's
own record JOB_LOG_DIR/JOBID-attempts.jsonl (JOB_ATTEMPTS: it counts the job's retries across requeues, and
process 0 notes there which process hung, `note_hang`); the TPU pod loop (deploy/tpu/cli.py) after each
attempt, its node the failed worker's host ("pod-a worker 2"), in a gs:// run dir too. What each backend does
next is the attempt policy's (deploy/policy.py). Every append follows one rule (`_appending`): a line that
cannot be written is one warning naming what, where and why, and the caller (training, a supervisor) goes on.

Standard library only at import: the Slurm supervisor imports this module with whatever python3 the batch host
has (etils only for a gs:// run dir). `python -m job runs` shows a run whose newest attempt failed and was not
retried as failed (code); goodput counts the time lost after a failure apart from the time lost after a
preemption (`cause_of_end`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.core import exits, rundir

if TYPE_CHECKING:
    from etils import epath

log = logging.getLogger(__name__)

ENV = "JOB_ATTEMPTS"  # the Slurm job's own record (JobLog), set by the supervisor for the step's tasks
RECORD = rundir.ATTEMPTS
FAILURE, PREEMPTION = "failure", "preemption"


class Outcome(str, enum.Enum):
    """How an attempt ended, by its exit code (job/core/exits.py) or what the backend saw."""

    COMPLETED = "completed"
    PREEMPTED = "preempted"  # exit 75 (saved after a preemption signal), or the machines were taken away
    CONFIGURATION_ERROR = "configuration error"
    STOPPED = "stopped"  # a person asked to stop (Ctrl-C): saved, never retried
    CANCELLED = "cancelled"  # the scheduler cancelled the job (scancel), whatever the code
    FAILED = "failed"

    @classmethod
    def of(cls, code: int) -> Outcome:
        if code == exits.COMPLETED:
            return cls.COMPLETED
        if code == exits.REQUEUE:
            return cls.PREEMPTED
        if code == exits.BAD_INPUT:
            return cls.CONFIGURATION_ERROR
        if code == exits.STOPPED:
            return cls.STOPPED
        return cls.FAILED


class Action(str, enum.Enum):
    """What is done next."""

    NONE = "none"  # the run completed
    REQUEUE = "requeue"  # back through the queue (Slurm), the failed node excluded where there is one
    RESTART = "restart"  # a new attempt in the same allocation (a new Slurm step, a rerun on the TPU slice)
    STOP = "stop"  # not retried: the run ends with the attempt's code

    @classmethod
    def of_words(cls, words: str) -> Action:
        """The action of a record written before `says` existed, from the words its `action` held: 'none',
        'requeued (...)', 'retry 1 of 3, ...', 'rerun (...)', 'restart 1 of 3 ...', 'not retried: ...'."""
        if words in {a.value for a in cls}:
            return cls(words)
        if words.startswith(("retry", "requeued")):
            return cls.REQUEUE
        if words.startswith(("restart", "rerun")):
            return cls.RESTART
        return cls.STOP


@dataclasses.dataclass(frozen=True)
class Ended:
    """One attempt's end, as the backend that ran it saw it: one `ended` line of RUN_DIR/attempts.jsonl."""

    job: str  # the Slurm job id, or the TPU slice's name
    began: float  # when the attempt started and ended (seconds since the epoch)
    ended: float
    code: int  # its exit code: the process that failed first's, not its peers' reactions
    outcome: Outcome
    action: Action  # what was done next
    says: str = ""  # the decision in words: 'retry 1 of 3, excluding node2'
    node: str = "-"  # the failed process's node ('pod-a worker 2' on a TPU slice); '-' when none or unknown
    process: str = "-"  # its JAX process index
    cause: str = ""  # how it failed: srun's words ('Killed'), or the failed worker's last log line
    nodes: str = ""  # the attempt's nodes, comma-separated
    attempt: int = 0  # its number in the run dir (1-based), set by `append`

    @property
    def retried(self) -> bool:
        """A failure that is run again (restarted or requeued)."""
        return self.outcome is Outcome.FAILED and self.action in (Action.RESTART, Action.REQUEUE)

    def to_json(self) -> dict[str, Any]:
        return {"event": "ended", "job": self.job, "attempt": self.attempt, "began": round(self.began, 3),
                "ended": round(self.ended, 3), "code": self.code, "outcome": self.outcome.value, "node": self.node,
                "process": self.process, "cause": self.cause, "nodes": self.nodes, "action": self.action.value,
                "says": self.says}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Ended | None:
        """The `ended` line's record; None for a line no backend wrote (no exit code or no known outcome)."""
        code, outcome = record.get("code"), record.get("outcome")
        if not isinstance(code, int) or outcome not in {o.value for o in Outcome}:
            return None
        words = str(record.get("action", ""))
        said = record.get("says")
        return cls(job=str(record.get("job", "")), began=_seconds(record.get("began")),
                   ended=_seconds(record.get("ended")), code=code, outcome=Outcome(outcome),
                   action=Action.of_words(words), says=str(said) if said is not None else words,
                   node=str(record.get("node") or "-"), process=str(record.get("process") or "-"),
                   cause=str(record.get("cause", "")), nodes=str(record.get("nodes", "")),
                   attempt=int(record.get("attempt") or 0))


def _seconds(value: object, missing: float = 0.0) -> float:
    """A record's time (seconds since the epoch); `missing` where it has none or it is not a number."""
    return float(value) if isinstance(value, int | float) else missing


def number(lines: Iterable[Mapping[str, Any]], *, starting: bool = False) -> int:
    """The attempt number: the one count of a run dir's attempts (RUN_DIR/attempts.jsonl's lines, oldest first;
    a Slurm job's own record, JobLog, counts the same way). Each `started` line opens an attempt; an `ended` line
    closes the open one, or is an attempt of its own where none is open (it ended before it could note its start);
    other lines (`resumed`, `hang`) belong to the attempt they are in. `starting`: the number of an attempt that
    starts now (the one after the newest on record); else that of the attempt in progress (the open one), or, where
    none is open, of the next (what the backend's `ended` line for an attempt that noted no start carries).

    No record (a run dir never started, one written before attempts were noted, or one that could not be read:
    its reader gives no lines) is attempt 1, as is the first `ended` line of a run dir; a torn last line (a killed
    writer's) is no line (`rundir.parse` skips it), so it changes no number."""
    newest, open_ = 0, False
    for line in lines:
        event = line.get("event")
        if event == "started":
            newest, open_ = newest + 1, True
        elif event == "ended":
            newest, open_ = newest if open_ else newest + 1, False
    return newest + 1 if starting or not open_ else newest


def _typed(lines: list[dict[str, Any]]) -> list[Ended]:
    return [e for e in (Ended.from_json(r) for r in lines) if e is not None]


def folder(run_dir: str | os.PathLike[str]) -> Path | epath.Path:
    """The run dir as a path: pathlib's on a disk, etils' for a bucket (gs://)."""
    where = os.fspath(run_dir)
    if "://" not in where:
        return Path(where)
    from etils import epath  # only for a bucket run dir: the Slurm batch host may lack etils otherwise

    return epath.Path(where)


def ended(run_dir: str | os.PathLike[str]) -> list[Ended]:
    """RUN_DIR/attempts.jsonl's `ended` records, oldest first (none where no backend wrote them)."""
    return _typed([r for r in rundir.records(rundir.attempts(folder(run_dir))) if r.get("event") == "ended"])


def _record_of(run_dir: str | os.PathLike[str]) -> str:
    """RUN_DIR/attempts.jsonl in words, for a warning (made without etils, whatever the run dir)."""
    return f"{os.fspath(run_dir).rstrip('/')}/{RECORD}"


_RUN_DIR_FIX = ("`python -m job runs` will not show it", "a run dir this machine can write (a gs:// URL it has "
                "credentials for, or a folder it shares with the workers)")
_JOB_LOG_FIX = "a JOB_LOG_DIR this machine can write (make submit-slurm LOG_DIR=...)"


@contextlib.contextmanager
def _appending(what: str, path: object, then: str, fix: str) -> Iterator[None]:
    """The one rule for every line this module appends (RUN_DIR/attempts.jsonl, the Slurm job's own record): where
    the block raises anything (gcsfs's HTTP and credential errors are not OSError), one warning naming what was
    not recorded, the path and the reason, what follows from it (`then`) and the `fix`; the caller (training, a
    supervisor, the TPU pod loop) goes on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - whatever the storage raises, a record is never worth the run
        log.warning("attempts: expected to %s in %s, found %s: %s; %s. Fix: %s", what, path, type(exc).__name__,
                    getattr(exc, "strerror", None) or exc, then, fix)


def append(run_dir: str | os.PathLike[str], record: Ended) -> Ended | None:
    """`record` as the new last `ended` line of RUN_DIR/attempts.jsonl, numbered as the attempt it ends (`number`).
    The file is read and written back whole (an object in a bucket cannot be appended to): one writer at a time.
    The record written; None, with one warning, where the run dir cannot be read or written: never raises."""
    where = folder(run_dir) if "://" not in os.fspath(run_dir) else None
    if where is not None and not where.is_dir():
        log.warning("attempts: the run dir %s does not exist on this machine (the job stopped before making it, "
                    "or it is a folder of the workers' own): how this attempt ended (exit %s, %s) is in this log "
                    "only, not in `python -m job runs`", where, record.code, record.outcome.value)
        return None
    written = None
    with _appending(f"append how an attempt ended (exit {record.code}, {record.outcome.value})",
                    _record_of(run_dir), *_RUN_DIR_FIX):
        target = rundir.attempts(folder(run_dir))
        old = rundir.text(target)
        numbered = dataclasses.replace(record, attempt=number(rundir.parse(old)))
        rundir.append(target, numbered.to_json(), old)
        written = numbered
    return written


class JobLog:
    """One Slurm job's own record, JOB_LOG_DIR/JOBID-attempts.jsonl (ENV for the job's tasks): process 0's
    `started` lines (where the run dir is) and `hang` lines, and a copy of each `ended` record, which counts the
    job's retries across requeues."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[dict[str, Any]]:
        return rundir.records(self.path)

    def ended(self) -> list[Ended]:
        """This job's `ended` records, oldest first: `Ended`, as the module's `ended` reads a run dir's."""
        return _typed([r for r in self.lines() if r.get("event") == "ended"])

    def failures(self) -> int:
        return sum(1 for e in self.ended() if e.outcome is Outcome.FAILED)

    def run_dir(self) -> str | None:
        """The run dir process 0 noted at its newest start; None before any."""
        started = [r for r in self.lines() if r.get("event") == "started" and isinstance(r.get("run_dir"), str)]
        return str(started[-1]["run_dir"]) if started else None

    def add(self, record: Ended, requeues: int = 0) -> Ended:
        """`record` in RUN_DIR/attempts.jsonl (`append`: numbered there) and here with the same number. Where no run
        dir is known or it cannot be written (one warning), numbered here: `number` over this record's lines, and
        at least `requeues` + 1 (SLURM_RESTART_COUNT: a requeued job whose own record was lost). What was
        recorded; where this record cannot be written either, one more warning, and the caller goes on."""
        run_dir = self.run_dir()
        written = append(run_dir, record) if run_dir is not None else None
        if written is None:
            written = dataclasses.replace(record, attempt=max(number(self.lines()), requeues + 1))
        with _appending(f"copy how attempt {written.attempt} ended (exit {record.code}, {record.outcome.value})",
                        self.path, "the job's retry budget does not count it", _JOB_LOG_FIX):
            with self.path.open("a", encoding="utf-8") as f:
                f.write(rundir.line(written.to_json()))
        return written


def _note(environ: Mapping[str, str], record: Mapping[str, object], what: str, then: str) -> None:
    """One line in the Slurm job's own record (ENV); nothing off Slurm (`_appending` where it cannot be written)."""
    path = environ.get(ENV)
    if not path:
        return
    with _appending(f"note {what}", f"{ENV}={path}", then, _JOB_LOG_FIX), open(path, "a", encoding="utf-8") as f:
        f.write(rundir.line(record))


def note_start(run_dir: str | os.PathLike[str], environ: Mapping[str, str] = os.environ) -> int:
    """Process 0, at an attempt's start: its number (`number`, starting), recorded as a `started` line in
    RUN_DIR/attempts.jsonl and, on Slurm, in the job's own record with where the run dir is (the supervisor records
    the attempt's end there). Where the run dir's record cannot be read, one warning and attempt 1 (what the
    record would say of a run dir without one); where it cannot be written, one warning and the number it read."""
    where = os.fspath(run_dir)
    where = where if "://" in where else os.path.abspath(where)
    now = round(time.time(), 3)
    attempt = 1
    with _appending("note this attempt's start", _record_of(run_dir), *_RUN_DIR_FIX):
        target = rundir.attempts(folder(run_dir))
        old = rundir.text(target)
        attempt = number(rundir.parse(old), starting=True)
        rundir.append(target, {"event": "started", "attempt": attempt, "time": now}, old)
    _note(environ, {"event": "started", "attempt": attempt, "time": now, "run_dir": where}, "this attempt's start",
          f"its end is still in the job's log but not in {_record_of(run_dir)}")
    return attempt


def note_hang(process: int, node: str, where: str, environ: Mapping[str, str] = os.environ) -> None:
    """Process 0, when the watchdog's roll call named the process that is stuck: tell the Slurm supervisor, so the
    attempt's record names that process and node (and a retry moves away from it), not the first process whose
    watchdog ended it (no-op off Slurm)."""
    _note(environ, {"event": "hang", "time": round(time.time(), 3), "process": str(process), "node": node,
                    "where": where}, "the stuck process", "the attempt's record names the first process to exit")


def note_resumed(run_dir: str | os.PathLike[str], step: int, start: int, tier: str, now: float | None = None
                 ) -> dict[str, Any] | None:
    """Process 0, at the first step an attempt completes after resuming: one `resumed` record in
    RUN_DIR/attempts.jsonl, with the restart gap (from the previous attempt's recorded end to this step, the time
    a failure cost before training went on) and the tier the state came from (job.runs.tiers.Tier's words). None
    where no attempt's end is on record (the first attempt, a run off Slurm and TPU) or the run dir cannot be read
    or written (one warning)."""
    now = time.time() if now is None else now
    written = None
    with _appending("record the restart gap", _record_of(run_dir), *_RUN_DIR_FIX):
        target = rundir.attempts(folder(run_dir))
        old = rundir.text(target)
        lines = rundir.parse(old)
        previous = [r for r in lines if r.get("event") == "ended"]
        if not previous:
            return None
        record = {"event": "resumed", "attempt": number(lines), "time": round(now, 3), "step": step,
                  "from_step": start, "tier": tier, "gap_s": round(now - _seconds(previous[-1].get("ended"), now), 3)}
        rundir.append(target, record, old)
        written = record
    return written


def cause_of_end(records: list[Ended], previous_ended_cleanly: bool, since: float) -> str:
    """Why the previous attempt ended: FAILURE or PREEMPTION. The backend's record of an attempt that ended after
    `since` (the previous attempt's start) says it where there is one; otherwise an attempt that wrote its `end`
    goodput record had stopped on purpose (a preemption signal), one that did not was ended by a failure (an
    exception, a crash, a kill)."""
    for record in reversed(records):
        if record.ended >= since:
            return PREEMPTION if record.outcome in (Outcome.PREEMPTED, Outcome.COMPLETED) else FAILURE
    return PREEMPTION if previous_ended_cleanly else FAILURE


__all__ = ["ENV", "FAILURE", "PREEMPTION", "RECORD", "Action", "Ended", "JobLog", "Outcome", "append",
           "cause_of_end", "ended", "folder", "note_hang", "note_resumed", "note_start", "number"]
