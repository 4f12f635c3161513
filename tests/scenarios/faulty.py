"""The real training job (`python -m job ARGS`) with one fault injected into one rank.

    faulty.py RANK FAULT -- train --run-dir ... [job flags]

On every rank but RANK this is exactly `python -m job`. On RANK, FAULT is:

    kill@N      SIGKILL itself when step N starts (a crashed host)
    stop@N      SIGSTOP itself when step N starts (a frozen host: no heartbeats)
    sleep@N     block forever in Python when step N starts (a hung input pipeline:
                the runtime's heartbeats go on, the collective never completes)
    raise@N     raise RuntimeError when step N starts (a bug in rank RANK)
    usr1@N      SIGUSR1 itself when step N starts (a preemption notice during that step)
    exit-early  exit 3 before joining the cluster (a process that never starts)
    hang-early  block forever before joining the cluster
    term-at-start  SIGTERM itself once start-up is over (state built and restored), before step 1
    usr2-at-join   USR2 itself (a scheduler's notice) just before joining the cluster
    slow-rows=MS   every batch of rows costs MS milliseconds more on this rank (a slow input host)
    rows-hang@N    block forever in the data source when step N's train rows are asked for (a stuck input
                   pipeline: the others wait in step N's collectives)
    version=P:V report package P at version V (a host with another image)
    flag=F:V    append `F V` to the job's flags (a host started with other flags)

Just before a timed fault it prints `FAULT <unix time>` so tests can measure
how long the whole job takes to end.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from job import __main__ as entry
from job.runtime import preflight
from job.train import steps

rank, fault = int(sys.argv[1]), sys.argv[2]
args = sys.argv[sys.argv.index("--") + 1:]
me = int(os.environ.get("JOB_LAUNCH_PROCESS_ID", os.environ.get("SLURM_PROCID", "0")))


def announce() -> None:
    print(f"FAULT {time.time():.3f} {fault} on rank {me}", flush=True)


def at_step(n: int, action) -> None:
    """Run `action` when the n-th train step of this process starts."""
    real_jit, calls = steps.jit_train_step, [0]

    def jit(*args, **kwargs):
        real = real_jit(*args, **kwargs)

        def step(*a, **k):
            calls[0] += 1
            if calls[0] == n:
                announce()
                action()
            return real(*a, **k)

        step.lower = real.lower  # the loop compiles the step ahead of its first call
        return step

    steps.jit_train_step = jit


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def injected() -> None:
    raise RuntimeError(f"injected fault in rank {me}")


if me == rank:
    kind, _, value = fault.partition("@") if "@" in fault else fault.partition("=")
    if kind == "kill":
        at_step(int(value), lambda: os.kill(os.getpid(), signal.SIGKILL))
    elif kind == "stop":
        at_step(int(value), lambda: os.kill(os.getpid(), signal.SIGSTOP))
    elif kind == "sleep":
        at_step(int(value), sleep_forever)
    elif kind == "raise":
        at_step(int(value), injected)
    elif kind == "usr1":
        at_step(int(value), lambda: os.kill(os.getpid(), signal.SIGUSR1))
    elif kind == "exit-early":
        announce()
        os._exit(3)
    elif kind == "term-at-start":
        real_jit_train_step = steps.jit_train_step

        def signalled(*a, **k):  # the loop makes its step once start-up is done, before its first step
            announce()
            os.kill(os.getpid(), signal.SIGTERM)
            return real_jit_train_step(*a, **k)

        steps.jit_train_step = signalled
    elif kind == "usr2-at-join":
        from job.train import loop

        real_initialize = loop.initialize

        def noticed(*a, **k):
            announce()
            os.kill(os.getpid(), signal.SIGUSR2)
            return real_initialize(*a, **k)

        loop.initialize = noticed
    elif kind == "slow-rows":
        from job.train import batches

        real_global_batch = batches.global_batch

        def slow_global_batch(*a, **k):
            time.sleep(float(value) / 1e3)
            return real_global_batch(*a, **k)

        batches.global_batch = slow_global_batch
    elif kind == "rows-hang":
        from job.train import batches

        real_global_batch = batches.global_batch

        def stuck_global_batch(*a, **k):
            if k.get("split") == "train" and k.get("step") == int(value) - 1:  # the loop counts steps from 0
                announce()
                sleep_forever()
            return real_global_batch(*a, **k)

        batches.global_batch = stuck_global_batch
    elif kind == "hang-early":
        announce()
        sleep_forever()
    elif kind == "version":
        package, version = value.split(":", 1)
        real_version = preflight.version
        preflight.version = lambda p: version if p == package else real_version(p)
    elif kind == "flag":
        args += value.split(":", 1)
    else:
        raise SystemExit(f"faulty.py: unknown fault {fault!r}")

sys.exit(entry.main(args))
