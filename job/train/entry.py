"""What every entry point does around its work: logging, bad input as exit 2, a clean distributed end.

`python -m job` is built from these; a fork's own script uses them instead of copying it:

    # mypkg/train.py: python -m job.launch -n 2 -- python -m mypkg.train --steps 100
    import sys
    from job.train import entry

    if __name__ == "__main__":
        sys.exit(entry.train(sys.argv[1:], task="mypkg.tasks:TASK"))  # the default --task

    # or any program of its own, with the same set-up and shutdown:
    def my_main(argv: list[str]) -> int:
        job.initialize(); ...; return 0
    sys.exit(entry.command(my_main, sys.argv[1:]))
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator

from job.core.errors import BAD_INPUT_EXIT_CODE, ConfigError
from job.runtime import cluster
from job.train import task as tasks

QUIET_LOGGERS = ("absl", "jax", "orbax", "fsspec", "gcsfs")
PARSE_GRACE_S = 5.0  # a usage error: how long a process other than 0 waits for process 0 to print it and exit


def setup_logging() -> None:
    """INFO lines with the time and the logger's name; other libraries' chatter at WARNING."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # a library's own basicConfig came first (absl's first log line, at import)
        if type(handler) is logging.StreamHandler and handler.stream is sys.stderr and handler.formatter is not None \
                and handler.formatter._fmt == logging.BASIC_FORMAT:
            root.removeHandler(handler)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def command(fn: Callable[[list[str]], int], argv: list[str]) -> int:
    """`fn(argv)` with logging set up: its exit code, BAD_INPUT_EXIT_CODE (2) with one line on stderr for
    a ConfigError, and, where it joined one, the distributed runtime left together (its shutdown
    barrier) when it ends well.

    A ConfigError raised after `job.initialize` is left to its exit hook, which prints it and ends every
    process with 2 without the shutdown barrier that the other processes would never reach."""
    setup_logging()
    try:
        code = fn(argv)
    except ConfigError as exc:
        if _distributed():
            raise
        if not exc.reported:
            print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    _shutdown()
    return code


def train(argv: list[str], task: str | None = None) -> int:
    """`python -m job train ARGV`; `task` (NAME or MODULE:ATTR) is the --task when ARGV gives none. The
    run records it, so `python -m job eval` and `rerun` find the same task."""
    if task is not None and tasks.task_name(argv, default=None) is None:
        argv = ["--task", task, *argv]
    return command(_train, argv)


def _train(flags: list[str]) -> int:
    # training's own: python -m job imports this module for every command
    from job.train import config, loop

    chosen = tasks.load(tasks.task_name(flags))
    with parsing():
        cfg = config.parse(flags, chosen)
    config.validate(cfg, chosen)  # bad input: one clear line and exit 2, before anything starts
    try:
        return loop.run(cfg, chosen, ["train", *flags])
    except ConfigError as exc:  # found inside the run (a state unlike the saved one, ...): still bad input
        if not _distributed() and not exc.reported:  # printed as job.initialize's exit hook prints it
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            exc.reported = True
        raise


@contextlib.contextmanager
def parsing() -> Iterator[None]:
    """Around the parse of a command line that every process of a job parses alike (tyro, argparse): a usage
    error (tyro's box, argparse's usage line; SystemExit 2) and --help are printed by process 0 only. Every other
    process parses with its output kept and, on a usage error, waits PARSE_GRACE_S before it exits with the same
    code: a launcher stops the others at the first exit, which is then process 0's, its message printed.

        with entry.parsing():
            args = parser.parse_args(argv)
    """
    if _process_zero():
        yield
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            time.sleep(PARSE_GRACE_S)
        raise


def _process_zero() -> bool:
    """Whether this is process 0 of its job, told from the environment (before `job.initialize`); a process
    whose environment does not say is one."""
    try:
        return cluster.detect(os.environ).process_id == 0
    except ConfigError:  # a bad cluster environment: job.initialize says so, after the parse
        return True


def _distributed() -> bool:
    if "jax" not in sys.modules:  # a command that never imported jax (plot, runs, sweep) never joined a cluster
        return False
    import jax  # python -m job imports this module: plot, runs, sweep start without jax

    return jax.distributed.is_initialized()


def _shutdown() -> None:
    if _distributed():
        import jax  # imported already (_distributed): the name only

        jax.distributed.shutdown()


__all__ = ["PARSE_GRACE_S", "QUIET_LOGGERS", "command", "parsing", "setup_logging", "train"]
