"""What every Slurm task runs when the job is submitted through submitit."""

from __future__ import annotations

import logging
import signal

from job.core.errors import BAD_INPUT_EXIT_CODE
from job.runtime.leaving import leave
from job.runtime.preemption import REQUEUE_EXIT_CODE, STOPPED_EXIT_CODE, hear_notices_early

log = logging.getLogger(__name__)


class JobTask:
    """Callable submitit pickles: ``python -m job ARGS`` inside the task.

    On the requeue exit code (the job saved after a preemption signal) every
    task leaves with that code and without a result: srun ends with it, and
    the batch script requeues the job (slurm/requeue.sh, the same step
    slurm/train.sbatch takes), so submitit keeps waiting for the requeued
    run, which unpickles this task again and resumes. A configuration error's
    2 leaves the same way, for the batch script to see it and not retry it.

    submitit's own handlers are dropped first: its requeue on USR2 (rank 0 alone, `scontrol requeue`)
    would be a second way to requeue, and it ignores SIGTERM. Until the loop's guard takes the
    preemption signals, they act as they do under slurm/train.sbatch: SIGTERM ends the task, a notice
    (USR1, USR2) is remembered (job.runtime.preemption.EarlyNotice).
    """

    def __call__(self, args: list[str]) -> int:
        from job.__main__ import main, skip_final_collection

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        hear_notices_early()  # USR1, USR2: remembered for the loop's guard
        code = main(list(args))
        if code in (REQUEUE_EXIT_CODE, BAD_INPUT_EXIT_CODE, STOPPED_EXIT_CODE):  # the supervisor acts on each
            if code == REQUEUE_EXIT_CODE:
                log.warning("saved after a preemption signal: leaving with %d for the job's supervisor to requeue "
                            "(after a scancel: nothing)", code)
            leave(code, together=True)  # its exit handlers, its output flushed; no teardown, no result
        if code != 0:
            raise RuntimeError(f"python -m job {' '.join(args)} exited with code {code}")
        skip_final_collection()  # submitit only writes the result down before this process exits
        return code
