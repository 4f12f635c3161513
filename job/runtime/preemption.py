"""The preemption protocol: a signal to ANY process stops ALL of them together.

SIGTERM, SIGUSR1 or SIGUSR2 sets a flag in the process that receives it. At every step boundary the processes
share their flags through one tiny collective, so they all see the request at the same step, save a checkpoint
there, and exit with REQUEUE_EXIT_CODE (STOPPED_EXIT_CODE after Ctrl-C). On TPU and GPU (or with
JOB_PREEMPTION_SYNC_POINT=1) the steps ask the coordination service's preemption sync point instead (jax's
notifier holds SIGTERM and is told of the others): no collective per step. Schedulers and the deploy scripts
treat 75 as "requeue me".
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from types import FrameType

import numpy as np

from job.core import exits, internals
from job.core.errors import ConfigError
from job.runtime.leaving import leave

REQUEUE_EXIT_CODE = exits.REQUEUE  # EX_TEMPFAIL: saved, stopped on purpose, run me again
STOPPED_EXIT_CODE = exits.STOPPED  # 128 + SIGINT: saved after Ctrl-C, stopped; the same command resumes
# Ctrl-C: the first saves at the next step boundary and stops with STOPPED_EXIT_CODE, a second stops at once
INTERRUPT = signal.SIGINT
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# "1": the steps stop at the coordination service's preemption sync point instead of a collective after each;
# "0": the collective; unset or "auto": the sync point on TPU and GPU, the collective on CPU (sync_point_wanted)
SYNC_POINT_ENV = "JOB_PREEMPTION_SYNC_POINT"
# the backends whose steps stop at the sync point by default: a CPU cluster keeps the per-step collective, since
# without it the hosts dispatch steps ahead, and a 2 x 2 CPU run on JAX 0.10.2 was seen to hang with both processes
# waiting to start a step (the CPU client's wait for the previous program, stuck in its cross-process collective)
SYNC_POINT_BACKENDS = ("tpu", "gpu")
# a scheduler's notice (Slurm's --signal=USR2@SECONDS, scancel --signal=USR2): heard from before the processes
# join, where SIGTERM keeps its default until they have (the launcher's stop ends a process waiting to join)
NOTICES = (signal.SIGUSR1, signal.SIGUSR2)
# what signal.signal takes and gives back: a function, SIG_DFL or SIG_IGN, or None (one not set from Python)
Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


def _say(text: str) -> None:
    """One line on stderr from a signal handler, written to its file descriptor. A handler runs in the main
    thread between two of its bytecodes, possibly inside a write that holds a lock (the process log's copy,
    job.observe.process_log); logging or print would wait for that lock forever, and the step with it, while
    every other process waits in the next collective."""
    os.write(2, f"{time.strftime('%H:%M:%S')} WARNING {__name__}: {text}\n".encode())


class EarlyNotice:
    """The notices' handler from a process's first line until the loop's guard takes them: it remembers the
    signal, and the guard that replaces it inherits it (the run then stops before its first step, 75).

    Without it a notice during start-up (imports, joining) would end the task by the signal's default
    action, exit 128 + 12, which no batch script requeues; Slurm sends a requeued job's tasks a notice
    again at their start where it had not reached every task the first time."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if signum == INTERRUPT and self.received == INTERRUPT:
            os.write(2, b"second Ctrl-C during start-up: stopping now\n")
            leave(STOPPED_EXIT_CODE)  # alone: a peer may not have heard it
        if self.received is None:  # os.write: no lock a signal could interrupt
            code = STOPPED_EXIT_CODE if signum == INTERRUPT else REQUEUE_EXIT_CODE
            os.write(2, f"received {signal.Signals(signum).name} during start-up: the run stops with {code} once "
                        "it can\n".encode())
        self.received = signum if self.received is None or signum == INTERRUPT else self.received


def hear_notices_early(interrupt: bool = False) -> None:
    """Take the notices (USR1, USR2; with `interrupt`, Ctrl-C's SIGINT too) with an EarlyNotice: the first thing
    `python -m job` and a Slurm task do. One already there is kept, with what it heard."""
    notice = EarlyNotice()
    for sig in (*NOTICES, *((INTERRUPT,) if interrupt else ())):
        if not isinstance(signal.getsignal(sig), EarlyNotice):
            signal.signal(sig, notice)


class PreemptionGuard:
    """Install on entry, restore the previous handlers on exit; unless the processes agreed to stop: then
    the process is leaving with REQUEUE_EXIT_CODE, and the guard keeps the signals to its end, so that a
    later one (srun stopping the tasks still ending once a peer has left with 75) cannot turn that exit
    into a kill."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() when this process heard it (None: not itself)
        self.stopping = False  # should_stop said so: every process is saving and leaving
        self.interrupted = False  # ... and one of them heard Ctrl-C: they leave with STOPPED_EXIT_CODE
        self.sync_point = False  # jax's preemption notifier holds SIGTERM; steps stop at its sync point (joined)
        self._told = False  # a signal this guard heard was passed on to jax's notifier
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> PreemptionGuard:
        for sig in self.signals:
            self._previous[sig] = previous = signal.signal(sig, self._on_signal)
            self._inherit(previous)
        return self

    def _inherit(self, previous: object) -> None:
        """A signal an EarlyNotice heard during start-up, taken once (Ctrl-C's over a notice)."""
        if isinstance(previous, EarlyNotice) and previous.received is not None:
            if self.received is None or previous.received == INTERRUPT:
                self.received = previous.received
                self.received_at = time.monotonic()
            previous.received = None

    def take(self, *signals: signal.Signals) -> None:
        """Hear `signals` too from now on (Ctrl-C's SIGINT once the processes have joined; SIGTERM in a single
        process: `joined`)."""
        for sig in signals:
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)
            self._inherit(previous)
        self.signals = tuple(dict.fromkeys((*self.signals, *signals)))

    def __exit__(self, *exc: object) -> None:
        if self.stopping:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        """What a stop the processes agreed on exits with: STOPPED_EXIT_CODE after Ctrl-C (on any process), else
        REQUEUE_EXIT_CODE (a preemption notice)."""
        return STOPPED_EXIT_CODE if self.interrupted else REQUEUE_EXIT_CODE

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == INTERRUPT and self.received == INTERRUPT:  # os.write: no lock a signal could interrupt
            os.write(2, f"second Ctrl-C: stopping now, exit {STOPPED_EXIT_CODE}; a save in flight is never listed, "
                        "the same command resumes from the newest complete one\n".encode())
            leave(STOPPED_EXIT_CODE)  # alone: a peer may not have heard it
        name = signal.Signals(signum).name
        if self.stopping:
            _say(f"received {name} while leaving with {self.exit_code}: the saved exit stands")
            return
        if self.received is None or signum == INTERRUPT:
            again = " (Ctrl-C again stops at once)" if signum == INTERRUPT else ""
            _say(f"received {name}: will save and stop at the next step boundary{again}")
            self.received = signum
            self.received_at = time.monotonic()

    def since_signal(self) -> float | None:
        """Seconds since this process heard the signal it stops for; None when it heard none itself (a peer's)."""
        return None if self.received_at is None else time.monotonic() - self.received_at

    def joined(self, env: Mapping[str, str] = os.environ) -> None:
        """After job.initialize: hear Ctrl-C's SIGINT from now on, and SIGTERM too unless the steps stop at the
        coordination service's sync point (a multi-process run on TPU or GPU, or SYNC_POINT_ENV=1: jax's notifier
        holds SIGTERM)."""
        import jax  # python -m job and deploy/ import this module: they start without jax

        self.sync_point = (sync_point_wanted(env, jax.default_backend())
                           and internals.preemption_sync_manager() is not None)
        self.take(*((INTERRUPT,) if self.sync_point else (signal.SIGTERM, INTERRUPT)))

    def should_stop(self, step: int | None = None) -> bool:
        """True on every process, at the same call, when any process got a signal.

        With `step` (the loop's, once after every step: the same on every process, rising by one) a multi-process
        run asks the coordination service's preemption sync point (`reached_preemption_sync_point`): no device
        work and no host sync until a notice comes, then every process stops at the step after the one the
        furthest had reached. A signal this guard heard is passed on to jax's notifier as the SIGTERM it listens
        for. Without `step` (before the first step, during evaluation) it is one collective, which also reads
        whether jax's notifier was told of a SIGTERM anywhere."""
        import jax  # python -m job and deploy/ import this module: they start without jax
        from jax.experimental import multihost_utils

        mine = np.int32(0 if self.received is None else 2 if self.received == INTERRUPT else 1)
        if jax.process_count() == 1:
            every = np.asarray(mine)
        else:
            if step is not None and self.sync_point:
                if self.received is not None and not self._told:  # jax's notifier hears SIGTERM only
                    self._told = True
                    os.kill(os.getpid(), signal.SIGTERM)
                if not multihost_utils.reached_preemption_sync_point(step):
                    return False
                mine = np.maximum(mine, 1)  # every process is here, at the same step: the gather says if Ctrl-C
            elif self.sync_point and not mine and _notice_posted():
                mine = np.int32(1)
            every = np.asarray(multihost_utils.process_allgather(mine))
        self.stopping = bool(np.any(every))
        self.interrupted = bool(np.any(every == 2))
        return self.stopping


def sync_point_wanted(env: Mapping[str, str], backend: str) -> bool:
    """Whether the steps should stop at the coordination service's sync point: SYNC_POINT_ENV "1" or "0", else
    (unset, empty or "auto") on the backends of SYNC_POINT_BACKENDS."""
    value = env.get(SYNC_POINT_ENV, "").strip().lower()
    if value not in ("", "auto", "0", "1"):
        raise ConfigError(SYNC_POINT_ENV, expected="1 (the sync point), 0 (a collective after each step) or auto",
                          found=env[SYNC_POINT_ENV], fix=f"unset {SYNC_POINT_ENV} (auto: the sync point on TPU and "
                          "GPU, the collective on CPU), or set it to 1 or 0")
    return value == "1" or (value in ("", "auto") and backend in SYNC_POINT_BACKENDS)


def _notice_posted() -> bool:
    """Whether jax's preemption notifier told the coordination service of a notice (a SIGTERM to any process)."""
    client = internals.coordination_client()
    try:
        return client is not None and bool(client.key_value_try_get(internals.PREEMPTION_NOTICE_KEY))
    except Exception:  # noqa: BLE001 - NOT_FOUND (no notice yet) is raised as jax's runtime error
        return False
