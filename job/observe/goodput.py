"""Where a run's wall-clock time went: start-up, compilation, steps, input, checkpoints, evaluation.

    timer = Goodput()                     # first thing in the run
    with timer.part("input_wait"):
        batch = upcoming.get(step)
    ...
    record = timer.finish(step=done)      # {"total_s": ..., "steps_s": ..., "goodput": 0.83, ...}

Every part is measured, none is a remainder: `other_s` is what no part
covered, so the parts' sum against `total_s` shows how complete the split is.
`compile_s` is the loop's compile part (the steps compiled ahead, and the wait
for the other processes to have compiled theirs) plus the first training step's
time minus one ordinary step. `checkpoint_s` is what the saves cost: the time
they held the loop, plus what the steps taken while a write ran beside them lost
(each one's time over the median of the steps taken without a write,
`checkpoint_stalls_s`), which `steps_s` then leaves out.

Across requeues of one run directory, process 0 appends to RUN_DIR/goodput.jsonl:
an "attempt" line when a run starts (its number the run dir's attempt record's,
job.runs.attempts.number), a "progress" line whenever it logs a step, and an
"end" line when it stops. The next attempt reads them back: the time
from the previous attempt's last line to its own start is `restart_s`, and the
steps the previous attempt had reached beyond the checkpoint it resumes from
are `redone_steps` (costing `redone_s` at the previous attempt's step time).
Their sum is the time the previous attempt's end lost, counted after a failure
(`lost_to_failures_s`) or after a preemption (`lost_to_preemption_s`) over all
the run's attempts: job.runs.attempts tells which.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from etils import epath

from job.core import rundir, storage
from job.runs import attempts as attempt_records

PARTS = ("startup", "compile", "steps", "input_wait", "checkpoint", "eval", "profile", "logging")
RECORD = rundir.GOODPUT
PLAIN_KEPT = 1024  # the last steps taken without a write beside them, whose median is a step's own time


class Goodput:
    """Timers of one attempt. Not thread-safe: the training loop's thread calls it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self._clock, self._wall = clock, wall
        self.began = clock()
        self.began_wall = wall()
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.first_step_s: float | None = None
        self.steps_timed = 0
        self._plain: collections.deque[float] = collections.deque(maxlen=PLAIN_KEPT)  # steps with no write beside
        self._beside: list[float] = []  # steps beside a write, not yet set against the plain steps' median
        self._stalls = 0.0  # what the steps beside a write lost, those set against the median so far
        self.previous: dict[str, Any] = {}
        self._record: storage.Appender | None = None  # on RUN_DIR/goodput.jsonl (process 0, from `resume`)

    def started(self) -> None:
        """Everything until now (initialisation, preflight, building and restoring the state) is start-up, but
        for the parts timed already (the train step's compile, ahead of the restore)."""
        timed = sum(seconds for name, seconds in self.seconds.items() if name != "startup")
        self.seconds["startup"] = self._clock() - self.began - timed

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Adds the time spent inside the block to part `name`."""
        start = self._clock()
        try:
            yield
        finally:
            self.seconds[name] += self._clock() - start

    @contextlib.contextmanager
    def step(self, *, beside_write: bool = False) -> Iterator[None]:
        """One training step: the first one (compilation included) is kept apart until `finish`. `beside_write`: a
        save's write was running when it began; what it takes over a plain step's median is the save's cost."""
        start = self._clock()
        try:
            yield
        finally:
            took = self._clock() - start
            if self.first_step_s is None:
                self.first_step_s = took
            else:
                self.seconds["steps"] += took
                self.steps_timed += 1
                (self._beside if beside_write else self._plain).append(took)
                if len(self._beside) >= PLAIN_KEPT:
                    self._set_against_median()

    def _set_against_median(self) -> None:
        """Add what the steps beside a write took over the plain steps' median to the stalls (none without a plain
        step to compare with: they stay steps)."""
        if self._plain:
            median = statistics.median(self._plain)
            self._stalls += sum(max(0.0, took - median) for took in self._beside)
            self._beside.clear()

    def stalls(self) -> float:
        """Seconds the steps beside a write lost so far (their time over the plain steps' median)."""
        self._set_against_median()
        return self._stalls

    def finish(self) -> dict[str, Any]:
        """The split of this attempt's time so far (seconds, rounded to ms), and across attempts."""
        total = self._clock() - self.began
        seconds = dict(self.seconds)
        stalls = self.stalls()  # the saves' cost beside the steps, out of the steps into the checkpoint part
        seconds["steps"] -= stalls
        seconds["checkpoint"] += stalls
        if self.first_step_s is not None:  # the first step: one ordinary step (the plain steps' median), the rest
            # is compilation
            ordinary = statistics.median(self._plain) if self._plain else (
                seconds["steps"] / self.steps_timed if self.steps_timed else 0.0)
            ordinary = min(ordinary, self.first_step_s)
            seconds["compile"] += self.first_step_s - ordinary
            seconds["steps"] += ordinary
        result: dict[str, Any] = {"total_s": round(total, 3)}
        result.update({f"{name}_s": round(value, 3) for name, value in seconds.items()})
        result["checkpoint_stalls_s"] = round(stalls, 3)
        result["other_s"] = round(total - sum(seconds.values()), 3)
        result["goodput"] = round(seconds["steps"] / total, 4) if total > 0 else 0.0
        result.update(self.previous)
        return result

    def step_time(self) -> float:
        """Mean seconds of an ordinary step so far (0 before the second step)."""
        return self.seconds["steps"] / self.steps_timed if self.steps_timed else 0.0

    # -------------------------------------------------------------- across attempts (process 0)
    def resume(self, run_dir: Path | epath.Path, start_step: int, attempt: int) -> None:
        """Read earlier attempts' lines from RUN_DIR/goodput.jsonl; append this attempt's start. `attempt`: its
        number, the run dir's attempt record's (job.runs.attempts.note_start)."""
        path = rundir.goodput(run_dir)
        lines = read_records(path)
        attempts = [r for r in lines if r.get("event") == "attempt"]
        last = lines[-1] if lines else None
        previous: dict[str, Any] = {"attempt": attempt}
        lost: dict[str, Any] = {}
        if last is not None:
            begun = max((i for i, r in enumerate(lines) if r.get("event") == "attempt"), default=0)
            reached = max((int(r.get("step", 0)) for r in lines[begun:]), default=0)  # the previous attempt's lines
            redone = max(0, reached - start_step)
            step_s = float(last.get("step_time_s", 0.0))
            previous.update({
                "restart_s": round(max(0.0, self.began_wall - float(last["time"])), 3),
                "redone_steps": redone,
                "redone_s": round(redone * step_s, 3),
            })
            since = float(attempts[-1]["time"]) if attempts else 0.0
            after = attempt_records.cause_of_end(attempt_records.ended(run_dir), last.get("event") == "end", since)
            lost = {"after": after, "lost_s": round(previous["restart_s"] + previous["redone_s"], 3)}
        earlier = [*attempts, lost]
        previous.update({
            "lost_to_failures_s": round(sum(float(r.get("lost_s", 0.0)) for r in earlier
                                            if r.get("after") == attempt_records.FAILURE), 3),
            "lost_to_preemption_s": round(sum(float(r.get("lost_s", 0.0)) for r in earlier
                                              if r.get("after") == attempt_records.PREEMPTION), 3),
            "failed_attempts": sum(r.get("after") == attempt_records.FAILURE for r in earlier),
        })
        self.previous = previous
        self._append(run_dir, {"event": "attempt", "attempt": previous["attempt"], "step": start_step,
                      "time": self.began_wall, **lost})
        self.flush()  # the attempt is on record at once, even if it ends within seconds

    def progress(self, run_dir: Path | epath.Path, step: int, event: str = "progress") -> None:
        """Note that this attempt reached `step` (process 0, when it logs or stops; "end" writes it out)."""
        self._append(run_dir, {"event": event, "attempt": self.previous.get("attempt", 1), "step": step,
                      "time": self._wall(), "step_time_s": round(self.step_time(), 6)})

    def flush(self) -> None:
        """Write out the records held back (in gs:// they are batched)."""
        if self._record is not None:
            self._record.flush()

    def _append(self, run_dir: Path | epath.Path, record: dict[str, Any]) -> None:
        """`record` as the next line of RUN_DIR/goodput.jsonl, opened on the first (and again after an "end")."""
        if self._record is None:
            self._record = storage.Appender(rundir.goodput(run_dir))
        self._record.write(rundir.line(record))
        if record["event"] == "end":
            self._record.close()
            self._record = None


def read_records(path: Path | epath.Path) -> list[dict[str, Any]]:
    """The records of a goodput.jsonl (job.core.rundir.records: a torn line skipped), those with a time;
    [] when there is none."""
    return [r for r in rundir.records(path) if "time" in r]


def describe(split: dict[str, Any]) -> str:
    """One log line: "goodput 71%: steps 10.2 s, compile 3.1 s, ... of 14.4 s"."""
    def said(name: str) -> str:
        text = f"{name.replace('_', ' ')} {split[f'{name}_s']:.1f} s"
        if name == "checkpoint" and split.get("checkpoint_stalls_s"):  # the saves' cost beside the steps, within it
            text += f" ({split['checkpoint_stalls_s']:.1f} s of it steps slowed beside writes)"
        return text

    parts = ", ".join(said(name) for name in (*PARTS, "other"))
    line = f"goodput {split['goodput']:.0%} of {split['total_s']:.1f} s: {parts}"
    if "restart_s" in split:
        line += (f"; attempt {split['attempt']}: {split['restart_s']:.1f} s since the previous one, "
                 f"{split['redone_steps']} steps redone ({split['redone_s']:.1f} s)")
    if split.get("failed_attempts"):
        line += (f"; lost to {split['failed_attempts']} failure(s) {split['lost_to_failures_s']:.1f} s, "
                 f"to preemption {split['lost_to_preemption_s']:.1f} s")
    return line
