"""The attempt policy: what every backend does once an attempt of a run has ended. Written once, here; the
Slurm supervisor (deploy/slurm/supervise.py) and the TPU pod loop (deploy/tpu/cli.py) apply it, and record the
decision (its outcome, action and words) in the run's attempt record (job/runs/attempts.py).

    decision = decide(Situation(code=137, failures_before=0, retries=3, spares_left=1, can_requeue=True,
                                node="node2"))
    decision.action        # Action.RESTART: a new step in the same allocation, on a spare instead of node2
    decision.describe()    # 'restart 1 of 3 in the allocation, on a spare instead of node2'

By exit code (job/core/exits.py):
  0   completed: nothing more.
  75  saved after a preemption signal: requeued (Slurm) or rerun (TPU), never spending a retry.
  2   a configuration error: the same flags fail again, so it is never retried.
  130 saved and stopped after Ctrl-C: a person asked to stop; never retried (the same command resumes).
  whatever the code (but 0), an attempt of a job the scheduler cancelled (scancel) is "cancelled": nothing runs
  after it (the same command resumes); one a person stopped (Ctrl-C: Situation.interrupted, or the backend's stop
  command, `tpu-stop`: Situation.stopped_by) is "stopped" and never retried; one whose machines were taken away
  (a preempted slice: Situation.preempted) is "preempted".
  any other code is a failure. While the retry budget (RETRIES) lasts:
      - with a spare node left in the allocation: restart there at once, without the failed node (Slurm);
      - with no spare left, where the job can be requeued: requeue it with the failed node excluded;
      - with no spare left and no requeue (JobRequeue=0, --no-requeue): restart in the allocation on the same
        nodes when the failed node still answers (a probe step), else stop;
      - on a TPU slice (the slice is the allocation): rerun on the same slice.
      Once the budget is spent, the run stops with the failure's code.
A failure whose node is unknown restarts on the same nodes (nothing to exclude).
"""

from __future__ import annotations

import dataclasses
import functools

from job.runs.attempts import Action, Outcome


@dataclasses.dataclass(frozen=True)
class Situation:
    """What the policy needs to know about an attempt that ended: its code and what else happened."""

    code: int  # the attempt's exit code: the process that failed first's, not its peers' reactions
    failures_before: int  # failed attempts of this run before this one (the retries spent)
    retries: int  # the budget: failed attempts that are retried (RETRIES; 0: none)
    spares_left: int = 0  # nodes of the allocation this run does not use and that never failed
    can_requeue: bool = False  # the scheduler would requeue the job (Slurm: Requeue=1)
    node: str | None = None  # the failed process's node, when known
    node_answers: bool = False  # the failed node still runs a probe step (asked only when it matters)
    same_allocation: bool = False  # a rerun keeps the allocation by nature (a TPU slice): RESTART, never REQUEUE
    cancelled: bool = False  # the scheduler cancelled the job (scancel): nothing can run after this attempt
    interrupted: bool = False  # a person asked to stop (Ctrl-C): nothing restarts, whatever the code
    preempted: bool = False  # the machines were taken away (a preempted TPU slice), whatever the code
    stopped_by: str | None = None  # the backend's stop command a person ran (`tpu-stop`): nothing reruns


@dataclasses.dataclass(frozen=True)
class Decision:
    outcome: Outcome
    action: Action
    spends_retry: bool  # this decision uses one of the budget's retries
    retry: int  # which retry this is (1-based) when it spends one, else 0
    retries: int  # the budget
    exclude: str | None = None  # the node to keep out of the next attempt
    on_spare: bool = False  # a restart takes a spare in place of `exclude`
    why: str = ""  # the reason, for a STOP or a fallback

    def describe(self) -> str:
        """The words attempts.jsonl records as `says` (job/runs/attempts.py): 'none', 'requeued (a preemption
        spends no retry)', 'retry 1 of 3, excluding node2', 'restart 1 of 3 in the allocation, on a spare instead of
        node2', 'not retried: the retry budget is spent (3 of 3)'."""
        if self.action is Action.NONE:
            return "none"
        if self.outcome is Outcome.PREEMPTED:
            return ("requeued (a preemption spends no retry)" if self.action is Action.REQUEUE
                    else "rerun (a preemption spends no retry)")
        if self.action is Action.STOP:
            return f"not retried: {self.why}"
        count = f"{self.retry} of {self.retries}"
        if self.action is Action.REQUEUE:
            words = f"retry {count}" + (f", excluding {self.exclude}" if self.exclude else "")
        elif self.on_spare:
            words = f"restart {count} in the allocation, on a spare instead of {self.exclude}"
        else:
            words = f"restart {count} in the allocation, on the same nodes"
        return words + (f" ({self.why})" if self.why else "")


def decide(ended: Situation) -> Decision:
    """The one decision, for every backend."""
    decision = _by_code(ended)
    if decision.action is Action.NONE or decision.outcome is Outcome.CONFIGURATION_ERROR:
        return decision  # completed, or would fail again: its own reason, whoever stopped it
    if ended.stopped_by:  # a person ran the stop command: stopped, whatever the retry budget says
        return _stopped(ended, f"stopped by {ended.stopped_by}; the same command resumes")
    if ended.interrupted and decision.action is not Action.STOP:  # Ctrl-C: what stops anyway keeps its reason
        return _stopped(ended, _STOPPED)
    return decision


def _stopped(ended: Situation, why: str) -> Decision:
    return Decision(Outcome.STOPPED, Action.STOP, spends_retry=False, retry=0, retries=ended.retries, why=why)


_STOPPED = "stopped with Ctrl-C after a save; the same command resumes"


def _by_code(ended: Situation) -> Decision:
    outcome = Outcome.PREEMPTED if ended.preempted and ended.code != 0 else Outcome.of(ended.code)
    plain = functools.partial(Decision, outcome=outcome, spends_retry=False, retry=0, retries=ended.retries)
    if outcome is Outcome.COMPLETED:
        return plain(action=Action.NONE)
    if ended.cancelled:
        return plain(outcome=Outcome.CANCELLED, action=Action.STOP,
                     why="the job was cancelled (scancel); the same command resumes")
    if outcome is Outcome.PREEMPTED:
        return plain(action=Action.RESTART if ended.same_allocation else Action.REQUEUE)
    if outcome is Outcome.CONFIGURATION_ERROR:
        return plain(action=Action.STOP, why="the same flags would fail again")
    if outcome is Outcome.STOPPED:
        return plain(action=Action.STOP, why=_STOPPED)
    if ended.failures_before >= ended.retries:
        return plain(action=Action.STOP, why=f"the retry budget is spent ({ended.retries} of {ended.retries})"
                     if ended.retries else "retries are off (RETRIES=0)")
    spent = functools.partial(Decision, outcome=outcome, spends_retry=True, retry=ended.failures_before + 1,
                              retries=ended.retries)
    if ended.same_allocation or ended.node is None:
        return spent(action=Action.RESTART)
    if ended.spares_left > 0:
        return spent(action=Action.RESTART, exclude=ended.node, on_spare=True)
    if ended.can_requeue:
        return spent(action=Action.REQUEUE, exclude=ended.node)
    if ended.node_answers:
        return spent(action=Action.RESTART, why=f"no spare left and the job cannot be requeued; {ended.node} "
                     "still answers")
    return plain(action=Action.STOP, why=f"no spare left, the job cannot be requeued, and {ended.node} does not "
                 "answer a probe step")


__all__ = ["Decision", "Situation", "decide"]
