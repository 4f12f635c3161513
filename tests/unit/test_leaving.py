"""job.runtime.leaving: the one way a process ends itself. In a real process: its code, its exit handlers run, its
output out; a handler that blocks holds the exit no longer than its bound; jax's own exit handler never clears the
backends; and each caller (a Slurm task, the exit hook, a second Ctrl-C, the watchdog) leaves through it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from job.core import exits

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

# A record held by a MemoryHandler until a flush, a line in stdout's buffer (a pipe: flushed only when asked), an
# exit handler; then BLOCK (more handlers) and the leave.
LEAVES = """
import atexit, logging, logging.handlers, sys, time
from job.runtime.leaving import leave
logging.getLogger("job.runtime.leaving").setLevel(logging.DEBUG)  # its phases, timed
held = logging.getLogger("held")
held.propagate = False
held.addHandler(logging.handlers.MemoryHandler(capacity=100, target=logging.StreamHandler(sys.stderr)))
held.warning("a record held until the flush")
atexit.register(print, "the handler ran")
print("written before", end="")
{block}
leave(int(sys.argv[1]){args})
print("went on")
"""


def _leave(block: str = "", args: str = "", code: int = exits.REQUEUE) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LEAVES.format(block=block, args=args), str(code)],
                          capture_output=True, text=True, timeout=60, env=ENV)
    return proc, time.monotonic() - began


@pytest.mark.parametrize("code", [exits.REQUEUE, exits.HANG, 3])
def test_leave_ends_with_its_code_after_the_exit_handlers_and_the_output_written_before(code: int) -> None:
    proc, _ = _leave(code=code)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "written beforethe handler ran\n", proc.stdout  # nothing after leave ran
    assert "a record held until the flush" in proc.stderr
    assert "leave:" not in proc.stderr  # nothing went wrong, nothing said
    # each phase timed, at DEBUG; on a normal way out no bound is reached
    assert re.search(rf"DEBUG job\.runtime\.leaving: leaving with {code}: exit handlers \d+\.\d{{3}} s, flush "
                     r"\d+\.\d{3} s; no bound reached\n", proc.stderr), proc.stderr


def test_a_handler_that_blocks_holds_the_exit_no_longer_than_its_bound() -> None:
    # registered last, so run first: the handlers after it never run, the flush after them still does
    proc, took = _leave(block="atexit.register(time.sleep, 60)", args=", within_s=1.0", code=exits.HANG)
    assert proc.returncode == exits.HANG, proc.stderr
    assert took < 15, f"expected the exit within the 1 s bound (and the start), found {took:.1f} s"
    assert "leave: its exit handlers did not end within 1 s: leaving without the rest" in proc.stderr
    assert proc.stdout == "written before" and "a record held until the flush" in proc.stderr
    assert "; bound reached: exit handlers\n" in proc.stderr, proc.stderr  # the phase line names it too


def test_a_handler_that_raises_is_printed_and_the_others_still_run() -> None:
    proc, _ = _leave(block="atexit.register(lambda: 1 / 0)")
    assert proc.returncode == exits.REQUEUE
    assert "ZeroDivisionError" in proc.stderr and proc.stdout.endswith("the handler ran\n")


# jax's own exit handler clears the backends (seconds for a TPU runtime): a handler registered before jax's (so run
# after it) sees whether it ran.
JAX_KEPT = """
import atexit, sys
from job.core import internals
from job.runtime.leaving import leave
atexit.register(lambda: print("backends kept", internals.backends_are_initialized(), flush=True))
import jax.numpy as jnp
jnp.ones(2).block_until_ready()
leave(75, together=sys.argv[1] == "together")
"""


def _jax_script(script: str, arg: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120, env=ENV)


@pytest.mark.parametrize("how", ["together", "alone"])
def test_jax_s_own_exit_handler_is_skipped_its_backends_left_to_the_process_end(how: str) -> None:
    proc = _jax_script(JAX_KEPT, how)
    assert proc.returncode == exits.REQUEUE, proc.stderr
    assert proc.stdout.strip() == "backends kept True", (proc.stdout, proc.stderr)


# A stopped run's way out, as python -m job takes it: its command (job.train.entry.command) shuts the distributed
# system down as the run ends, then leave(..., together=True); or leave alone, where nothing shut it down before.
SHUT_ONCE = """
import atexit, logging, socket, sys
import jax
logging.getLogger("job.runtime.leaving").setLevel(logging.DEBUG)
free = socket.socket()
free.bind(("127.0.0.1", 0))
port = free.getsockname()[1]
free.close()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
calls, real = [], jax.distributed.shutdown
jax.distributed.shutdown = lambda: (calls.append(1), real())[1]
atexit.register(lambda: print("shut down", len(calls), "up", jax.distributed.is_initialized(), flush=True))
from job.runtime.leaving import leave
from job.train import entry
leave(entry.command(lambda argv: 75, []) if sys.argv[1] == "command" else 75, together=True)
"""


@pytest.mark.parametrize("before", ["command", "nothing"])
def test_a_stopped_run_shuts_the_distributed_system_down_once(before: str) -> None:
    proc = _jax_script(SHUT_ONCE, before)
    assert proc.returncode == exits.REQUEUE, proc.stderr
    assert proc.stdout.strip() == "shut down 1 up False", (proc.stdout, proc.stderr)
    shut = re.search(r"leaving with 75: jax's distributed shutdown \d+\.\d{3} s( \(none left to shut down\))?, "
                     r"exit handlers [0-9.]+ s, flush [0-9.]+ s; no bound reached\n", proc.stderr)
    assert shut is not None, proc.stderr
    assert bool(shut.group(1)) is (before == "command"), proc.stderr  # leave shuts down only what is still up


# Each caller, in a process of its own with an exit handler; the watchdog's before_exit comes after the handlers
# (a process says it left only when nothing but its end is left: process 0 waits for that, then ends).
CALLERS = {
    "a Slurm task's stopped run": (exits.REQUEUE, """
import job.__main__
from deploy.slurm.task import JobTask
job.__main__.main = lambda args: 75
JobTask()(["train"])
"""),
    "an uncaught exception (job.initialize's exit hook)": (1, """
from job.runtime.distributed import _exit_on_uncaught
sys.excepthook = _exit_on_uncaught(sys.excepthook)
raise RuntimeError("a peer is gone")
"""),
    "a second Ctrl-C": (exits.STOPPED, """
import os, signal
from job.runtime.preemption import PreemptionGuard
with PreemptionGuard((signal.SIGINT,)):
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
"""),
    "the hang watchdog": (exits.HANG, """
from job.runtime.watchdog import Watchdog
with Watchdog(0.5, before_exit=lambda: print("before_exit", flush=True)):
    time.sleep(30)
"""),
}


@pytest.mark.parametrize("caller", list(CALLERS))
def test_every_caller_leaves_through_leave_with_its_code_and_its_exit_handlers(caller: str) -> None:
    code, body = CALLERS[caller]
    script = "import atexit, sys, time\natexit.register(print, 'the handler ran', flush=True)\n" + body + \
             "print('went on')\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    lines = proc.stdout.split()
    expected = "the handler ran before_exit" if caller == "the hang watchdog" else "the handler ran"
    assert " ".join(lines) == expected, (proc.stdout, proc.stderr)
