"""`python -m job COMMAND`: the entry point every target runs.

    python -m job demo      # cluster smoke test (what `make run-local` runs for now)
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m job", description="Run a job on this cluster.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="join the cluster and check a data- and tensor-parallel computation")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command in (None, "demo"):
        from job.demo import DemoConfig, run

        run(DemoConfig())
    return 0


if __name__ == "__main__":
    sys.exit(main())
