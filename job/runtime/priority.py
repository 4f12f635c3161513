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
    return [int(tid) for tid in tids if _comm(int(tid)) == name]


class NamedLowering:
    """`lower` the threads of this process called `name`, each thread's name read once: a call reads only the names
    of threads that appeared since the last (those still named as the main thread is, not yet named by their pool,
    are read again). Reading every thread's name (/proc/self/task/*/comm) took 0.7-1.1 s a time on a sandboxed TPU
    VM; a save that looked afresh each time paid it every save. Safe to call from several threads."""

    def __init__(self, name: str, nice: int) -> None:
        self.name, self.nice = name, nice
        self._read: set[int] = set()  # threads whose own name was read (a reused id is taken for the same thread)
        self._lock = threading.Lock()

    def __call__(self) -> list[int]:
        """The ids of the threads lowered by this call."""
        with self._lock:
            try:
                tids = {int(tid) for tid in os.listdir("/proc/self/task")}
            except OSError:
                return []
            unnamed = _comm(os.getpid())
            lowered = []
            for tid in sorted(tids - self._read):
                comm = _comm(tid)
                if comm is None or comm == unnamed:  # ended, or not named yet by the pool that started it
                    continue
                self._read.add(tid)
                if comm == self.name:
                    lower(self.nice, tid)
                    lowered.append(tid)
            self._read &= tids
            return lowered


def _comm(tid: int) -> str | None:
    """Thread `tid`'s name, None once it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return None
