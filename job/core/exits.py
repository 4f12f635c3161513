"""The exit codes a run ends with, and what each means: the one table every backend's attempt policy reads
(deploy/policy.py) and every message that names a code (`describe`).

    0   completed
    2   a configuration error (BAD_INPUT): the same flags fail again, never retried
    75  saved and stopped after a preemption signal (REQUEUE, EX_TEMPFAIL): run me again, no retry spent
    86  no step within the watchdog's timeout (HANG): a failure
    130 saved and stopped after Ctrl-C (SIGINT, STOPPED): a person asked; the same command resumes, never retried
    128+N  killed by signal N: a failure; a crash (CRASHES) is the cause, the others' exits its echo
"""

from __future__ import annotations

import signal

COMPLETED = 0
BAD_INPUT = 2  # a ConfigError, wherever it is found: before the start or inside the run
REQUEUE = 75  # EX_TEMPFAIL: saved, stopped on purpose, run me again
HANG = 86  # no step completed within the watchdog timeout
STOPPED = 130  # 128 + SIGINT, as a shell says Ctrl-C: saved at the next step, stopped; the same command resumes

# Deaths no process chooses: a JAX process that loses a peer exits 1 (a Python exception from the collective)
# or aborts (SIGABRT, jax's fatal log), but is never killed by one of these unless something else killed it or
# it crashed. Such a process is the cause even when its peers' reactions are seen first.
CRASHES = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)

# Where a process records the exception that ends it (job.initialize's exit hook): one line, "TIME TYPE: MESSAGE".
# A launcher that sets it per rank learns which failure came first; the peers that lost it fail a moment later,
# and may be reaped first (torchrun's error file, for the same reason).
ERROR_FILE_ENV = "JOB_ERROR_FILE"

_MEANING = {
    BAD_INPUT: "a configuration error",
    REQUEUE: "saved and stopped: preempted",
    HANG: "no step within the watchdog's timeout",
    STOPPED: "saved and stopped: Ctrl-C",
}


def describe(code: int) -> str:
    """`1`, `137 (SIGKILL)`, `86 (no step within the watchdog's timeout)`."""
    if code in _MEANING:
        return f"{code} ({_MEANING[code]})"
    signum = signal_of(code)
    return f"{code} ({signum.name})" if signum is not None else str(code)


def signal_of(code: int) -> signal.Signals | None:
    """The signal a shell's exit code 128+N (or Python's -N) names; None for a plain exit."""
    number = code - 128 if code > 128 else -code if code < 0 else 0
    try:
        return signal.Signals(number) if number else None
    except ValueError:
        return None


def is_crash(code: int) -> bool:
    """True for a code that says the process was killed by one of CRASHES (128+N or -N)."""
    return signal_of(code) in CRASHES


def of_signal_text(text: str) -> int | None:
    """The shell's exit code for a signal as the C library names it (srun's `task 1: Killed`, `Segmentation
    fault (core dumped)`): 128 + its number; None for any other text."""
    text = text.strip()
    for signum in signal.Signals:
        try:
            name = signal.strsignal(signum)
        except ValueError:
            continue
        if name and (text == name or text.startswith(name + " (")):
            return 128 + int(signum)
    return None


__all__ = ["BAD_INPUT", "COMPLETED", "CRASHES", "ERROR_FILE_ENV", "HANG", "REQUEUE", "STOPPED", "describe", "is_crash",
           "of_signal_text", "signal_of"]
