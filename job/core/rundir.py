"""A run directory's layout: every file and folder a run writes in RUN_DIR, named here once, and the one reader
of its JSON-lines files.

    RUN_DIR/
      config.json          the resolved config, written at every start (job/train/loop.py)
      provenance.json      one entry per start: command, code, versions, topology (job/runs/provenance.py)
      code-N.diff          the code's uncommitted changes at start N (0: the first), where there were any
      checkpoints/         orbax's steps (job/runs/checkpoint.py); --no-resume moves them to
                           checkpoints.before-fresh-start-TIME/ (job/runs/resume.py)
      metrics.jsonl        one record per logged step and evaluation (job/observe/metrics.py)
      goodput.jsonl        each attempt's start, progress and end (job/observe/goodput.py)
      attempts.jsonl       each attempt: its start (process 0), how it ended (the backend) (job/runs/attempts.py)
      summary.json         an attempt's end: final step, completed, exit code, goodput (job/observe/report.py)
      eval-STEP.json       `python -m job eval` of checkpoint STEP (job/train/trained.py)
      logs/process-N.log   process N's output (job/observe/process_log.py)
      profile/process-N/   process N's trace of `--profile.steps` (job/observe/profile.py)
      metrics.png          `python -m job plot RUN_DIR` (job/observe/plot.py)
      wandb_run_id         the W&B run every attempt resumes (job/observe/metrics.py)
      remat.json           remat auto's choice and what it was chosen for: compiled first (job/train/remat_cache.py)
      events.out.tfevents.*  TensorBoard's, named by tensorboardX
    SWEEP_DIR/
      sweep.json           the sweep's runs, written before the first one starts (job/runs/sweep.py)
      eval_loss.png        `python -m job plot SWEEP_DIR`
      NAME/                each run's RUN_DIR

    path = rundir.metrics(storage.run_path("gs://bucket/run1"))  # gs://bucket/run1/metrics.jsonl
    rundir.records(path)             # its records: [] when missing; a torn line, or one not a JSON object, skipped
    rundir.document(rundir.summary(run_dir))                     # summary.json's value, or None

A path comes back of the type its run dir was given as: an etils.epath.Path (job.core.storage.run_path: a
disk or gs://) or a pathlib.Path. Standard library only: the Slurm supervisor (deploy/slurm/supervise.py)
imports this module with whatever python3 the batch host has.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Protocol, TypeVar

CONFIG = "config.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
GOODPUT = "goodput.jsonl"
ATTEMPTS = "attempts.jsonl"
PROVENANCE = "provenance.json"
CHECKPOINTS = "checkpoints"
FRESH_START = f"{CHECKPOINTS}.before-fresh-start-"  # + the time: where --no-resume moves the old checkpoints
LOGS = "logs"
PROFILE = "profile"
PLOT = "metrics.png"
WANDB_ID = "wandb_run_id"
REMAT = "remat.json"
SWEEP_PLAN = "sweep.json"  # SWEEP_DIR's
SWEEP_PLOT = "eval_loss.png"  # SWEEP_DIR's

P = TypeVar("P", bound=PurePath)  # the run dir's path type (epath.Path, pathlib.Path): what comes back


class Readable(Protocol):
    def read_bytes(self) -> bytes: ...


class Writable(Readable, Protocol):
    def write_text(self, data: str, encoding: str | None = ...) -> Any: ...


def config(run_dir: P) -> P:
    return run_dir / CONFIG


def summary(run_dir: P) -> P:
    return run_dir / SUMMARY


def metrics(run_dir: P) -> P:
    return run_dir / METRICS


def goodput(run_dir: P) -> P:
    return run_dir / GOODPUT


def attempts(run_dir: P) -> P:
    return run_dir / ATTEMPTS


def provenance(run_dir: P) -> P:
    return run_dir / PROVENANCE


def code_diff(start: int) -> str:
    """The name of start `start`'s diff file in RUN_DIR (0: the first start), as provenance.json records it."""
    return f"code-{start}.diff"


def checkpoints(run_dir: P) -> P:
    return run_dir / CHECKPOINTS


def evaluation(run_dir: P, step: int) -> P:
    """`python -m job eval`'s record of checkpoint `step`."""
    return run_dir / f"eval-{step}.json"


def process_log(run_dir: P, process: int) -> P:
    return run_dir / LOGS / f"process-{process}.log"


def trace(run_dir: P, process: int) -> P:
    """Process `process`'s profiler trace folder."""
    return run_dir / PROFILE / f"process-{process}"


def plot(run_dir: P) -> P:
    return run_dir / PLOT


def wandb_id(run_dir: P) -> P:
    return run_dir / WANDB_ID


def remat_choice(run_dir: P) -> P:
    """remat.json: what remat `auto` stood for in the run (job/train/remat_cache.py)."""
    return run_dir / REMAT


def sweep_plan(sweep_dir: P) -> P:
    return sweep_dir / SWEEP_PLAN


def sweep_plot(sweep_dir: P) -> P:
    return sweep_dir / SWEEP_PLOT


# ------------------------------------------------------------------ reading and writing its JSON files
def _read(path: Readable) -> bytes | None:
    """The file's bytes; None when there is no such file."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def records(path: Readable) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, in order: [] when it is missing; a line that is torn (a killed writer's
    last), not JSON, or JSON but not an object is skipped."""
    data = _read(path)
    return [] if data is None else parse(data)


def parse(text: str | bytes) -> list[dict[str, Any]]:
    """The records in a JSON-lines file's text (as `records` reads them)."""
    found = []
    for raw in text.splitlines():
        try:
            record = json.loads(raw)
        except ValueError:  # torn, garbled or blank (a UnicodeDecodeError is a ValueError too)
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def document(path: Readable) -> Any:
    """A JSON file's value (config.json, summary.json, provenance.json); None when it is missing or not JSON."""
    data = _read(path)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def text(path: Readable) -> str:
    """A file's text ("" when it is missing): what `append` writes back after."""
    data = _read(path)
    return "" if data is None else data.decode("utf-8", errors="replace")


def line(record: Mapping[str, object]) -> str:
    """`record` as one line of a JSON-lines file."""
    return json.dumps(record) + "\n"


def append(path: Writable, record: Mapping[str, object], old: str | None = None) -> None:
    """`record` as the new last line of the JSON-lines file `path`, written back whole after `old` (its text as
    just read; read here when not given): an object in a bucket cannot be appended to. A torn last line is
    ended first, so the record never joins it. One writer at a time."""
    old = text(path) if old is None else old
    path.write_text(old + ("\n" if old and not old.endswith("\n") else "") + line(record), encoding="utf-8")
