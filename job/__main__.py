"""`python -m job COMMAND`: the entry point every target runs.

    python -m job train [--steps 200 --model.layers 2 ...]   # the example training job
    python -m job demo                                        # cluster smoke test
    python -m job tokenize INPUT.txt OUTPUT.npy               # text -> byte-level token file
"""

from __future__ import annotations

import logging
import sys

from job.errors import ConfigError

USAGE = __doc__.strip().split("\n", 1)[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("train", [])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if command == "train" or command.startswith("--"):
        from job import config, train

        cfg = config.parse(rest if command == "train" else args)
        try:
            config.validate(cfg)  # bad input: one clear line and exit 2, before anything starts
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        code = train.run(cfg)
        _shutdown()
        return code
    if command == "demo" and not rest:
        from job.demo import DemoConfig, run

        run(DemoConfig())
        return 0
    if command == "tokenize" and len(rest) == 2:
        from job.data import tokenize_text

        try:
            count = tokenize_text(rest[0], rest[1])
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {count} byte-level tokens to {rest[1]}")
        return 0
    print(f"usage:\n{USAGE}\nexpected one of the commands above, found {' '.join(args)!r}", file=sys.stderr)
    return 2


def _shutdown() -> None:
    """A clean end: leave the distributed runtime together (its shutdown barrier)."""
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
