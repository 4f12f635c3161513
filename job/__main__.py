"""`python -m job COMMAND`: the entry point every target runs.

    python -m job train [--task lm] [--steps 200 --model.layers 2 ...]   # train a task (job/tasks/NAME/)
    python -m job demo                                        # cluster smoke test of the library
    python -m job tokenize INPUT.txt OUTPUT.npy               # text -> byte-level token file (the lm task's)
    python -m job plot RUN_DIR                                # loss, lr, throughput -> RUN_DIR/metrics.png
    python -m job check-run-dir gs://BUCKET/run1              # can this host write there? exit 0, or why and 2
    python -m job rerun RUN_DIR [NEW_RUN_DIR]                 # replay RUN_DIR's recorded command into a new run dir
    python -m job eval --run-dir RUN_DIR [--step N]           # evaluate a checkpoint (any topology): RUN_DIR/eval-N.json
    python -m job export --run-dir RUN_DIR OUT [--step N]     # the trained model's state alone, an orbax checkpoint
"""

from __future__ import annotations

import logging
import sys

from job.errors import BAD_INPUT_EXIT_CODE, ConfigError

USAGE = __doc__.strip().split("\n", 1)[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("train", [])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src", "orbax", "fsspec", "gcsfs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if command == "train" or command.startswith("--"):
        from job import config, loop, task

        flags = rest if command == "train" else args
        try:
            chosen = task.load(task.task_name(flags))
            cfg = config.parse(flags, chosen)
            config.validate(cfg, chosen)  # bad input: one clear line and exit 2, before anything starts
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return BAD_INPUT_EXIT_CODE
        try:
            code = loop.run(cfg, chosen, ["train", *flags])
        except ConfigError as exc:  # found inside the run (a state unlike the saved one, ...): still bad input
            if not _distributed():  # printed as job.initialize's exit hook prints it
                if not exc.reported:
                    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
                return BAD_INPUT_EXIT_CODE
            raise  # job.initialize's exit hook prints it and ends this process with 2, skipping the shutdown barrier
        _shutdown()
        return code
    if command == "rerun":
        from job.provenance import rerun_command

        return rerun_command(rest)
    if command in ("eval", "export"):
        from job import trained

        if command == "export":
            return trained.export_command(rest)
        try:
            code = trained.eval_command(rest)
        except ConfigError as exc:
            if not _distributed():
                print(f"error: {exc}", file=sys.stderr)
                return BAD_INPUT_EXIT_CODE
            raise  # job.initialize's exit hook prints it and exits with 2
        _shutdown()
        return code
    if command == "check-run-dir":
        from job.storage import check_run_dir_command

        return check_run_dir_command(rest)
    if command == "plot":
        from job import plot

        return plot.main(rest)
    if command == "demo" and not rest:
        from job.demo import DemoConfig, run

        run(DemoConfig())
        return 0
    from job import task

    try:  # a task's own commands: `python -m job sample --task NAME ...` (the default task's without --task)
        extra = task.load(task.task_name(rest)).commands.get(command)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    if extra is not None:
        return extra(task.without_task(rest))
    print(f"usage:\n{USAGE}\nexpected one of the commands above, found {' '.join(args)!r}", file=sys.stderr)
    return 2


def _distributed() -> bool:
    import jax

    return jax.distributed.is_initialized()


def _shutdown() -> None:
    """A clean end: leave the distributed runtime together (its shutdown barrier)."""
    import jax

    if _distributed():
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
