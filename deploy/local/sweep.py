"""A sweep on this machine: its runs one after another, each through the local launcher (`make run-local SWEEP=...`).

    python -m deploy.local.sweep --sweep 'optim.lr=1e-3,3e-3 seed=0,1' -n 4 --devices-per-process 2 \
        -- train --steps 40 --run-dir runs/sweep1
    python -m deploy.local.sweep --sweep sweeps/lr.txt -n 4 --devices-per-process 2 --dry-run -- train ...

Every run is checked first (the batch against NPROC x DEVICES devices too); one bad value stops
everything before the first run starts (exit 2). Then SWEEP_DIR/sweep.json is written and each run
not yet completed runs as `python -m job.launch -n N --devices-per-process D -- python -m job FLAGS`;
a run that was stopped resumes from its own checkpoints. The first run that fails stops the sweep:
its exit code is the sweep's, and the runs after it are not started (running the same command again
skips the completed ones and resumes the rest: `deploy.sweeps.in_turn`). SIGINT and SIGTERM reach the
running run's launcher.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import subprocess
import sys
from types import FrameType

from deploy import sweeps
from job.core import values
from job.errors import ConfigError, refuse_dash_values
from job import launch
from job.launch import local_count
from job.runs.sweep import Run

log = logging.getLogger("deploy.local.sweep")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.local.sweep", description=__doc__.split("\n")[0],
                                epilog="then -- and the base ARGS of every run: train ... --run-dir SWEEP_DIR")
    p.add_argument("--sweep", required=True, help="NAME=V1,V2 words in one argument, or a sweep file")
    p.add_argument("-n", "--nproc", type=local_count, required=True, help="processes per run")
    p.add_argument("--devices-per-process", type=local_count, default=None, help="CPU devices per process")
    p.add_argument("--dry-run", type=values.for_argparse(values.switch, fix="DRY_RUN=1, or leave it unset"),
                   nargs="?", const=True, default=False, help="list the runs, run nothing")
    return p


def launch_argv(run: Run, nproc: int, devices: int | None) -> list[str]:
    """The local launcher's command line for one run."""
    return launch.command_line(nproc, devices, run.flags)


def run_all(todo: sweeps.Todo, nproc: int, devices: int | None) -> int:
    """Each run in turn through the launcher (`deploy.sweeps.in_turn`), SIGINT and SIGTERM forwarded to it."""
    current: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        for proc in current:
            proc.send_signal(signum)

    def start(run: Run) -> int:
        current[:] = [subprocess.Popen(launch_argv(run, nproc, devices))]
        try:
            return current[0].wait()
        finally:
            current.clear()

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return sweeps.in_turn(todo, start, again="run the same command")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[sweep] %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    refuse_dash_values(parser, argv[:cut])
    a, base = parser.parse_args(argv[:cut]), argv[cut + 1:]
    devices = a.nproc * (a.devices_per_process or 1)
    try:
        todo = sweeps.runs_to_start(a.sweep, base, devices, save=not a.dry_run)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print("nothing was run", file=sys.stderr)
        return 2
    if a.dry_run:
        print(sweeps.listing(todo.sweep))
        for run in todo.runs:
            print(f"# {run.name}: {shlex.join(launch_argv(run, a.nproc, a.devices_per_process))}")
        print(f"# DRY_RUN=1: {todo.summary()}; nothing run", file=sys.stderr)
        return 0
    log.info("sweep %s: %s", todo.sweep.folder, todo.summary())
    return run_all(todo, a.nproc, a.devices_per_process) if todo.indices else 0


if __name__ == "__main__":
    sys.exit(main())
