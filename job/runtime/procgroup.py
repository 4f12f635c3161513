"""A group of child processes that live and die together.

Used by the local launcher (and by anything else that runs N ranks on one
machine). Each child runs in its own session so a signal can reach its whole
process tree; its output is copied line by line with a ``[rank N]`` prefix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import IO

from job.core import exits
from job.runtime.watchdog import STACKS_SIGNAL

log = logging.getLogger("job.launch")

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = (signal.SIGINT, signal.SIGTERM)
# Deaths no rank chooses (job/core/exits.py): such a rank is the cause even when its peers' reactions are reaped
# first: a big process takes a while to be torn down after SIGKILL, its peers see the connection drop and exit at
# about the same time.
CRASHES = exits.CRASHES
# Gloo prints "[Gloo] Rank N is connected to M peer ranks. Expected number of
# connected peer ranks is : M" once per device, from several threads at once,
# so the pieces interleave into fragment lines. They drown real output at scale.
_GLOO_WORDS = re.compile(
    r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d+|\s+"
)
_GLOO_WINDOW = 4  # fragment lines that may follow a gloo line


class GlooFilter:
    """Drops gloo's connection lines and the fragments that follow them, per stream."""

    def __init__(self) -> None:
        self._since_gloo = _GLOO_WINDOW

    def keep(self, line: str) -> bool:
        if "[Gloo]" in line or "is connected to" in line:
            self._since_gloo = 0
            return False
        self._since_gloo += 1
        return not (self._since_gloo <= _GLOO_WINDOW and not _GLOO_WORDS.sub("", line))


def exit_code(returncode: int) -> int:
    """A child's return code as a shell would report it (killed by signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """"exited with code 1", "exited with code 86 (no step within the watchdog's timeout)", or "was killed by
    SIGKILL (code 137)"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (code {exit_code(returncode)})"
    return f"exited with code {exits.describe(returncode)}"


class ProcessGroup:
    def __init__(
        self,
        command: list[str],
        envs: list[dict[str, str]],
        *,
        prefix: bool = True,
        kill_after_s: float = 5.0,
        stop_timeout_s: float = 60.0,
        poll_s: float = 0.05,
        stacks_s: float = 2.0,
    ) -> None:
        self.command = command
        self.envs = envs
        self.prefix = prefix
        self.kill_after_s = kill_after_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.stacks_s = stacks_s  # how long stuck processes get to write their stacks before they are killed
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[threading.Thread] = []
        self._waiters: list[threading.Thread] = []
        self._write_lock = threading.Lock()
        self._signals: list[int] = []
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._error_dir: str | None = None  # each rank's exits.ERROR_FILE_ENV, while it runs

    # ------------------------------------------------------------------ output
    def _pump(self, rank: int, pipe: IO[bytes], out: IO[str]) -> None:
        tag = f"[rank {rank}] " if self.prefix else ""
        noise = GlooFilter()
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not noise.keep(line):
                continue
            with self._write_lock:
                out.write(tag + (line if line.endswith("\n") else line + "\n"))
                out.flush()
        pipe.close()

    # ------------------------------------------------------------------ signals
    def _send(self, sig: int, procs: list[subprocess.Popen[bytes]] | None = None) -> None:
        for proc in procs if procs is not None else self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)
        if signum in STOPPING and self._signals.count(signum) > 1:
            log.warning("second %s: killing every process now", signal.Signals(signum).name)
            self._send(signal.SIGKILL)
            return
        if signum == signal.SIGINT:
            log.warning("forwarding SIGINT to %d processes: python -m job train saves at the next step and stops "
                        "with 130 (the same command resumes); Ctrl-C again kills them at once", len(self.procs))
        else:
            log.info("forwarding %s to %d processes", signal.Signals(signum).name, len(self.procs))
        self._send(signum)

    # ------------------------------------------------------------------ running
    def start(self) -> None:
        for rank, env in enumerate(self.envs):
            if self._error_dir is not None:
                env = {**env, exits.ERROR_FILE_ENV: self._error_file(rank)}
            proc = subprocess.Popen(
                self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            self.procs.append(proc)
            for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                thread = threading.Thread(target=self._pump, args=(rank, pipe, out), daemon=True)
                thread.start()
                self._pumps.append(thread)
            # One waiter per child: exits arrive in the order they were reaped.
            waiter = threading.Thread(target=lambda r=rank, p=proc: self._exits.put((r, p.wait())), daemon=True)
            waiter.start()
            self._waiters.append(waiter)

    def _stop_others(self, failed_rank: int, returncode: int) -> set[int]:
        """Stop the group after a failure; return the ranks that had ended before the launcher's own SIGKILL."""
        log.error(
            "rank %d %s; stopping the other %d process(es)",
            failed_rank, describe_exit(returncode), sum(p.poll() is None for p in self.procs),
        )
        self._send(signal.SIGTERM)
        self._send(signal.SIGCONT)  # a stopped (SIGSTOP, frozen) process acts on SIGTERM only once continued
        self._wait_all(self.kill_after_s)
        ended = {rank for rank, proc in enumerate(self.procs) if proc.poll() is not None}
        self._send(signal.SIGKILL)
        return ended

    def _error_file(self, rank: int) -> str:
        assert self._error_dir is not None
        return os.path.join(self._error_dir, f"rank-{rank}")

    def _errors(self, ranks: Iterable[int]) -> dict[int, tuple[float, str]]:
        """Each of `ranks` that recorded the exception that ended it (exits.ERROR_FILE_ENV): when, and its line."""
        recorded = {}
        for rank in ranks if self._error_dir is not None else ():
            try:
                with open(self._error_file(rank), encoding="utf-8") as text:
                    when, _, what = text.read().strip().partition(" ")
                recorded[rank] = (float(when), what)
            except (OSError, ValueError):
                continue
        return recorded

    def _cause(self, first: tuple[int, int], ended: set[int]) -> int:
        """The exit code of the failure that caused the others: a crash (CRASHES) the launcher did not cause, else the
        failure whose exception came first (a peer that lost it fails a moment later and may be reaped first), else
        the first failure reaped."""
        for waiter in self._waiters:
            waiter.join()
        reaped = [first]
        while not self._exits.empty():
            reaped.append(self._exits.get_nowait())
        crashed = [(rank, rc) for rank, rc in reaped if rank in ended and -rc in CRASHES]
        if -first[1] in CRASHES or (crashed and crashed[0] == first):
            return exit_code(first[1])
        if not crashed:  # both raised: the earlier exception is the cause, where the first one reaped says when
            failed = {rank: rc for rank, rc in reaped if rank in ended and rc != 0}
            errors = self._errors(failed)
            if first[0] not in errors:
                return exit_code(first[1])
            rank = min(errors, key=lambda r: errors[r][0])
            if rank == first[0]:
                return exit_code(first[1])
            code = failed[rank] if failed[rank] > 0 else exit_code(first[1])  # its own exit, not the launcher's stop
            log.error("rank %d raised first (%s), %.2f s before rank %d, and %s: that is the cause, rank %d's exit "
                      "was its reaction; exiting %d", rank, errors[rank][1], errors[first[0]][0] - errors[rank][0],
                      first[0], describe_exit(failed[rank]), first[0], code)
            return code
        rank, rc = crashed[0]
        log.error(
            "rank %d %s: that is the cause, rank %d's exit was its reaction (a rank does not die by %s when it "
            "loses a peer); exiting %d", rank, describe_exit(rc), first[0], signal.Signals(-rc).name, exit_code(rc),
        )
        return exit_code(rc)

    def _wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(self.poll_s)

    def _show_stuck(self) -> None:
        """The ranks still running past the stop's wait, named, and each one's stacks (STACKS_SIGNAL, which
        job.initialize sets up) before the launcher kills them."""
        stuck = [rank for rank, proc in enumerate(self.procs) if proc.poll() is None]
        log.error(
            "rank(s) %s still running %.0f s after the signal; their stacks follow, then they are killed. A JAX "
            "program takes SIGTERM as a preemption notice and runs on unless it acts on it (python -m job does; "
            "otherwise see multihost_utils.reached_preemption_sync_point). Fix: a second SIGTERM or SIGINT kills "
            "at once; --stop-timeout sets this wait", ", ".join(map(str, stuck)), self.stop_timeout_s,
        )
        for rank in stuck:  # the process itself, not its group: its own children are not asked
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[rank].pid, STACKS_SIGNAL)
        time.sleep(self.stacks_s)

    def watch(self) -> int:
        """Block until every child has exited; return the failure's code (see `_cause`), or 0."""
        stop_deadline: float | None = None
        running = len(self.procs)
        while running:
            if stop_deadline is None and set(self._signals) & set(STOPPING):
                stop_deadline = time.monotonic() + self.stop_timeout_s
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                self._show_stuck()
                self._send(signal.SIGKILL)
                stop_deadline = float("inf")
            try:
                rank, rc = self._exits.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            running -= 1
            if rc != 0:
                if stop_deadline is None:
                    ended = self._stop_others(rank, rc)
                    self._finish()
                    return self._cause((rank, rc), ended)
                self._wait_all(self.kill_after_s)
                self._send(signal.SIGKILL)
                self._finish()
                return exit_code(rc)
        self._finish()
        return 0

    def _finish(self) -> None:
        for proc in self.procs:
            proc.wait()
        for thread in self._pumps:
            thread.join(timeout=5)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}
        with tempfile.TemporaryDirectory(prefix="job-launch-") as errors:
            self._error_dir = errors
            try:
                self.start()
                return self.watch()
            finally:
                self._send(signal.SIGKILL)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                self._error_dir = None
