"""One way out: `leave(code)`, the exit of every process that ends itself.

    leave(exits.REQUEUE, together=True)   # a stop every process agreed on: the distributed runtime's barrier first
    leave(exits.HANG)                      # this process alone: nothing waits for a peer

Its callers: `python -m job` and a Slurm task once a stopped run's save is written (75, 130; together), the exit
hook of an uncaught exception (a fatal error, a peer's failure seen as one: job.initialize's), a second Ctrl-C,
and the hang watchdog (86).

It runs what sys.exit would run, the functions `atexit` holds (the gloo filter's last lines, TensorBoard's writers,
logging's flush, ...), flushes stdout, stderr and logging, and ends with os._exit: without the interpreter's
teardown. On a TPU VM that teardown (the runtime letting go of the chip and its buffers, in jax's own exit handler,
which clears the backends before it shuts the distributed system down) took 5.5 s after the 838M run's save, and a
preempted VM has about 30 s after its notice: the exit code, which tells the scheduler to requeue, must not wait
for it. So jax's handler is always taken off the list; `together` shuts the distributed system down as that handler
would have, and a process leaving alone does not (its barrier would wait for peers that never come).

It never hangs. A process leaving alone may be where a handler waits forever: a collective that does not end (the
watchdog), a peer gone (the exit hook), a lock held by the main thread a signal interrupted (a second Ctrl-C). So
the handlers run on a thread given HANDLERS_S, and the last flush on one given FLUSH_S; past them the process ends
without the rest, and says so. The barrier of `together` is bounded by jax's own shutdown timeout
(job.initialize's `Timeouts.shutdown_s`, 60 s), not by HANDLERS_S: a process 0 that left before the others had met
it would take the coordination service with it, and they would abort instead of ending with the code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from job.core import internals

log = logging.getLogger(__name__)

HANDLERS_S = 5.0  # what the exit handlers get, all of them: normally milliseconds; past it, the rest are not run
FLUSH_S = 1.0  # what the last flush of stdout, stderr and logging gets (a stream whose lock a stuck thread holds)


def leave(code: int, *, together: bool = False, last: Callable[[], object] | None = None,
          within_s: float = HANDLERS_S) -> NoReturn:
    """End this process with `code`: its exit handlers (within `within_s`), its output flushed, then os._exit.

    together: every process of the job leaves here (a stop they agreed on, its save written): jax's distributed
    system is shut down first, its barrier waiting for the others. False: this process leaves alone (a failure, a
    hang, a second Ctrl-C) and nothing waits for a peer.
    last: after the handlers and the flush, the last thing before the end, bounded by itself (the watchdog's: the
    others say they left, and process 0, whose exit ends the coordination service, waits for them)."""
    phases = Phases()
    if "jax" in sys.modules:  # only a process that imported jax has its exit handler and a distributed system
        with phases.timed("jax's distributed shutdown") as phase:
            phase.note = "" if _leave_jax(together) else " (none left to shut down)"
    with phases.timed("exit handlers") as phase:
        phase.reached = not _bounded(internals.run_exit_handlers, within_s, "its exit handlers")
    with phases.timed("flush") as phase:
        phase.reached = not _bounded(_flush, FLUSH_S, "the flush of stdout, stderr and logging")
    phases.say(code)
    if last is not None:
        try:
            last()
        except Exception as exc:  # noqa: BLE001 - leaving is all that is left to do
            _say(f"{getattr(last, '__qualname__', last)} raised {type(exc).__name__}: {exc}")
    os._exit(code)


@dataclasses.dataclass
class Phase:
    """One phase of `leave`: its seconds, whether its bound ran out, and a word on it."""

    name: str
    seconds: float = 0.0
    reached: bool = False  # its bound ran out: the phase was left where it was
    note: str = ""


class Phases:
    """How long each phase of `leave` took, said in one DEBUG line before the end: on a normal way out every phase
    takes milliseconds and no bound is reached."""

    def __init__(self) -> None:
        self.done: list[Phase] = []

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[Phase]:
        phase, began = Phase(name), time.monotonic()
        try:
            yield phase
        finally:
            phase.seconds = time.monotonic() - began
            self.done.append(phase)

    def line(self, code: int) -> str:
        """'leaving with 75: jax's distributed shutdown 0.012 s, exit handlers 0.004 s, flush 0.001 s; no bound
        reached'."""
        took = ", ".join(f"{p.name} {p.seconds:.3f} s{p.note}" for p in self.done)
        reached = [p.name for p in self.done if p.reached]
        return f"leaving with {code}: {took}; " + (f"bound reached: {', '.join(reached)}" if reached
                                                    else "no bound reached")

    def say(self, code: int) -> None:
        """The line at DEBUG, where this module's logger is on for it: written to stderr's file descriptor, since
        logging is shut down by now (and a stream's lock may be held by a thread left where it was)."""
        if log.isEnabledFor(logging.DEBUG):
            with contextlib.suppress(OSError):
                os.write(2, f"{time.strftime('%H:%M:%S')} DEBUG {__name__}: {self.line(code)}\n".encode())


def _leave_jax(together: bool) -> bool:
    """The distributed system shut down (together, where it is still up), and jax's own exit handler off the list:
    whether it was shut down here."""
    import jax  # imported already ("jax" in sys.modules): the name only; this module is imported without jax

    # once: python -m job's command (job.train.entry.command) shuts it down as its run ends, before this
    shut = together and jax.distributed.is_initialized()
    if shut:
        try:
            jax.distributed.shutdown()  # the coordination service's last barrier, as jax's handler does it
        except Exception as exc:  # noqa: BLE001 - the code still tells the scheduler what happened
            _say(f"jax.distributed.shutdown raised {type(exc).__name__}: {exc}")
    try:
        internals.skip_backend_teardown_at_exit()
    except Exception as exc:  # noqa: BLE001 - a jax mid-import (a signal then); the handlers' bound still holds
        _say(f"jax's exit handler stays on the list ({type(exc).__name__}: {exc}); it runs within the bound")
    return shut


def _flush() -> None:
    """stdout, stderr and every logging handler flushed (logging.shutdown: a handler already closed is skipped)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # None (no console), closed, or a reader gone: nothing more to do
            stream.flush()


def _bounded(work: Callable[[], object], seconds: float, what: str) -> bool:
    """`work` on a daemon thread, waited for `seconds` at most; past them it is left where it is, and said: whether
    it ended within them."""
    thread = threading.Thread(target=work, name="job-leave", daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:  # no thread to be had (none left, or the interpreter is ending)
        _say(f"{what} not run: {exc}")
        return True
    thread.join(seconds)
    if thread.is_alive():
        _say(f"{what} did not end within {seconds:g} s: leaving without the rest")
        return False
    return True


def _say(text: str) -> None:
    """One line on stderr's file descriptor: no lock a stuck thread or an interrupted one could hold."""
    with contextlib.suppress(OSError):
        os.write(2, f"leave: {text}\n".encode())


__all__ = ["FLUSH_S", "HANDLERS_S", "leave"]
