"""What every Slurm task runs when the job is submitted through submitit."""

from __future__ import annotations

import logging
import os
import sys

from deploy.runner import Runner
from job.runtime.preemption import REQUEUE_EXIT_CODE

log = logging.getLogger(__name__)


class JobTask:
    """Callable submitit pickles: ``python -m job ARGS`` inside the task.

    On the requeue exit code (the job saved after a preemption signal),
    process 0 requeues the Slurm job and every task leaves without a result,
    so submitit keeps waiting for the requeued run, which resumes.
    """

    def __call__(self, args: list[str]) -> int:
        from job.__main__ import main

        code = main(list(args))
        if code == REQUEUE_EXIT_CODE:
            if os.environ.get("SLURM_PROCID") == "0":
                log.warning("requeueing Slurm job %s after a preemption save", os.environ["SLURM_JOB_ID"])
                Runner().run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], timeout=60)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if code != 0:
            raise RuntimeError(f"python -m job {' '.join(args)} exited with code {code}")
        return code
