"""`make rehearse` for real (python -m deploy.rehearse): the example LM and the classifier pass every check on 2 x 2
and 1 x 4 local CPU processes, and a source that draws fresh randomness on every call fails with the reason."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import explain, run
from tests.multiprocess.test_train import SMALL
from tests.records import check_lines

pytestmark = pytest.mark.multiprocess

REHEARSAL_CHECKS = ("args", "topology", "resume", "eval")


def rehearse(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m deploy.rehearse ARGV`, its temporary folder made in tmp_path."""
    return run([sys.executable, "-m", "deploy.rehearse", *argv], timeout=300, TMPDIR=str(tmp_path))


def assert_every_check_ok(proc: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert proc.returncode == 0, explain(proc)
    lines = check_lines(proc.stdout)
    assert list(lines) == list(REHEARSAL_CHECKS), proc.stdout
    assert all(line.startswith("ok    ") for line in lines.values()), proc.stdout
    assert proc.stdout.splitlines()[0].startswith("rehearse: ARGS as given, but --steps 6 --eval-every 6 ")
    assert list(tmp_path.glob("rehearse-*")) == []  # every check passed: its folder is removed


def test_the_example_lm_passes_every_check_and_leaves_nothing_behind(tmp_path: Path) -> None:
    assert_every_check_ok(rehearse(tmp_path, "train", *SMALL), tmp_path)


def test_the_classifier_passes_every_check_given_as_makes_args_its_resume_on_the_schedule_of_s_steps(
        tmp_path: Path) -> None:
    # past a 1-step warmup the schedule decays over its horizon: the run stopped at step 3 trains steps 1-3 at the
    # learning rates of a run of 6 steps (--optim.decay-steps 6), or its resume would differ from step 4 on
    assert_every_check_ok(rehearse(tmp_path, "--args", "train --task classify --optim.warmup-steps 1"), tmp_path)


def test_a_source_with_fresh_randomness_on_every_call_fails_saying_why_and_keeps_its_runs(tmp_path: Path) -> None:
    proc = rehearse(tmp_path, "train", "--task", "tests.user_tasks.unseeded:TASK")
    assert proc.returncode == 1, explain(proc)
    lines = check_lines(proc.stdout)
    assert lines["args"].startswith("ok    args: task tests.user_tasks.unseeded:TASK")
    assert lines["topology"].startswith(
        "FAIL  topology: the 2 x 2 run exited 2: ConfigError: the task's rows: expected rows(split, step, start, stop) "
        "a pure function of its arguments"), proc.stdout
    assert "asked twice" in lines["topology"] and "Fix: draw the rows' randomness from job.random" in lines["topology"]
    out = proc.stdout.splitlines()
    assert "skip  resume: not run: it needs the 2 x 2 run, which failed" in out
    assert "skip  eval: not run: it needs the 2 x 2 run, which failed" in out
    kept = Path(re.search(r"the rehearsal's runs are kept in (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert kept.parent == tmp_path and "ConfigError: the task's rows" in (kept / "2x2.log").read_text()
