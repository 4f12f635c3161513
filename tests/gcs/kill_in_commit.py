"""`python -m job ARGS` whose rank 0 is killed (SIGKILL) while it commits one checkpoint in gs://.

    kill_in_commit.py STEP -- train --run-dir gs://BUCKET/FOLDER [job flags]

Every array of STEP is written by then; the kill strikes just before orbax writes the
step's `commit_success.txt` (its CommitFileTemporaryPath.finalize, run on the async
save's thread): what a host lost in the middle of a save leaves in a bucket.
"""

from __future__ import annotations

import os
import signal
import sys

from orbax.checkpoint._src.path import atomicity

from job import __main__ as entry

step = sys.argv[1]
args = sys.argv[sys.argv.index("--") + 1:]
me = int(os.environ.get("JOB_LAUNCH_PROCESS_ID", "0"))
real_finalize = atomicity.CommitFileTemporaryPath.finalize


async def finalize(self: atomicity.CommitFileTemporaryPath) -> None:
    if me == 0 and self._final_path.name == step:
        print(f"KILLED while committing step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    await real_finalize(self)


atomicity.CommitFileTemporaryPath.finalize = finalize
sys.exit(entry.main(args))
