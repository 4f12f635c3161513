"""The one record of how each attempt ended (job/runs/attempts.py): its JSON form, the records written before it
had `says`, one numbering per run dir, and a run dir that cannot be written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from job.core import rundir
from job.observe.status import State, state_of
from job.runs import attempts
from job.runs.attempts import Action, Ended, Outcome

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
