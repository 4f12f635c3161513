"""The one attempt policy (deploy/attempts.py) as a table, and how the Slurm supervisor reads srun's words and
picks a step's nodes (deploy/slurm/supervise.py)."""

from __future__ import annotations

import pytest

from deploy.attempts import Action, Ended, Outcome, decide
from deploy.slurm.supervise import Allocation, first_failure, step_argv
from job.core import exits

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
    decision = decide(Ended(code, before, 3, spares_left=spares, can_requeue=requeue, node=node, node_answers=answers,
                            same_allocation=same))
    assert (decision.action, decision.spends_retry, decision.exclude, decision.describe()) == (
        action, spends, exclude, words)
    assert decision.outcome is Outcome.of(code)


def test_retries_off_never_restart_a_failure() -> None:
    decision = decide(Ended(1, 0, 0, spares_left=2, can_requeue=True, node="n2"))
    assert decision.action is Action.STOP and decision.describe() == "not retried: retries are off (RETRIES=0)"


@pytest.mark.parametrize(("code", "outcome"), [(0, Outcome.COMPLETED), (2, Outcome.CONFIGURATION_ERROR),
                                               (75, Outcome.PREEMPTED), (86, Outcome.FAILED), (1, Outcome.FAILED),
                                               (137, Outcome.FAILED), (143, Outcome.FAILED), (255, Outcome.FAILED)])
def test_every_exit_code_has_one_outcome(code: int, outcome: Outcome) -> None:
    assert Outcome.of(code) is outcome


@pytest.mark.parametrize(("code", "words"), [(0, "0"), (1, "1"), (2, "2 (a configuration error)"),
                                             (75, "75 (saved and stopped: preempted)"),
                                             (86, "86 (no step within the watchdog's timeout)"), (137, "137 (SIGKILL)"),
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
