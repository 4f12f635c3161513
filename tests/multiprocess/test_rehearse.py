"""`make rehearse` for real (python -m deploy.rehearse): the example LM and the classifier pass every check on 2 x 2
and 1 x 4 local CPU processes; a source that draws fresh randomness on every call, and one seeded by the range a
process asks for, fail with the reason."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import row_contract
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


def test_a_users_source_seeded_by_the_range_start_fails_topology_naming_the_rule_and_the_first_row_and_field(
        tmp_path: Path) -> None:
    """np.random.default_rng([step, start]): a pure function of (split, step, start, stop), so every other check
    passes; but process 1's range starts at row 8, which then differs from row 8 of the 1-process run."""
    proc = rehearse(tmp_path, "train", "--task", "tests.user_tasks.range_seeded:TASK")
    assert proc.returncode == 1, explain(proc)
    lines = check_lines(proc.stdout)
    assert lines["topology"].startswith("FAIL  topology: the train loss of step 1 differs: "), proc.stdout
    assert (f"Fix: {row_contract.CONTRACT}; the task's rows break it at step 0, global row 8, field 'x': asked as "
            "rows [0, 16) and as [8, 16) (the 2nd of 2 ranges) it differs: draw each row's randomness from its "
            "global row index") in lines["topology"], lines["topology"]
    assert [name for name, line in lines.items() if line.startswith("FAIL")] == ["topology"], proc.stdout
