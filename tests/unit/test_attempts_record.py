"""The one record of each attempt (job/runs/attempts.py): its JSON form, the records written before it had `says`,
the one attempt number per run dir (goodput, the runs table and the supervisor read it), one rule for a line that
cannot be written, and the tier a restore took read back from it."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from job.core import rundir
from job.observe.status import State, state_of
from job.runs import attempts
from job.runs.attempts import Action, Ended, Outcome
from job.runs.tiers import Origin, Tier

FAILED = Ended("5123", 1764782000.0, 1764782950.25, 137, Outcome.FAILED, Action.REQUEUE,
               "retry 1 of 3, excluding node2", node="node2", process="1", cause="Killed", nodes="node1,node2")


def test_a_record_and_its_json_form_read_back_the_same() -> None:
    line = FAILED.to_json()
    assert list(line) == ["event", "job", "attempt", "began", "ended", "code", "outcome", "node", "process", "cause",
                          "nodes", "action", "says"]
    assert (line["event"], line["outcome"], line["action"], line["says"]) == (
        "ended", "failed", "requeue", "retry 1 of 3, excluding node2")
    assert Ended.from_json(json.loads(json.dumps(line))) == FAILED


@pytest.mark.parametrize(("words", "action", "retried"), [
    ("retry 1 of 3, excluding node2", Action.REQUEUE, True),
    ("restart 1 of 3 in the allocation, on a spare instead of node2", Action.RESTART, True),
    ("requeued (a preemption spends no retry)", Action.REQUEUE, True),
    ("rerun (a preemption spends no retry)", Action.RESTART, True),
    ("none", Action.NONE, False),
    ("not retried: the retry budget is spent (3 of 3)", Action.STOP, False),
    ("not rerun: stopped by `tpu-stop`", Action.STOP, False),
])
def test_a_record_written_before_says_existed_reads_its_action_from_its_words(words: str, action: Action,
                                                                           retried: bool) -> None:
    old = {"event": "ended", "job": "77", "attempt": 1, "began": 1.0, "ended": 2.0, "code": 137,
           "outcome": "failed", "node": "node2", "process": "1", "cause": "Killed", "action": words}
    record = Ended.from_json(old)
    assert record is not None and (record.action, record.says, record.retried) == (action, words, retried)


def test_a_line_no_backend_wrote_is_not_a_record_but_still_counts_for_the_numbering(tmp_path: Path) -> None:
    assert Ended.from_json({"event": "ended", "attempt": 1}) is None
    assert Ended.from_json({"event": "ended", "code": 1, "outcome": "exploded"}) is None
    rundir.attempts(tmp_path).write_text('{"event": "ended", "attempt": 1}\n{"event": "ended", "att')  # torn
    written = attempts.append(tmp_path, FAILED)
    assert written is not None and written.attempt == 2
    assert attempts.ended(tmp_path) == [written]


def test_a_jobs_own_record_reads_its_ended_lines_as_the_run_dirs_do(tmp_path: Path) -> None:
    log = attempts.JobLog(tmp_path / "5-attempts.jsonl")
    written = log.add(FAILED)  # no run dir noted yet: numbered here only
    assert log.ended() == [written] and isinstance(written, Ended)
    assert log.failures() == 1


def test_the_runs_table_reads_the_action_not_the_words(tmp_path: Path) -> None:
    rundir.config(tmp_path).write_text(json.dumps({"steps": 30}))
    restarted = Ended("pod-a", 1.0, 2.0, 139, Outcome.FAILED, Action.RESTART, "again on the same slice")
    assert attempts.append(tmp_path, restarted) is not None
    status = state_of(tmp_path, now=3.0)
    assert (status.state, status.describe()) == (State.RETRYING, "retrying at step 0 (again on the same slice after "
                                                 "exit 139)")
    stopped = Ended("pod-a", 4.0, 5.0, 139, Outcome.FAILED, Action.STOP, "retry budget: none left")
    assert attempts.append(tmp_path, stopped) is not None
    assert state_of(tmp_path, now=6.0).state is State.FAILED  # its words begin with 'retry'; its action is stop


class GatewayTimeout(Exception):
    """What a bucket's client raises for an HTTP error: not an OSError."""


def test_a_run_dir_that_raises_anything_is_one_warning_naming_the_error_and_nothing_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rundir.attempts(tmp_path).write_text(json.dumps(FAILED.to_json()) + "\n")

    def timed_out(*args: object, **kwargs: object) -> None:
        raise GatewayTimeout("504 Gateway Timeout")

    monkeypatch.setattr(rundir, "append", timed_out)
    with caplog.at_level(logging.WARNING):
        assert attempts.append(tmp_path, FAILED) is None
        assert attempts.note_resumed(tmp_path, step=41, start=40, tier="persistent", now=1764783000.0) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("found GatewayTimeout: 504 Gateway Timeout" in s and "Fix: " in s for s in said)
    assert said[0].startswith("attempts: expected to append how an attempt ended (exit 137, failed) in ")
    assert said[1].startswith("attempts: expected to record the restart gap in ")


# ------------------------------------------------------------------------------- the one attempt number
STARTED, ENDED = {"event": "started"}, {"event": "ended"}


@pytest.mark.parametrize(("lines", "in_progress", "next_start"), [
    ([], 1, 1),  # no record: attempt 1
    ([STARTED], 1, 2),  # attempt 1 running
    ([STARTED, ENDED], 2, 2),  # attempt 1 ended: the next is 2
    ([STARTED, ENDED, STARTED, {"event": "resumed"}], 2, 3),  # a resumed line belongs to the attempt it is in
    ([ENDED, ENDED], 3, 3),  # ends only (a record written before starts were noted): one attempt each
    ([STARTED, STARTED], 2, 3),  # trained again by hand after a kill, no backend: each start one attempt
    ([STARTED, ENDED, ENDED, STARTED], 3, 4),  # attempt 2 ended before it could note its start
    ([{"event": "hang"}, {"event": "exploded"}], 1, 1),  # lines of no attempt of their own
])
def test_the_attempt_number_counts_the_starts_and_ends_on_record(lines: list[dict], in_progress: int,
                                                                 next_start: int) -> None:
    assert attempts.number(lines) == in_progress
    assert attempts.number(lines, starting=True) == next_start


def test_a_run_dir_without_a_record_or_with_a_torn_last_line_is_numbered_from_what_reads(tmp_path: Path) -> None:
    assert attempts.number(rundir.records(rundir.attempts(tmp_path))) == 1  # missing: attempt 1
    assert attempts.note_start(tmp_path, environ={}) == 1
    rundir.attempts(tmp_path).write_text(rundir.attempts(tmp_path).read_text() + '{"event": "star')  # a killed writer
    assert attempts.number(rundir.records(rundir.attempts(tmp_path))) == 1  # the torn line is no start
    assert attempts.note_start(tmp_path, environ={}) == 2
    written = attempts.append(tmp_path, FAILED)
    assert written is not None and written.attempt == 2  # the end of the attempt that started second
    assert [r["event"] for r in rundir.records(rundir.attempts(tmp_path))] == ["started", "started", "ended"]


def test_goodput_the_runs_table_and_the_supervisors_copy_read_the_one_number(tmp_path: Path) -> None:
    from job.observe.goodput import Goodput  # the record's module imports nothing of goodput's room

    rundir.config(tmp_path).write_text(json.dumps({"steps": 30}))
    for began in (1.0, 3.0):  # job 5's two attempts, each failed before it noted its start, then a restart by hand
        attempts.append(tmp_path, dataclasses.replace(FAILED, began=began, ended=began + 1, action=Action.RESTART))
    log = tmp_path / "6-attempts.jsonl"
    number = attempts.note_start(tmp_path, environ={attempts.ENV: str(log)})
    timer = Goodput()
    timer.resume(tmp_path, 0, number)
    assert number == 3 and timer.finish()["attempt"] == 3
    status = state_of(tmp_path)
    assert (status.attempts, status.describe()) == (3, "running (attempt 3)")
    copy = attempts.JobLog(log).add(dataclasses.replace(FAILED, job="6", outcome=Outcome.COMPLETED, code=0,
                                                        action=Action.NONE))
    assert copy.attempt == 3 and attempts.ended(tmp_path)[-1].attempt == 3
    assert [r["attempt"] for r in rundir.records(log)] == [3, 3]  # its start and its end, as the run dir numbers


def test_a_job_whose_run_dir_is_unknown_numbers_its_attempts_in_its_own_record_or_by_its_requeues(
        tmp_path: Path) -> None:
    log = attempts.JobLog(tmp_path / "9-attempts.jsonl")
    assert log.add(FAILED).attempt == 1
    assert log.add(FAILED).attempt == 2
    assert log.add(FAILED, requeues=5).attempt == 6  # Slurm knows of more: a requeued job whose record was lost


# ------------------------------------------------------------------------------- one policy for every append
def _blocked(tmp_path: Path) -> Path:
    """A path no one can write: its folder is a file."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "5-attempts.jsonl"


def _warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_unwritable_run_dir_record_is_one_warning_naming_it_and_the_reason_and_the_caller_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rundir.attempts(tmp_path).mkdir()  # the record's name taken by a folder: neither read nor written
    with caplog.at_level(logging.WARNING):
        assert attempts.append(tmp_path, FAILED) is None
        assert attempts.note_start(tmp_path, environ={}) == 1
    said = _warned(caplog)
    assert len(said) == 2 and all(f"in {rundir.attempts(tmp_path)}, found IsADirectoryError: Is a directory" in s
                                  and "Fix: a run dir this machine can write" in s for s in said), said
    assert said[1].startswith("attempts: expected to note this attempt's start in ")


def test_an_unwritable_job_record_is_one_warning_naming_it_and_the_supervisor_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _blocked(tmp_path)
    with caplog.at_level(logging.WARNING):
        written = attempts.JobLog(path).add(FAILED)  # no run dir known, and the job's own record refused
    assert written == dataclasses.replace(FAILED, attempt=1)
    (said,) = _warned(caplog)
    assert said.startswith("attempts: expected to copy how attempt 1 ended (exit 137, failed) in ")
    assert f"in {path}, found NotADirectoryError: Not a directory; " in said and "Fix: a JOB_LOG_DIR" in said, said


def test_an_unwritable_note_for_the_supervisor_is_one_warning_naming_it_and_training_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _blocked(tmp_path)
    (tmp_path / "run").mkdir()
    environ = {attempts.ENV: str(path)}
    with caplog.at_level(logging.WARNING):
        assert attempts.note_start(tmp_path / "run", environ=environ) == 1  # the run dir's record has it
        attempts.note_hang(1, "node2", "step 7", environ=environ)
    said = _warned(caplog)
    assert len(said) == 2 and all(f"in {attempts.ENV}={path}, found NotADirectoryError: Not a directory" in s
                                  for s in said), said
    assert said[0].startswith("attempts: expected to note this attempt's start in ")
    assert said[1].startswith("attempts: expected to note the stuck process in ")
    assert [r["event"] for r in rundir.records(rundir.attempts(tmp_path / "run"))] == ["started"]


# ------------------------------------------------------------------------------- the tier a restore took
@pytest.mark.parametrize("tier", list(Tier))
def test_the_tier_of_a_restore_reads_back_from_the_record_as_the_same_member(tmp_path: Path, tier: Tier) -> None:
    origin = Origin(40, tier, "")
    assert attempts.append(tmp_path, FAILED) is not None
    assert attempts.note_resumed(tmp_path, step=41, start=40, tier=origin.tier.value, now=FAILED.ended + 60) is not None
    (resumed,) = [r for r in rundir.records(rundir.attempts(tmp_path)) if r["event"] == "resumed"]
    assert Tier(json.loads(json.dumps(resumed))["tier"]) is origin.tier


@pytest.mark.parametrize(("words", "tier"), [("node-local", Tier.LOCAL), ("persistent", Tier.PERSISTENT),
                                             ("none (from step 0)", Tier.FRESH)])
def test_the_words_records_on_disk_hold_read_as_tiers(words: str, tier: Tier) -> None:
    assert Tier(words) is tier and tier.value == words
