"""The preemption guard's agreement across processes, without a training loop.

    preempt_sync.py WAY SIGNAL

Every process joins (job.initialize), takes the loop's guard, then makes "steps" (a short sleep each, rank 1's
slower) and asks the guard after each one, up to 600: WAY "step" asks with the step (the coordination service's
sync point), "collective" without (the check before the first step and during evaluation). Rank 1 sends
itself SIGNAL after its step 5. Each process prints `stopped at STEP interrupted BOOL` or `never stopped`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import job
from job.runtime.preemption import NOTICES, PreemptionGuard

way, sig = sys.argv[1], signal.Signals[sys.argv[2]]
with PreemptionGuard(NOTICES) as guard:
    info = job.initialize()
    guard.joined()
    rank = info.process_id
    for step in range(1, 601):
        time.sleep(0.02 if rank == 0 else 0.05)  # process 0 runs ahead, as a host whose steps dispatch sooner
        if rank == 1 and step == 5:
            os.kill(os.getpid(), sig)
        if guard.should_stop(step if way == "step" else None):
            print(f"stopped at {step} interrupted {guard.interrupted} sync point {guard.sync_point}", flush=True)
            break
    else:
        print("never stopped", flush=True)
