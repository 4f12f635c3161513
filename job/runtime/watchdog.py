"""A hang watchdog for the training loop.

If no step completes within `timeout_s`, every thread's stack is written to
stderr (faulthandler) and the process leaves with HANG_EXIT_CODE at once, alone
(job.runtime.leaving: its exit handlers within their bound, no barrier).
Each process watches itself, so a hung collective ends every process that
is stuck in it, with the stacks that show where.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from job.core import exits
from job.runtime.leaving import leave

log = logging.getLogger(__name__)

HANG_EXIT_CODE = exits.HANG  # no step completed within the watchdog timeout
# Asks a process for every thread's stack on its stderr, and nothing else (the JVM's thread dump signal): the
# launcher sends it before it kills a process that outstayed its stop (job.runtime.procgroup)
STACKS_SIGNAL = signal.SIGQUIT


def stacks_on_request() -> None:
    """From now on STACKS_SIGNAL writes every thread's stack to stderr and the process goes on."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)


class Watchdog:
    def __init__(self, timeout_s: float, *, name: str = "training step",
                 roll_call: Callable[[], str] | None = None, before_exit: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.name = name
        self.roll_call = roll_call  # when it fires: one line naming the process that is stuck (job.runtime.rollcall)
        self.before_exit = before_exit  # the last thing before the end: the coordinator waits for the others to leave
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
        if self.roll_call is not None:
            try:
                said = self.roll_call()
            except Exception as exc:  # noqa: BLE001  (the stacks and the exit must follow whatever it raised)
                said = f"roll call failed: {type(exc).__name__}: {exc}"
            if said:
                print(f"watchdog: {said}", file=sys.stderr, flush=True)
        _dump_stacks()
        # alone: the step's collective may never end; the exit handlers (the gloo filter's last lines) within their
        # bound, then before_exit: a process says it left only when nothing but its end is left
        leave(HANG_EXIT_CODE, last=self.before_exit)


def _dump_stacks() -> None:
    """Every thread's stack on sys.stderr, through its write (so a process's log file, RUN_DIR/logs, keeps them
    too): faulthandler writes to a file descriptor, so to a temporary file first; straight to stderr's when
    there is none to be had."""
    try:
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stacks:
            faulthandler.dump_traceback(file=stacks, all_threads=True)
            stacks.seek(0)
            sys.stderr.write(stacks.read())
    except OSError:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
