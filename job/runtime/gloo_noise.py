"""Drop gloo's per-peer "connected" lines from this process's output, under Slurm, on a TPU pod, anywhere.

Gloo (jax's CPU collectives) prints "[Gloo] Rank N is connected to M peer
ranks ..." from C++ straight to a file descriptor, once per device, so Python
logging cannot filter it. `job.initialize` calls `filter_output()` before the
distributed runtime starts: fds 1 and 2 each become a pipe into a small child
process that applies the launcher's own filter (`job.runtime.procgroup.GlooFilter`) and
writes the rest to the original stream. The child reads until the last writer closes the
pipe, so the final words of a process that crashes or aborts still come out.
The local launcher filters its ranks' output itself, so there it is not needed.
JOB_GLOO_LOGS=1 keeps the lines (to debug gloo itself).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from job.runtime.cluster.base import read_switch

KEEP_VARIABLE = "JOB_GLOO_LOGS"  # set to 1: gloo's lines are kept

# The child: ignores the signals its process group may receive (it ends when the pipe does), filters, relays.
_CHILD = """
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
sys.path.insert(0, {root!r})
from job.runtime.procgroup import GlooFilter
noise, out = GlooFilter(), os.fdopen(1, "wb", buffering=0)
for raw in iter(sys.stdin.buffer.readline, b""):
    if noise.keep(raw.decode("utf-8", errors="replace")):
        try:
            out.write(raw)
        except OSError:  # the reader went away: keep draining, so the writer never blocks
            pass
"""


class Relay:
    """The filter processes of fds 1 and 2, and the original streams to put back at the end."""

    def __init__(self, children: list[subprocess.Popen[bytes]], originals: list[int]) -> None:
        self.children, self._originals = children, originals

    def restore(self, timeout_s: float = 5.0) -> None:
        """Put the original streams back and wait until the filters have written out everything before.

        Run at exit (job.runtime.leaving's `leave` too, and the exit hook before it): where the environment kills
        what is left of a task once it ends (a Slurm step, a container's PID 1), the last lines are out before that."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, original in zip((1, 2), self._originals, strict=True):
            if original >= 0:
                with contextlib.suppress(OSError):
                    os.dup2(original, fd)  # closes this process's end of the pipe: the filter sees its end
                    os.close(original)
        self._originals = [-1, -1]
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout_s)


def filter_output(env: Mapping[str, str] | None = None) -> Relay | None:
    """Route stdout and stderr (fds 1 and 2) through the gloo filter until exit; None with JOB_GLOO_LOGS=1."""
    env = os.environ if env is None else env
    if read_switch(env, KEEP_VARIABLE, fix=f"set {KEEP_VARIABLE}=1 to keep gloo's lines, or unset it"):
        return None
    originals = [os.dup(fd) for fd in (1, 2)]
    relay = Relay([_filter(fd) for fd in (1, 2)], originals)
    atexit.register(relay.restore)
    return relay


def _filter(fd: int) -> subprocess.Popen[bytes]:
    (sys.stdout if fd == 1 else sys.stderr).flush()
    root = str(Path(__file__).resolve().parents[2])  # the folder the job package sits in
    original = os.dup(fd)
    try:
        child = subprocess.Popen([sys.executable, "-S", "-c", _CHILD.format(root=root)], stdin=subprocess.PIPE,
                                 stdout=original, close_fds=True)
    finally:
        os.close(original)
    assert child.stdin is not None
    os.dup2(child.stdin.fileno(), fd)  # fd is now the pipe; the child holds the original stream
    child.stdin.close()
    return child
