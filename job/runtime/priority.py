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


def threads_named(name: str) -> list[int]:
    """The native ids of this process's threads whose name (/proc/self/task/*/comm) is `name`
    (none where /proc is absent)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    named = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().strip() == name:
                    named.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return named


def lower_named(name: str, nice: int) -> None:
    """`lower` every thread of this process called `name`."""
    for tid in threads_named(name):
        lower(nice, tid)
