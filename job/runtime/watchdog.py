"""A hang watchdog for the training loop.

If no step completes within `timeout_s`, every thread's stack is written to
stderr (faulthandler) and the process exits with HANG_EXIT_CODE at once.
Each process watches itself, so a hung collective ends every process that
is stuck in it, with the stacks that show where.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

from job.core import exits

log = logging.getLogger(__name__)

HANG_EXIT_CODE = exits.HANG  # no step completed within the watchdog timeout


class Watchdog:
    def __init__(self, timeout_s: float, *, name: str = "training step") -> None:
        self.timeout_s = timeout_s
        self.name = name
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="job-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self.kick()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def kick(self) -> None:
        """Progress was made: restart the countdown."""
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        print(f"watchdog: no {self.name} completed for {idle:.0f} s (limit {self.timeout_s:.0f} s); "
              f"stacks of every thread follow; exiting with {HANG_EXIT_CODE}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)
