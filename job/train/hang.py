"""The training loop's side of its hang watchdog (job/runtime/watchdog.py): when no step ends in time, a roll
call of every process that can still answer names the one that is stuck (job/runtime/rollcall.py), process 0
notes it for the batch script's supervisor (whose attempt record then names it), and process 0 leaves last.

    hang = Hang(info, progress, watchdog_s=600)  # progress: where the loop is (Progress.at, at each phase)
    Watchdog(600, roll_call=hang.roll_call, before_exit=hang.leave)
"""

from __future__ import annotations

from job.parallel.multihost import coordination_client
from job.runs import attempts
from job.runtime.cluster import ClusterInfo, node_name
from job.runtime.rollcall import Answer, Progress, leave_last, roll_call


class Hang:
    """What this process says and does when the loop's watchdog fires."""

    def __init__(self, info: ClusterInfo, progress: Progress, watchdog_s: float) -> None:
        self.info, self.progress, self.watchdog_s = info, progress, watchdog_s
        self.answered = 0  # processes that answered the roll call: process 0 waits for them to leave

    def roll_call(self) -> str:
        """The watchdog's report line naming the process that is stuck (every process that can still answer joins);
        process 0 also notes it for the batch script's supervisor, whose attempt record then names it."""
        client, info = coordination_client(), self.info
        if client is None or not info.is_multiprocess:
            return ""
        me = Answer(info.process_id, node_name(), self.progress.step, self.progress.phase)
        verdict = roll_call(client, me, info.num_processes, wait_s=min(10.0, max(3.0, self.watchdog_s / 2)))
        self.answered = info.num_processes - len(verdict.missing)
        if verdict.culprit is not None and info.is_coordinator:
            attempts.note_hang(verdict.culprit.process, verdict.culprit.node, verdict.text)
        return verdict.text

    def leave(self) -> None:
        """After the watchdog's report: process 0 leaves last (its exit would abort the others mid-report)."""
        client, info = coordination_client(), self.info
        if client is not None and info.is_multiprocess:
            leave_last(client, info.process_id, self.answered or info.num_processes, wait_s=5.0)


__all__ = ["Hang"]
