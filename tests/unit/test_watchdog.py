"""The hang watchdog: fires with stacks and its exit code, stays quiet while kicked."""

from __future__ import annotations

import subprocess
import sys
import time

from job.watchdog import HANG_EXIT_CODE, Watchdog

HUNG = """
import time
from job.watchdog import Watchdog
def stuck_in_a_collective():
    time.sleep(60)
with Watchdog(1.0):
    stuck_in_a_collective()
"""


def test_watchdog_dumps_every_stack_and_exits_with_its_code() -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == HANG_EXIT_CODE
    assert "watchdog: no training step completed for" in proc.stderr
    assert "stuck_in_a_collective" in proc.stderr  # the main thread's stack
    assert elapsed < 20


def test_watchdog_stays_quiet_while_kicked() -> None:
    with Watchdog(0.5) as dog:
        for _ in range(8):
            time.sleep(0.15)
            dog.kick()
    assert not dog._thread.is_alive()
