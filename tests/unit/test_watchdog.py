"""The hang watchdog: fires with stacks and its exit code, stays quiet while kicked."""

from __future__ import annotations

import subprocess
import sys

from job.runtime.watchdog import HANG_EXIT_CODE

HUNG = """
import time
from job.runtime.watchdog import Watchdog
def stuck_in_a_collective():
    time.sleep(60)
with Watchdog(1.0):
    stuck_in_a_collective()
"""


# kicked well within its limit for longer than the limit, then left past it: it must neither fire nor
# outlive its block
KICKED = """
import time
from job.runtime.watchdog import Watchdog
with Watchdog(1.5) as dog:
    for _ in range(40):
        time.sleep(0.05)
        dog.kick()
time.sleep(2.0)
print("quiet")
"""


def test_watchdog_dumps_every_stack_and_exits_with_its_code() -> None:
    proc = subprocess.run([sys.executable, "-c", HUNG], capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT_CODE
    assert "watchdog: no training step completed for" in proc.stderr
    assert "stuck_in_a_collective" in proc.stderr  # the main thread's stack


def test_watchdog_stays_quiet_while_kicked_and_stops_with_its_block() -> None:
    # in a child process: a watchdog that fires ends its process, which must not be pytest's
    proc = subprocess.run([sys.executable, "-c", KICKED], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "quiet", (proc.returncode, proc.stderr)
