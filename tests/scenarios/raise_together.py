"""A bad-input error raised after joining the cluster, the way the loop raises one (job.runtime.preflight's
raise_together), by some or all processes.

    raise_together.py WHO

WHO is `all` (every process raises it, as every process finds a checkpoint of another state) or a process
index (only that one raises it; the others go on to a long wait, as a process that did not find the error
would go on to its next collective). Each process prints `going on` when it did not raise.
"""

from __future__ import annotations

import sys
import time

import job
from job.errors import ConfigError
from job.runtime import preflight

who = sys.argv[1]
job.initialize()
import jax  # noqa: E402  (after initialize, as a user's job does)

preflight.RAISE_TOGETHER_TIMEOUT_S = 3.0  # a peer that never comes: the raise is delayed this long, not 60 s
if who == "all" or int(who) == jax.process_index():
    preflight.raise_together(ConfigError("--thing", expected="a good thing", found=f"a bad one on process "
                                         f"{jax.process_index()}", fix="pass a good one"), "scenario")
print(f"going on on process {jax.process_index()}", flush=True)
time.sleep(120)
