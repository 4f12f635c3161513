"""CPU priority of the job's helper threads: the save and the input prefetch give way to the loop.

On an accelerator host these threads use cores the step does not; on a host whose cores the
step computes on (CPU devices, or a busy host) a raised nice value lets them fill the step's
gaps instead of slowing it (bench.ckpt, bench.pipeline). Linux nice values are per thread.
"""

from __future__ import annotations

import os
import threading


def lower(nice: int, tid: int | None = None) -> None:
    """Raise thread `tid`'s nice value (default: the calling thread's) to `nice`; never lower it, which
    needs privileges. Best effort: a thread that ended, or a refused change, is left as it is."""
    try:
        tid = threading.get_native_id() if tid is None else tid
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):  # AttributeError: no setpriority on this platform
        pass


def lower_named(name: str, nice: int) -> None:
    """`lower` every thread of this process whose name (/proc/self/task/*/comm) is `name`."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                named = fh.read().strip() == name
        except OSError:
            continue
        if named:
            lower(nice, int(tid))
