"""The user's own entry point: their task as the default --task, with the job's logging, exit codes and
distributed shutdown (job.train.entry), no copy of job/__main__.py.

    python -m job.launch -n 2 --devices-per-process 2 -- python -m tests.user_tasks.train_digits --steps 40
"""

from __future__ import annotations

import sys

from job.train import entry

if __name__ == "__main__":
    sys.exit(entry.train(sys.argv[1:], task="tests.user_tasks.digits:TASK"))
