"""A doctor's check in its three states (deploy/checks.py): ok, FAIL with its fix, or skipped with its reason and
what runs it; the report counts the skipped ones apart, and only a failure sets the exit code."""

from __future__ import annotations

import io

import pytest

from deploy.checks import Check, report

PASSED = Check("partition", True, "debug: up, 4 nodes idle")
FAILED = Check("time", False, "TIME=99-00:00:00 is over MaxTime 7-00:00:00", fix="TIME=7-00:00:00 or less")
NO_LIBTPU = Check.skip("fit", "libtpu is not installed here", to_run="pip install -e '.[tpu-fit]'")
NOT_TRAIN = Check.skip("run", "ARGS runs `python -m job eval`, not train")


def test_each_state_has_its_own_column_word() -> None:
    assert PASSED.line() == "ok    partition: debug: up, 4 nodes idle"
    assert FAILED.line() == "FAIL  time: TIME=99-00:00:00 is over MaxTime 7-00:00:00. Fix: TIME=7-00:00:00 or less"
    assert NO_LIBTPU.line() == "skip  fit: libtpu is not installed here. To run it: pip install -e '.[tpu-fit]'"
    assert NOT_TRAIN.line() == "skip  run: ARGS runs `python -m job eval`, not train"


def test_a_skipped_check_is_neither_ok_nor_a_failure() -> None:
    assert (NO_LIBTPU.ok, NO_LIBTPU.failed, NO_LIBTPU.skipped) == (False, False, True)
    assert (PASSED.ok, PASSED.failed, FAILED.failed) == (True, False, True)
    with pytest.raises(ValueError, match="expected ok or skipped, found both"):
        Check("fit", True, "compiled", skipped=True)


def test_the_report_counts_the_skipped_apart_and_says_what_runs_them_and_they_do_not_fail_it() -> None:
    out = io.StringIO()
    assert report([PASSED, NO_LIBTPU, NOT_TRAIN], out) == 0
    assert out.getvalue().splitlines()[-1] == (
        "2 check(s) skipped (fit, run): not checked here; to run them: fit: pip install -e '.[tpu-fit]'")
    out = io.StringIO()
    assert report([PASSED, NO_LIBTPU, FAILED], out) == 1
    assert out.getvalue().splitlines()[-2:] == [
        "1 check(s) skipped (fit): not checked here; to run them: fit: pip install -e '.[tpu-fit]'",
        "1 check(s) failed: fix them before submitting"]
    out = io.StringIO()
    assert report([PASSED], out) == 0 and out.getvalue() == PASSED.line() + "\n"
