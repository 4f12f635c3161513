"""Drop gloo's per-peer "connected" lines from this process's output, under Slurm, on a TPU pod, anywhere.

Gloo (jax's CPU collectives) prints "[Gloo] Rank N is connected to M peer
ranks ..." from C++ straight to a file descriptor, once per device, so Python
logging cannot filter it. `job.initialize` calls `filter_output()` before the
distributed runtime starts: fds 1 and 2 each become a pipe into a small child
process that applies the launcher's own filter (`job.procgroup.GlooFilter`) and
writes the rest to the original stream. The child reads until the last writer closes the
pipe, so the final words of a process that crashes or aborts still come out.
The local launcher filters its ranks' output itself, so there it is not needed.
JOB_GLOO_LOGS=1 keeps the lines (to debug gloo itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

KEEP = "JOB_GLOO_LOGS"

# The child: ignores the signals its process group may receive (it ends when the pipe does), filters, relays.
_CHILD = """
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
sys.path.insert(0, {root!r})
from job.procgroup import GlooFilter
noise, out = GlooFilter(), os.fdopen(1, "wb", buffering=0)
for raw in iter(sys.stdin.buffer.readline, b""):
    if noise.keep(raw.decode("utf-8", errors="replace")):
        try:
            out.write(raw)
        except OSError:  # the reader went away: keep draining, so the writer never blocks
            pass
"""


def filter_output(env: Mapping[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """Route stdout and stderr (fds 1 and 2) through the gloo filter; returns the filter processes."""
    env = os.environ if env is None else env
    if env.get(KEEP) == "1":
        return []
    return [_filter(fd) for fd in (1, 2)]


def _filter(fd: int) -> subprocess.Popen[bytes]:
    (sys.stdout if fd == 1 else sys.stderr).flush()
    root = str(Path(__file__).resolve().parents[1])
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
