"""The preemption guard's hold on the signals: restored when the run ends, kept once the processes agreed to
stop (a process leaving with 75 is not killed by a later signal)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from job.runtime.preemption import REQUEUE_EXIT_CODE

# One process: a USR2 (or none), the guard's exit, then SIGTERM, as srun sends it to a task still ending
# once a peer has left with 75 (srun --kill-on-bad-exit=1).
LEAVING = """
import os, signal, sys
from job.runtime.preemption import PreemptionGuard
with PreemptionGuard() as guard:
    if sys.argv[1] == "preempted":
        os.kill(os.getpid(), signal.SIGUSR2)
    stop = guard.should_stop()
os.kill(os.getpid(), signal.SIGTERM)
print("left", stop, flush=True)
sys.exit(75 if stop else 0)
"""


@pytest.mark.parametrize(("case", "code", "said"), [("preempted", REQUEUE_EXIT_CODE, "left True"),
                                                     ("finished", -signal.SIGTERM, "")])
def test_the_guard_holds_the_signals_to_the_end_only_once_the_processes_agreed_to_stop(
        case: str, code: int, said: str) -> None:
    proc = subprocess.run([sys.executable, "-c", LEAVING, case], capture_output=True, text=True, timeout=120,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.strip() == said
    if case == "preempted":
        assert "received SIGTERM while leaving with 75: the saved exit stands" in proc.stderr
