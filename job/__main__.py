"""`python -m job COMMAND`: the entry point every target runs.

    python -m job train [--task lm] [--steps 200 --model.layers 2 ...]   # train a task (job/tasks/NAME/)
    python -m job demo                                        # cluster smoke test of the library
    python -m job tokenize INPUT.txt OUTPUT.npy [--tokenizer tokenizer.json]  # text -> token file (the lm task's)
    python -m job plot RUN_DIR                                # loss, lr, throughput -> RUN_DIR/metrics.png
    python -m job plot SWEEP_DIR                              # every run's eval loss -> SWEEP_DIR/eval_loss.png
    python -m job sweep SPEC [--devices N] -- ARGS...         # check every run of a sweep, list its run dirs and flags
    python -m job runs SWEEP_DIR|RUN_DIR [--by eval_loss] [--max]  # one table of a sweep's runs (or one run), the best marked
    python -m job sweep-run SWEEP_DIR [INDEX]                 # run INDEX of SWEEP_DIR/sweep.json (a Slurm array element)
    python -m job check-run-dir gs://BUCKET/run1              # can this host write there? exit 0, or why and 2
    python -m job rerun RUN_DIR [NEW_RUN_DIR]                 # replay RUN_DIR's recorded command into a new run dir
    python -m job eval --run-dir RUN_DIR [--step N]           # evaluate a checkpoint (any topology): RUN_DIR/eval-N.json
    python -m job export --run-dir RUN_DIR OUT [--step N]     # the trained model's state alone, an orbax checkpoint
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable

from job.core import exits
from job.core.errors import ConfigError
from job.observe import plot
from job.runtime.leaving import leave
from job.runtime.preemption import hear_notices_early
from job.train import entry, task

USAGE = __doc__.strip().split("\n", 1)[1]


def main(argv: list[str] | None = None) -> int:
    hear_notices_early()  # a scheduler's notice during start-up stops the run with 75, not by its default action
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["train"]:  # Ctrl-C during start-up: the run stops with 130 once it can (twice: at once)
        hear_notices_early(interrupt=True)
    if not args or args[0] in ("-h", "--help", "help"):  # the commands; nothing trains without `train`
        print(f"usage: python -m job COMMAND [ARGS]\n\n{USAGE}\n\n`python -m job COMMAND --help` shows a command's "
              "own flags", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command.startswith("-"):
        print(f"error: python -m job: expected a command first (train, eval, runs, ...: python -m job --help), found "
              f"{command!r}. Fix: python -m job train {' '.join(args)}", file=sys.stderr)
        return 2
    return _command(command, rest)


def _command(command: str, rest: list[str]) -> int:
    """`python -m job COMMAND REST...`: the library's command of that name, else the task's."""
    if command == "train":
        return entry.train(rest)
    if command == "rerun":
        # etils: only this command loads it
        from job.runs.provenance import rerun_command

        return entry.command(rerun_command, rest)
    if command in ("eval", "export"):
        # jax, flax and orbax: only eval and export load them
        from job.train import trained

        return entry.command(trained.eval_command if command == "eval" else trained.export_command, rest)
    if command == "check-run-dir":
        # etils: only this command loads it
        from job.core.storage import check_run_dir_command

        return entry.command(check_run_dir_command, rest)
    if command == "plot":
        return entry.command(plot.main, rest)
    if command == "runs":
        # etils: only this command loads it
        from job.observe import runs_table

        return entry.command(runs_table.main, rest)
    if command == "sweep":
        # etils: only this command loads it
        from job.train.sweep_check import sweep_command

        return entry.command(sweep_command, rest)
    if command == "sweep-run":
        return _sweep_run(rest)
    if command == "demo" and not rest:
        return entry.command(_demo(), rest)
    return entry.command(lambda args: _task_command(command, args), rest)


def _sweep_run(rest: list[str]) -> int:
    """`python -m job sweep-run SWEEP_DIR [INDEX]`: one run of a sweep, trained with its flags."""
    # etils: only this command loads it
    from job.runs.sweep import element_flags

    try:
        flags = element_flags(rest, os.environ)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return main(["train", *flags] if flags and flags[0].startswith("-") else list(flags))  # a sweep's base


def _demo() -> Callable[[list[str]], int]:
    """`python -m job demo`: the library's cluster smoke test, its modules loaded."""
    # jax and flax: only the demo loads them
    from job.runtime.demo import DemoConfig, run

    def demo(_: list[str]) -> int:
        run(DemoConfig())  # its checks raise; what it returns is the checked value
        return 0

    return demo


def _task_command(command: str, args: list[str]) -> int:
    """A task's own command: `python -m job sample --task NAME ...` (the default task's without --task)."""
    extra = task.load(task.task_name(args)).commands.get(command)
    if extra is None:
        print(f"usage:\n{USAGE}\nexpected one of the commands above, found {' '.join([command, *args])!r}",
              file=sys.stderr)
        return 2
    return extra(task.without_task(args))


def skip_final_collection() -> None:
    """Python's last garbage collection at exit walks every object jax, flax and orbax made: 1 to 2 s of one
    core per process. What must happen at exit does not wait for it (saves are awaited and files closed before
    main returns; atexit handlers and the flush of stdout and stderr still run), so it is skipped."""
    gc.freeze()


if __name__ == "__main__":
    code = main()
    skip_final_collection()
    if code in (exits.REQUEUE, exits.STOPPED):  # saved and stopped, every process: the requeue waits for no teardown
        leave(code, together=True)
    sys.exit(code)
