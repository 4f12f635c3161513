"""`make doctor`'s findings: one line per check of a request, in one of three states: ok (it ran and passed),
FAIL (the problem and its fix), or skip (it did not run here: why, and what to install or pass to run it).

    checks = [Check("partition", True, "debug: up, 4 nodes idle"),
              Check("time", False, "TIME=99-00:00:00 is over partition debug's MaxTime 7-00:00:00",
                    fix="TIME=7-00:00:00 or less, or PARTITION=... with a longer MaxTime"),
              Check.skip("fit", "libtpu is not installed here", to_run="pip install -e '.[tpu-fit]'")]
    sys.exit(report(checks))   # prints one line each; 1 when any failed (a skip is neither ok nor a failure)

The Slurm checks live in deploy/slurm/doctor.py, the Cloud TPU ones in deploy/tpu/doctor.py, the local
launcher's in deploy/local/doctor.py. Each module's quick part (no job, no probe) is what the submit path
runs before it queues anything.

Each doctor also checks the run itself (`run_check`), as `python -m job sweep --devices N` checks one: ARGS
(or every run of SWEEP with it) parses, its task imports, its config validates, and its global batch splits
over the devices the request gives the job:

    run_check(("train", "--data.global-batch", "30"), None, Devices(4, "NPROC=2 x DEVICES=2"))
    # FAIL  run: --data.global-batch: expected a multiple of the data-parallel size 4 = 4, found 30 on 4 devices
    #       (NPROC=2 x DEVICES=2). Fix: use --data.global-batch 32
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Iterable, Sequence
from typing import TextIO

from job.core.errors import ConfigError
from job.core.flags import require_command
from job.train import config, sweep_check

RUN = "run"  # the run's check: ARGS (every run of SWEEP with it) as `python -m job train` would start it


@dataclasses.dataclass(frozen=True)
class Check:
    name: str  # what was checked: 'partition', 'time', 'run dir on a compute node', ...
    ok: bool  # it ran and passed; False for a failure and for a check that did not run (`skipped`)
    detail: str  # ok: what was found; skipped: why it did not run; else the problem, the value and what was expected
    fix: str = ""  # failed: what to do about it; skipped: what to install or pass to run it ('' when nothing can)
    skipped: bool = False  # it did not run here: neither ok nor a failure

    def __post_init__(self) -> None:
        if self.ok and self.skipped:
            raise ValueError(f"check {self.name}: expected ok or skipped, found both")

    @classmethod
    def skip(cls, name: str, why: str, to_run: str = "") -> Check:
        """A check that did not run here: `why`, and `to_run` what to install or pass to run it."""
        return cls(name, False, why, fix=to_run, skipped=True)

    @property
    def failed(self) -> bool:
        return not self.ok and not self.skipped

    def line(self) -> str:
        if self.ok:
            return f"ok    {self.name}: {self.detail}"
        if self.skipped:
            return f"skip  {self.name}: {self.detail}" + (f". To run it: {self.fix}" if self.fix else "")
        return f"FAIL  {self.name}: {self.detail}" + (f". Fix: {self.fix}" if self.fix else "")


def report(checks: Iterable[Check], out: TextIO | None = None, before: str = "submitting") -> int:
    """Print each check's line as it comes, then a count of the skipped ones (and what runs each) and of the
    failed ones; 1 when any failed, else 0.

    A skipped check counts neither way: the exit code answers "did a check find something wrong?", which is
    what a submit path or a script asks before it goes on; a check that could not run here (no libtpu, no
    ARGS) found nothing, and stopping a submit for it would punish the machine the doctor runs on. Its line
    and the count say it was not checked, so no one reads a skip as a pass."""
    stream = out if out is not None else sys.stdout
    failures, skipped = 0, []
    for check in checks:
        print(check.line(), file=stream, flush=True)
        failures += check.failed
        if check.skipped:
            skipped.append(check)
    if skipped:
        runs = [f"{check.name}: {check.fix}" for check in skipped if check.fix]
        print(f"{len(skipped)} check(s) skipped ({', '.join(check.name for check in skipped)}): not checked here"
              + (f"; to run them: {'; '.join(runs)}" if runs else ""), file=stream, flush=True)
    if failures:
        print(f"{failures} check(s) failed: fix them before {before}", file=stream, flush=True)
    return 1 if failures else 0


def failed(name: str, exc: ConfigError, where: str = "") -> Check:
    """A ConfigError as a check's FAIL line: the value, what was expected (`where`: on what), the fix."""
    return Check(name, False, f"{exc.what}: expected {exc.expected}, found {exc.found!r}{where}", fix=exc.fix)


@dataclasses.dataclass(frozen=True)
class Devices:
    """The devices a request gives the job, all its processes together, and how they were counted."""

    count: int
    counted: str  # in make's variables: 'NPROC=2 x DEVICES=2', 'NODES=2 x GPUS_PER_NODE=4', 'v4-32: 16 chips'

    def __str__(self) -> str:
        return f"{self.count} device{'' if self.count == 1 else 's'} ({self.counted})"


def run_skipped(devices: Devices) -> Check:
    """The run's line when make was given neither ARGS nor SWEEP."""
    return Check.skip(RUN, "no ARGS given", to_run=f"ARGS='train ...' (its task, config and global batch on "
                      f"{devices} are checked)")


def run_check(args: Sequence[str], sweep: str | None, devices: Devices) -> Check:
    """ARGS, or with SWEEP every run of it, checked here as `python -m job sweep --devices N` checks a run. Any
    error is this check's FAIL line, a task module that does not import included."""
    if not args or args[0] != "train":
        return _not_training(args)
    try:
        return _sweep_runs(sweep, args, devices) if sweep is not None else _one_run(args, devices)
    except ConfigError as exc:
        return failed(RUN, exc)
    except Exception as exc:  # noqa: BLE001 (a task's module may raise anything as it is imported or validates)
        return _raised(exc)


def _one_run(args: Sequence[str], devices: Devices) -> Check:
    cfg = sweep_check.check_args(args)
    try:
        sweep_check.check_mesh(cfg, devices.count)
    except ConfigError as exc:
        return failed(RUN, exc, where=f" on {devices}")
    return Check(RUN, True, _summary(cfg, devices))


def _sweep_runs(spec: str, args: Sequence[str], devices: Devices) -> Check:
    runs = sweep_check.checked_sweep(spec, list(args))  # every run parses and validates: then the devices
    try:
        sweep_check.check_runs(runs, devices.count)
    except ConfigError as exc:
        return failed(RUN, exc, where=f" on {devices}")
    return Check(RUN, True, f"{len(runs.runs)} run(s) of SWEEP: each parses, validates and splits its global batch "
                 f"over {devices}")


def _not_training(args: Sequence[str]) -> Check:
    """ARGS that run no training: empty (python -m job's usage, exit 2), a flag first, or another command."""
    try:
        require_command(args)
    except ConfigError as exc:
        return failed(RUN, exc)
    if not args:
        return Check(RUN, False, "ARGS: expected a command of python -m job first (train, eval, runs, ...), found "
                     "none: python -m job alone prints its usage and exits 2", fix="ARGS='train ...'")
    return Check.skip(RUN, f"ARGS runs `python -m job {args[0]}`, not train (only a training run's flags are "
                      "checked)")


def _raised(exc: Exception) -> Check:
    """An error that is not a ConfigError (a task module that does not import, a validate that raises), at the
    line of the project's code (not importlib's) that raised it."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}:{exc.lineno}"
    else:
        frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if not frame.filename.startswith("<")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown"
    return Check(RUN, False, f"checking ARGS raised {type(exc).__name__}: {exc} (at {where})",
                 fix="correct the code there: every process of the job would fail the same way at its start")


def _summary(cfg: config.TrainConfig, devices: Devices) -> str:
    """'task lm: global batch 32 splits over 4 devices (NPROC=2 x DEVICES=2)'."""
    return f"task {cfg.task}: global batch {cfg.data.global_batch} splits over {devices}"
