"""Where a run stands, told from the files it writes, on a local disk or in gs:// (etils.epath).

    state_of("runs/sweep1/lr=1e-3,seed=0")     # RunStatus(state=State.COMPLETED, step=40, total=40, ...)
    pending(sweep)                              # the runs of a sweep that are not completed
    find_runs("runs/sweep1")                    # (name, run dir, values) of every run in a folder

What is read: config.json (`--steps`), summary.json (written at an attempt's end:
`final_step`, `completed`, `goodput`), goodput.jsonl (an `attempt` line at each
start, `progress` at each logged step, `end` at the end), provenance.json (one
entry per start, before the state is restored), metrics.jsonl (the newest
record of each split) and attempts.jsonl (each attempt's start and end, and the
attempt number: job.runs.attempts). The states:

- completed: summary.json says completed, and its final step is config.json's `--steps`;
- preempted: the newest record is an attempt's `end` and summary.json says not completed: an
  attempt ends that way only after a preemption signal (exit 75: saved, to be requeued);
- running: an attempt started, has not ended, and wrote a record less than `stale_s` ago;
- failed: the backend (the Slurm supervisor, the TPU pod loop) recorded the newest attempt's end
  (RUN_DIR/attempts.jsonl, job.runs.attempts) as a failure it did not retry: "failed (exit 137, process 1
  on node2) at step N", "failed (exit 137, process 2 on pod-a worker 2) at step N";
- retrying: the same, retried or restarted (its action) and not yet started again: "retrying at step N (retry 1 of
  3 ...)", the decision's words;
- stopped: stopped with Ctrl-C after saving (summary.json's exit code 130: "stopped at step N (Ctrl-C;
  the same command resumes)"); or an attempt started, did not end, and wrote nothing for `stale_s` (1 hour): it was
  killed, crashed, hung, or refused its input at start. Without the batch script's record its
  files cannot tell a failure from a kill: it reads "stopped at step N";
- cancelled: the Slurm supervisor recorded the newest attempt's end in a job that was cancelled (scancel:
  its tasks saved on SIGTERM, as on a preemption notice, and nothing requeues it): "cancelled at step N
  (scancel; the same command resumes)";
- not started: none of these files.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from job.core import exits, rundir, storage
from job.core.flags import flatten
from job.observe.goodput import read_records
from job.runs import attempts as attempt_records
from job.runs.attempts import Ended, Outcome
from job.runs.sweep import Run, Sweep, Values, load_plan

STALE_S = 3600.0  # an attempt that wrote nothing for this long and did not end has stopped
NOT_VALUES = ("run_dir",)  # config fields that differ between any two runs: not shown as their values


class State(enum.StrEnum):
    COMPLETED = "completed"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FAILED = "failed"
    RETRYING = "retrying"
    STOPPED = "stopped"
    CANCELLED = "cancelled"
    NOT_STARTED = "not started"


@dataclasses.dataclass(frozen=True)
class RunStatus:
    state: State
    step: int = 0  # the newest step the run is known to have reached
    total: int | None = None  # its --steps (config.json)
    attempts: int = 0  # the newest attempt's number (job.runs.attempts.number): 1 where there is no attempt record
    quiet_s: float | None = None  # seconds since its newest record
    latest: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)  # split -> newest record
    goodput: float | None = None  # steps' share of the time: the last ended attempt's, or the running one's so far
    ended: Ended | None = None  # FAILED, RETRYING, CANCELLED: the backend's record of the newest attempt
    interrupted: bool = False  # STOPPED: with Ctrl-C, after a save (exit 130)
    # COMPLETED, and STOPPED or PREEMPTED by its own summary: summary.json, whose train_loss is the last saved
    # step's (a metrics record is only every --log-every steps)
    final: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """'completed', 'running (attempt 2)', 'preempted at step 40', 'stopped at step 30 (quiet 2.1 h)'."""
        if self.state is State.RUNNING:
            return f"running (attempt {self.attempts})" if self.attempts > 1 else "running"
        if self.state is State.FAILED and self.ended is not None:
            return f"failed ({_failure(self.ended)}) at step {self.step}"
        if self.state is State.RETRYING and self.ended is not None:
            return f"retrying at step {self.step} ({self.ended.says} after {_failure(self.ended)})"
        if self.state is State.CANCELLED:
            return f"cancelled at step {self.step} (scancel; the same command resumes)"
        if self.state is State.STOPPED and self.interrupted:
            return f"stopped at step {self.step} (Ctrl-C; the same command resumes)"
        if self.state in (State.PREEMPTED, State.STOPPED):
            quiet = f" (quiet {self.quiet_s / 3600:.1f} h)" if self.state is State.STOPPED and self.quiet_s else ""
            return f"{self.state} at step {self.step}{quiet}"
        return str(self.state)

    def metric(self, name: str) -> float | None:
        """`eval_loss`, `train_loss`, `test_accuracy`, `train_tokens_per_s`: SPLIT_METRIC of the run's summary when
        it ended with one (the last saved step's), else of the newest records."""
        if isinstance(self.final.get(name), int | float) and not isinstance(self.final.get(name), bool):
            return float(self.final[name])
        for split in sorted(self.latest, key=len, reverse=True):
            if name.startswith(split + "_") and isinstance(self.latest[split].get(name[len(split) + 1:]), int | float):
                return float(self.latest[split][name[len(split) + 1:]])
        return None


def _failure(record: Ended) -> str:
    """'exit 137, process 1 on node2' ('... on pod-a worker 2' on a TPU slice) from an attempts.jsonl record."""
    where = f", process {record.process} on {record.node}" if record.node != "-" else ""
    return f"exit {record.code}{where}"


def _newest_by_split(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest of a run's metrics records of each split."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        if isinstance(record.get("split"), str):
            split = record["split"]
            if record.get("step", -1) >= latest.get(split, {}).get("step", -1):
                latest[split] = record
    return latest


def _started(provenance: object) -> list[float]:
    """The start time of each attempt in provenance.json."""
    times = []
    for entry in (provenance or {}).get("attempts", []) if isinstance(provenance, dict) else []:
        try:
            times.append(datetime.datetime.fromisoformat(entry["time"]).timestamp())
        except (KeyError, TypeError, ValueError):
            continue
    return times


def _running_goodput(records: list[dict[str, Any]]) -> float | None:
    """The newest attempt's goodput so far: its steps at their mean step time over its time since it began."""
    begun = next((r for r in reversed(records) if r.get("event") == "attempt"), None)
    last = records[-1] if records else None
    if begun is None or last is None or last is begun or float(last["time"]) <= float(begun["time"]):
        return None
    steps = int(last.get("step", 0)) - int(begun.get("step", 0))
    return round(steps * float(last.get("step_time_s", 0.0)) / (float(last["time"]) - float(begun["time"])), 4)


def state_of(run_dir: str | epath.Path, *, now: float | None = None, stale_s: float = STALE_S) -> RunStatus:
    """Where the run in `run_dir` stands (see the module's docstring for how each state is told)."""
    path = storage.run_path(run_dir)
    now = time.time() if now is None else now
    cfg, summary = rundir.document(rundir.config(path)), rundir.document(rundir.summary(path))
    records = read_records(rundir.goodput(path))
    latest = _newest_by_split(rundir.records(rundir.metrics(path)))
    started = _started(rundir.document(rundir.provenance(path)))
    if not (cfg or summary or records or latest or started):
        return RunStatus(State.NOT_STARTED)
    summary = summary if isinstance(summary, dict) else {}
    total = cfg.get("steps") if isinstance(cfg, dict) and isinstance(cfg.get("steps"), int) else None
    steps = [int(summary.get("final_step") or 0), *(int(r.get("step", 0)) for r in records),
             *(int(r.get("step", 0)) for r in latest.values())]
    newest = max([float(r["time"]) for r in records] + started, default=None)
    attempts = attempt_records.number(rundir.records(rundir.attempts(path)))
    known = RunStatus(State.STOPPED, step=max(steps), total=total, attempts=attempts, latest=latest,
                      quiet_s=None if newest is None else max(0.0, now - newest),
                      goodput=summary["goodput"].get("goodput") if isinstance(summary.get("goodput"), dict) else None)
    if summary.get("completed") is True and (total is None or int(summary.get("final_step") or 0) >= total):
        return dataclasses.replace(known, state=State.COMPLETED, final=summary)
    batch = attempt_records.ended(path)
    ended = batch[-1] if batch and (newest is None or batch[-1].ended >= newest) else None
    if ended is not None and ended.outcome is Outcome.CANCELLED:  # the newest attempt's: nothing started since
        return dataclasses.replace(known, state=State.CANCELLED, ended=ended)
    if ended is not None and ended.outcome in (Outcome.FAILED, Outcome.CONFIGURATION_ERROR):
        return dataclasses.replace(known, state=State.RETRYING if ended.retried else State.FAILED, ended=ended)
    # a start recorded after the newest goodput record (still starting, or ended there) is newer than an end
    last = records[-1] if records else None
    start_after = bool(started) and (last is None or started[-1] > float(last["time"]))
    if last is not None and last.get("event") == "end" and not start_after:
        # an attempt ends with an end record and then its summary; without its own summary it stopped there
        own = (summary.get("goodput") or {}).get("attempt", last.get("attempt")) == last.get("attempt")
        if summary.get("completed") is False and own and summary.get("exit_code") == exits.STOPPED:
            return dataclasses.replace(known, state=State.STOPPED, interrupted=True, final=summary)
        if summary.get("completed") is False and own:
            return dataclasses.replace(known, state=State.PREEMPTED, final=summary)
        return known
    if known.quiet_s is not None and known.quiet_s < stale_s:
        return dataclasses.replace(known, state=State.RUNNING,
                                   goodput=None if start_after else _running_goodput(records))
    return known


def pending(sweep: Sweep, *, now: float | None = None) -> list[Run]:
    """The runs of `sweep` that are not completed (what submitting it again starts or resumes)."""
    return [run for run in sweep.runs if state_of(run.run_dir, now=now).state is not State.COMPLETED]


def find_runs(folder: str | epath.Path) -> list[tuple[str, str, Values]]:
    """(name, run dir, values) of each run in `folder`: a sweep's (sweep.json) in its order, else every
    subfolder holding a config.json, by name, its values the config fields that differ between the runs
    that have them (a field only another task has is no difference), less those it leaves unset (None)."""
    plan = load_plan(folder)
    if plan is not None:
        return [(run.name, run.run_dir, run.values) for run in plan.runs]
    root = storage.run_path(folder)
    try:
        children = sorted(child for child in root.iterdir() if rundir.config(child).exists())
    except OSError:
        return []
    configs = {child.name: flatten(rundir.document(rundir.config(child)) or {}) for child in children}
    names = sorted({n for flat in configs.values() for n in flat} - set(NOT_VALUES))
    differ = [n for n in names
              if len({json.dumps(flat[n], sort_keys=True) for flat in configs.values() if n in flat}) > 1]
    return [(child.name, f"{str(folder).rstrip('/')}/{child.name}",
             tuple((n, _shown(configs[child.name][n])) for n in differ if configs[child.name].get(n) is not None))
            for child in children]


def _shown(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


__all__ = ["NOT_VALUES", "STALE_S", "RunStatus", "State", "find_runs", "pending", "state_of"]
