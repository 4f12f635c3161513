"""The one attempt policy (deploy/policy.py) as a table, how the Slurm supervisor reads srun's words and
picks a step's nodes (deploy/slurm/supervise.py), and the hang watchdog's roll call (job/runtime/rollcall.py)."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
from pathlib import Path

import pytest

from deploy.policy import Situation, decide
from deploy.runner import Runner
from deploy.slurm.supervise import Allocation, Supervisor, first_failure, step_argv
from job.core import exits, rundir
from job.runs import attempts
from job.runs.attempts import Action, Ended, Outcome
from job.runtime import rollcall
from job.runtime.rollcall import Answer
from tests.doubles import RecordingRunner

# code, retries spent before, spares left, can requeue, node, node answers, same allocation (TPU)
# -> action, spends a retry, excluded node, the words recorded
TABLE = [
    # completed, preempted, bad input: whatever the rest
    (0, 0, 1, True, None, False, False, Action.NONE, False, None, "none"),
    (0, 3, 0, False, "n2", False, True, Action.NONE, False, None, "none"),
    (75, 0, 1, True, "n2", False, False, Action.REQUEUE, False, None, "requeued (a preemption spends no retry)"),
    (75, 3, 0, True, None, False, False, Action.REQUEUE, False, None, "requeued (a preemption spends no retry)"),
    (75, 3, 0, False, None, False, True, Action.RESTART, False, None, "rerun (a preemption spends no retry)"),
    (2, 0, 1, True, "n2", True, False, Action.STOP, False, None, "not retried: the same flags would fail again"),
    (2, 0, 0, False, None, False, True, Action.STOP, False, None, "not retried: the same flags would fail again"),
    (130, 0, 1, True, "n2", True, False, Action.STOP, False, None,
     "not retried: stopped with Ctrl-C after a save; the same command resumes"),
    # failures (1, the watchdog's 86, SIGKILL's 137, SIGSEGV's 139, SIGABRT's 134, SIGTERM's 143): a spare first
    *[(code, 0, 1, True, "n2", False, False, Action.RESTART, True, "n2",
       "restart 1 of 3 in the allocation, on a spare instead of n2") for code in (1, 86, 137, 139, 134, 143)],
    # no spare: requeue away from the node
    (1, 1, 0, True, "n2", False, False, Action.REQUEUE, True, "n2", "retry 2 of 3, excluding n2"),
    (137, 2, -1, True, "n2", False, False, Action.REQUEUE, True, "n2", "retry 3 of 3, excluding n2"),
    # no spare, no requeue: the same nodes when the node answers, else stop
    (1, 0, 0, False, "n2", True, False, Action.RESTART, True, None,
     "restart 1 of 3 in the allocation, on the same nodes (no spare left and the job cannot be requeued; n2 still "
     "answers)"),
    (1, 0, 0, False, "n2", False, False, Action.STOP, False, None,
     "not retried: no spare left, the job cannot be requeued, and n2 does not answer a probe step"),
    # the node is unknown: nothing to exclude, the same nodes
    (1, 0, 1, True, None, False, False, Action.RESTART, True, None, "restart 1 of 3 in the allocation, on the same nodes"),
    # a TPU slice: rerun on it
    (137, 0, 0, False, "worker 2", False, True, Action.RESTART, True, None,
     "restart 1 of 3 in the allocation, on the same nodes"),
    # the budget spent, or off
    (1, 3, 1, True, "n2", True, False, Action.STOP, False, None, "not retried: the retry budget is spent (3 of 3)"),
    (86, 3, 0, False, None, False, True, Action.STOP, False, None, "not retried: the retry budget is spent (3 of 3)"),
]


@pytest.mark.parametrize(("code", "before", "spares", "requeue", "node", "answers", "same", "action", "spends",
                          "exclude", "words"), TABLE)
def test_the_policy_decides_every_exit_code_the_same_way_for_every_backend(
        code: int, before: int, spares: int, requeue: bool, node: str | None, answers: bool, same: bool,
        action: Action, spends: bool, exclude: str | None, words: str) -> None:
    decision = decide(Situation(code, before, 3, spares_left=spares, can_requeue=requeue, node=node,
                                node_answers=answers, same_allocation=same))
    assert (decision.action, decision.spends_retry, decision.exclude, decision.describe()) == (
        action, spends, exclude, words)
    assert decision.outcome is Outcome.of(code)


def test_retries_off_never_restart_a_failure() -> None:
    decision = decide(Situation(1, 0, 0, spares_left=2, can_requeue=True, node="n2"))
    assert decision.action is Action.STOP and decision.describe() == "not retried: retries are off (RETRIES=0)"


@pytest.mark.parametrize("code", [1, 75, 137, 143])
def test_a_person_stopping_the_run_is_an_input_not_a_code_and_nothing_restarts(code: int) -> None:
    decision = decide(Situation(code, 0, 3, spares_left=1, can_requeue=True, node="n2", interrupted=True))
    assert (decision.outcome, decision.action, decision.spends_retry) == (Outcome.STOPPED, Action.STOP, False)
    assert decision.describe() == "not retried: stopped with Ctrl-C after a save; the same command resumes"
    # what stops anyway keeps its own reason, and a run that completed stays completed
    assert decide(Situation(2, 0, 3, interrupted=True)).outcome is Outcome.CONFIGURATION_ERROR
    assert decide(Situation(0, 0, 3, interrupted=True)).action is Action.NONE


@pytest.mark.parametrize(("code", "before", "preempted"), [(1, 0, False), (75, 0, False), (137, 0, False),
                                                          (143, 3, False), (134, 0, True)])
def test_a_person_running_the_stop_command_is_an_input_and_nothing_reruns_whatever_the_budget(
        code: int, before: int, preempted: bool) -> None:
    decision = decide(Situation(code, before, 3, node="pod-a worker 1", same_allocation=True, preempted=preempted,
                                stopped_by="`tpu-stop`"))
    assert (decision.outcome, decision.action, decision.spends_retry) == (Outcome.STOPPED, Action.STOP, False)
    assert decision.describe() == "not retried: stopped by `tpu-stop`; the same command resumes"
    # a run that completed stays completed, and a configuration error keeps its own reason
    assert decide(Situation(0, 0, 3, same_allocation=True, stopped_by="`tpu-stop`")).action is Action.NONE
    stopped_bad = decide(Situation(2, 0, 3, same_allocation=True, stopped_by="`tpu-stop`"))
    assert (stopped_bad.outcome, stopped_bad.describe()) == (Outcome.CONFIGURATION_ERROR,
                                                             "not retried: the same flags would fail again")
    # without it (every other caller), the same situation is decided as before: reruns, or the budget's end
    assert decide(Situation(code, before, 3, node="pod-a worker 1", same_allocation=True,
                            preempted=preempted)).action is (Action.STOP if before == 3 else Action.RESTART)


@pytest.mark.parametrize("code", [1, 137, 255, 75])
def test_machines_taken_away_are_a_preemption_whatever_the_code(code: int) -> None:
    decision = decide(Situation(code, 3, 3, node="pod-a worker 1", same_allocation=True, preempted=True))
    assert (decision.outcome, decision.action, decision.spends_retry) == (Outcome.PREEMPTED, Action.RESTART, False)
    assert decision.describe() == "rerun (a preemption spends no retry)"


@pytest.mark.parametrize(("code", "outcome"), [(0, Outcome.COMPLETED), (2, Outcome.CONFIGURATION_ERROR),
                                               (75, Outcome.PREEMPTED), (86, Outcome.FAILED), (1, Outcome.FAILED),
                                               (130, Outcome.STOPPED),
                                               (137, Outcome.FAILED), (143, Outcome.FAILED), (255, Outcome.FAILED)])
def test_every_exit_code_has_one_outcome(code: int, outcome: Outcome) -> None:
    assert Outcome.of(code) is outcome


@pytest.mark.parametrize(("code", "words"), [(0, "0"), (1, "1"), (2, "2 (a configuration error)"),
                                             (75, "75 (saved and stopped: preempted)"),
                                             (86, "86 (no step within the watchdog's timeout)"), (137, "137 (SIGKILL)"),
                                             (130, "130 (saved and stopped: Ctrl-C)"),
                                             (-9, "-9 (SIGKILL)"), (139, "139 (SIGSEGV)"), (200, "200")])
def test_an_exit_code_is_described_in_words(code: int, words: str) -> None:
    assert exits.describe(code) == words


SRUN_KILLED = """srun: error: node2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=56433297.0
slurmstepd-node1: error: *** STEP 56433297.0 ON node1 CANCELLED AT 2026-12-05T01:15:43 ***
srun: error: node1: task 0: Terminated
srun: Force Terminated StepId=56433297.0
"""


@pytest.mark.parametrize(("stderr", "node", "process", "cause", "code"), [
    (SRUN_KILLED, "node2", "1", "Killed", 137),  # srun itself ends with 143 (task 0's): the job's code is 137
    ("srun: error: node1: task 0: Exited with exit code 1\nsrun: error: node2: task 1: Killed\n", "node2", "1",
     "Killed", 137),  # a crash is the cause, the exception its peer's reaction
    ("srun: error: node3: tasks 4-7: Exited with exit code 2\n", "node3", "4", "Exited with exit code 2", 2),
    ("srun: error: node1: task 0: Segmentation fault (core dumped)\n", "node1", "0",
     "Segmentation fault (core dumped)", 139),
    ("srun: error: Node failure on node4\nsrun: error: node1: task 0: Terminated\n", "node4", None, "node failure",
     None),  # the lost node is the cause, the stopped task the reaction
    ("srun: error: Node failure on node4\n", "node4", None, "node failure", None),
])
def test_the_failed_process_and_its_own_code_are_read_from_sruns_words(stderr: str, node: str, process: str | None,
                                                                       cause: str, code: int | None) -> None:
    failure = first_failure(stderr)
    assert failure is not None
    assert (failure.node, failure.process, failure.cause, failure.code) == (node, process, cause, code)


def test_no_words_from_srun_name_no_failure() -> None:
    assert first_failure("srun: job 5 queued and waiting for resources\n") is None


def test_a_step_takes_the_run_nodes_first_and_a_spare_for_a_lost_node() -> None:
    alloc = Allocation("7", ("n1", "n2", "n3", "n4"), run_nodes=2, tasks_per_node=4, restart_count=0)
    args = ["--kill-on-bad-exit=1", "-N", "4", "--ntasks=16", "python", "-m", "job", "train"]
    assert step_argv("srun", args, alloc, set()) == [
        "srun", "--nodes=2", "--ntasks=8", "--nodelist=n1,n2", "--kill-on-bad-exit=1", "python", "-m", "job", "train"]
    assert step_argv("srun", args, alloc, {"n1"})[1:4] == ["--nodes=2", "--ntasks=8", "--nodelist=n2,n3"]
    assert alloc.spares_left({"n1", "n3"}) == 0
    whole = Allocation("7", ("n1", "n2"), run_nodes=2, tasks_per_node=1, restart_count=0)
    assert step_argv("srun", args, whole, set()) == ["srun", *args]  # no spares: srun's words as given


# ---------------------------------------------------------------------------------------------------- the roll call
def _answer(process: int, step: int, phase: str) -> Answer:
    return Answer(process, f"node{process + 1}", step, phase)


@pytest.mark.parametrize(("answers", "count", "culprit", "says"), [
    ([_answer(0, 12, "sync"), _answer(1, 12, "input")], 2, 1,
     "roll call of 2 processes: process 1 on node2 is waiting for its batch of step 12 (its data source) while the "
     "others are at step 12's end (the stop check): process 1 on node2 is the one stuck"),
    ([_answer(0, 7, "wait"), _answer(1, 7, "step"), _answer(2, 7, "wait"), _answer(3, 7, "wait")], 4, 1,
     "process 1 on node2 is in its own code of step 7, before the step's collectives while the others are waiting "
     "for step 7's result (in its collectives): process 1 on node2 is the one stuck"),
    ([_answer(0, 9, "sync"), _answer(1, 8, "save")], 2, 1, "process 1 on node2 is saving step 8's checkpoint"),
    ([_answer(0, 5, "wait"), _answer(1, 5, "wait")], 2, None,
     "roll call of 2 processes: every process is waiting for step 5's result (in its collectives): none is behind "
     "the others (a collective that does not end)"),
    ([_answer(0, 5, "wait"), _answer(2, 5, "wait")], 3, 1,
     "roll call of 3 processes: process 1 did not answer within 4 s (frozen, or gone): it is the one stuck"),
])
def test_the_roll_call_names_the_process_behind_the_others_or_silent(answers: list[Answer], count: int,
                                                                     culprit: int | None, says: str) -> None:
    verdict = rollcall.verdict(answers, count, waited_s=4.0)
    assert says in verdict.text, verdict.text
    assert (verdict.culprit.process if verdict.culprit else None) == culprit


class _Store:
    """The coordination service's key-value store as the roll call uses it."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.values[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_the_roll_call_posts_where_this_process_is_and_reads_the_others() -> None:
    store = _Store()
    rollcall.roll_call(store, _answer(1, 3, "input"), 2, wait_s=0.0)  # alone: process 0 has not answered yet
    verdict = rollcall.roll_call(store, _answer(0, 3, "sync"), 2, wait_s=5.0)
    assert verdict.culprit == _answer(1, 3, "input")


def test_a_hang_the_roll_call_named_is_the_attempts_failure_not_the_first_process_to_exit(tmp_path: Path) -> None:
    records = tmp_path / "7-attempts.jsonl"
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "JOB_LOG_DIR": str(tmp_path),
           "SLURM_NTASKS_PER_NODE": "2"}
    supervisor = Supervisor(["true"], Runner(), env)
    records.write_text(json.dumps({"event": "hang", "time": 100.0, "process": "3", "node": "",
                                   "where": "roll call: process 3 did not answer"}) + "\n")
    stuck = supervisor.stuck(99.0, ["n1", "n2"])
    assert stuck is not None and (stuck.process, stuck.node) == ("3", "n2")  # tasks 2, 3 on the second node
    assert supervisor.stuck(101.0, ["n1", "n2"]) is None  # an earlier attempt's hang
    # a record torn or written by something else (a time that is not a number) is skipped, not fatal
    records.write_text(json.dumps({"event": "hang", "time": "x", "process": "1", "node": "n9", "where": ""}) + "\n")
    assert supervisor.stuck(99.0, ["n1", "n2"]) is None


@pytest.mark.parametrize("code", [75, 1, 137, 143, 130])
def test_an_attempt_of_a_cancelled_job_is_never_retried_or_requeued_whatever_its_code(code: int) -> None:
    decision = decide(Situation(code, 0, 3, spares_left=1, can_requeue=True, node="n2", node_answers=True,
                                cancelled=True))
    assert (decision.outcome, decision.action, decision.spends_retry) == (Outcome.CANCELLED, Action.STOP, False)
    assert decision.describe() == "not retried: the job was cancelled (scancel); the same command resumes"
    assert decide(Situation(0, 0, 3, cancelled=True)).outcome is Outcome.COMPLETED  # it had ended well: completed


@pytest.mark.parametrize(("shown", "cancelled"), [
    ("JobId=7 JobName=x\n   JobState=COMPLETING Reason=None Dependency=(null)\n   Requeue=1 Restarts=0", True),
    ("JobId=7\n   JobState=CANCELLED Reason=None Dependency=(null)", True),
    ("JobId=7\n   JobState=COMPLETING Reason=TimeLimit Dependency=(null)", False),  # the time limit: requeued
    ("JobId=7\n   JobState=COMPLETING Reason=Preempted Dependency=(null)", False),  # a preemption: requeued
    ("JobId=7\n   JobState=RUNNING Reason=None Dependency=(null)", False),  # a SIGTERM of someone else's
    ("", False),  # scontrol does not answer: the policy as without the SIGTERM
])
def test_a_job_slurm_ends_for_no_reason_of_its_own_was_cancelled(tmp_path: Path, shown: str, cancelled: bool) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "JOB_LOG_DIR": str(tmp_path)}
    runner = RecordingRunner(responses={("scontrol", "show", "job", "7"): (0 if shown else 1, shown)})
    assert Supervisor(["true"], runner, env).cancelled() is cancelled
    assert runner.calls == [["scontrol", "show", "job", "7"]]


# ------------------------------------------------------------------------------- the supervisor's attempt records
def _supervised(tmp_path: Path, job: str, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    """A supervisor of Slurm job `job` whose step (srun true) ends 0, process 0 having noted `run_dir` at its
    start; its signal handlers are not installed in this process."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    log = tmp_path / f"{job}-attempts.jsonl"
    log.write_text(json.dumps({"event": "started", "attempt": 1, "time": 1.0, "run_dir": str(run_dir)}) + "\n")
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "n1", "JOB_LOG_DIR": str(tmp_path), "JOB_RETRIES": "3"}
    return Supervisor(["true"], RecordingRunner(responses={("srun",): (0, "")}), env)


def test_a_run_submitted_again_under_a_new_job_id_goes_on_numbering_its_attempts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for number in (1, 2):  # job 5's two attempts, each a failure restarted
        attempts.append(run_dir, Ended("5", 10.0 * number, 10.0 * number + 5, 137, Outcome.FAILED, Action.RESTART))
    assert _supervised(tmp_path, "6", run_dir, monkeypatch).run() == 0
    assert [(e.job, e.attempt, e.outcome) for e in attempts.ended(run_dir)] == [
        ("5", 1, Outcome.FAILED), ("5", 2, Outcome.FAILED), ("6", 3, Outcome.COMPLETED)]
    (copy,) = [r for r in rundir.records(tmp_path / "6-attempts.jsonl") if r["event"] == "ended"]
    assert (copy["attempt"], copy["action"], copy["says"]) == (3, "none", "none")  # the job's copy: the same number
    written = attempts.append(run_dir, Ended("pod-a", 40.0, 45.0, 0, Outcome.COMPLETED, Action.NONE))
    assert written is not None and written.attempt == 4  # another backend, the same numbering


def test_what_an_ended_attempt_left_half_written_is_cleared_before_the_next_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a survivor of its peer's death ends at once and srun ends it while submitit saves its result: submitit's next
    # attempt of that task refuses to start over the half-written file
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    half, other_job = tmp_path / "9_0_result.pkl.save_tmp", tmp_path / "8_0_result.pkl.save_tmp"
    seen: list[bool] = []

    class Steps(RecordingRunner):
        def run_echoing_stderr(self, argv, *, env=None):  # type: ignore[no-untyped-def]
            seen.append(half.exists())
            if len(seen) == 1:
                half.write_bytes(b"")  # the first attempt's process 0, ended while saving its result
                return subprocess.CompletedProcess(argv, 137, "", "srun: error: n2: task 1: Killed\n")
            return subprocess.CompletedProcess(argv, 0, "", "")

    other_job.write_bytes(b"")
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]", "JOB_LOG_DIR": str(tmp_path), "JOB_RETRIES": "2",
           "JOB_NODES": "2"}
    assert Supervisor(["true"], Steps(), env).run() == 0
    assert seen == [False, False], "the second attempt started with the first one's half-written result gone"
    assert other_job.exists()  # another job's files are its own


class BucketError(Exception):
    """What gcsfs raises for an HTTP error: not an OSError."""


def test_a_run_dir_append_that_raises_anything_is_one_warning_and_the_supervisor_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "run").mkdir()  # there, but its write refused
    supervisor = _supervised(tmp_path, "8", tmp_path / "run", monkeypatch)

    def refused(*args: object, **kwargs: object) -> None:
        raise BucketError("403 Forbidden: the service account cannot write gs://b/run")

    monkeypatch.setattr(rundir, "append", refused)
    with caplog.at_level(logging.WARNING):
        assert supervisor.run() == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("attempts: expected to append how an attempt ended (exit 0, completed) in ")
    assert "attempts.jsonl, found BucketError: 403 Forbidden" in warning and "Fix: " in warning, warning
    (copy,) = [r for r in rundir.records(tmp_path / "8-attempts.jsonl") if r["event"] == "ended"]
    assert (copy["job"], copy["attempt"], copy["outcome"]) == ("8", 1, "completed")  # the job's own record has it


def test_a_run_dir_that_does_not_exist_here_is_said_as_such_and_nothing_is_made(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "never-made"  # the job stopped before making it, or it is the workers' own folder
    with caplog.at_level(logging.WARNING):
        assert attempts.append(missing, Ended("pod-a", 1.0, 2.0, 2, Outcome.FAILED, Action.NONE)) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"the run dir {missing} does not exist on this machine" in warning and "(exit 2, failed)" in warning
    assert "Fix: a run dir this machine can write" not in warning and not missing.exists()


@pytest.mark.parametrize(("listed", "signalled"), [
    ("7.batch\n7.extern\n7.0\n", ["7.0"]),  # the training step: once, at once
    ("7_3.batch\n7_3.0\n7_3.1\n", ["7_3.0", "7_3.1"]),  # an array element: its steps, never the element
    ("", ["7"]),  # squeue does not say: the job, as before
])
def test_ctrl_c_to_the_batch_script_is_passed_on_to_the_running_steps_not_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: str, signalled: list[str]) -> None:
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "JOB_LOG_DIR": str(tmp_path)}
    runner = RecordingRunner(responses={("squeue", "--steps"): (0 if listed else 1, listed)})
    supervisor = Supervisor(["true"], runner, env)
    supervisor._on_sigint(signal.SIGINT, None)
    supervisor._on_sigint(signal.SIGINT, None)  # a second one passes nothing on again
    assert [call for call in runner.calls if call[0] == "scancel"] == [["scancel", "--signal=INT", *signalled]]
    assert supervisor.interrupted
