"""`python -m job runs SWEEP_DIR [--by eval_loss] [--min|--max]`: one table of a sweep's runs.

    python -m job runs runs/sweep1                       # or: make runs SWEEP_DIR=runs/sweep1
    python -m job runs gs://my-bucket/sweep1 --by eval_accuracy --max

One line per run: its values, its state (job/observe/status.py), step of total,
the newest train and eval loss, throughput, goodput, and `*` on the best run by
`--by` (SPLIT_METRIC of metrics.jsonl: eval_loss, train_loss, eval_accuracy, ...;
lower is better unless `--max`). It reads only what runs write, so it works
while they run and on a bucket. The runs are those of SWEEP_DIR/sweep.json,
else every subfolder with a config.json, whose values are then the config
fields that differ between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

from job.core import values
from job.core.errors import ConfigError
from job.observe.status import STALE_S, RunStatus, State, find_runs, state_of
from job.runs.sweep import Values, short_names

DEFAULT_METRIC = "eval_loss"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # the run's folder name
    values: Values
    status: RunStatus


def rows(folder: str, *, now: float | None = None, stale_s: float = STALE_S) -> list[Row]:
    """Every run in `folder` with where it stands."""
    now = time.time() if now is None else now
    return [Row(name, values, state_of(run_dir, now=now, stale_s=stale_s))
            for name, run_dir, values in find_runs(folder)]


def best(table: Sequence[Row], metric: str, *, higher: bool = False) -> Row | None:
    """The run with the lowest (or highest) `metric`; None when no run has recorded it."""
    scored = [(row.status.metric(metric), i) for i, row in enumerate(table)]
    scored = [(value, i) for value, i in scored if value is not None and value == value]  # NaN never wins
    if not scored:
        return None
    _, index = max(scored, key=lambda pair: (pair[0], -pair[1])) if higher else min(scored)  # ties: the first
    return table[index]


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _rate(status: RunStatus) -> tuple[str, str]:
    """(header, value) of the newest train record's throughput: tokens/s, samples/s, ..."""
    train = status.latest.get("train", {})
    key = next((k for k in train if k.endswith("_per_s")), None)
    if key is None:
        return "", "-"
    return key.removesuffix("_per_s") + "/s", f"{float(train[key]):,.0f}"


def _step(status: RunStatus) -> str:
    if status.state is State.NOT_STARTED:
        return "-"
    return f"{status.step}/{status.total if status.total is not None else '?'}"


def render(folder: str, table: Sequence[Row], metric: str = DEFAULT_METRIC, *, higher: bool = False) -> str:
    """The table as text: a heading, then one aligned line per run."""
    names = list(dict.fromkeys(name for row in table for name, _ in row.values))
    short = short_names(names)
    rate_header = next((h for h, _ in map(_rate, (r.status for r in table)) if h), "throughput")
    header = ["", "run", *(short[n] for n in names), "state", "step", "train loss", "eval loss", rate_header, "goodput"]
    winner = best(table, metric, higher=higher)
    lines = []
    for row in table:
        given = dict(row.values)
        s = row.status
        lines.append(["*" if row is winner else "", row.name, *(given.get(n, "-") for n in names), s.describe(),
                      _step(s), _number(s.metric("train_loss")),
                      _number(s.metric("eval_loss")), _rate(s)[1], "-" if s.goodput is None else f"{s.goodput:.0%}"])
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
    text = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in [header, *lines]]
    counts = ", ".join(f"{sum(r.status.state is state for r in table)} {state}" for state in State
                       if any(r.status.state is state for r in table))
    order = "higher" if higher else "lower"
    if winner is not None:
        verdict = f"best by {metric} ({order} is better): {winner.name} ({_number(winner.status.metric(metric), 6)})"
    else:
        verdict = f"best by {metric}: none yet (no run has recorded it)"
    return "\n".join([f"{folder}: {len(table)} run(s): {counts}; {verdict}", *text])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m job runs", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="a sweep folder (the sweep's --run-dir), or any folder of run folders")
    parser.add_argument("--by", default=DEFAULT_METRIC, help="SPLIT_METRIC to pick the best run by (eval_loss)")
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--min", dest="higher", action="store_false", help="lower is better (the default)")
    order.add_argument("--max", dest="higher", action="store_true", help="higher is better (accuracy)")
    parser.set_defaults(higher=False)  # --min's store_false would otherwise make True the default
    parser.add_argument("--stale-s", type=values.for_argparse(values.positive_seconds), default=STALE_S,
                        help="an attempt quiet for this long that did not end reads as stopped (3600)")
    args = parser.parse_args(argv)
    table = rows(args.folder, stale_s=args.stale_s)
    if not table:
        raise ConfigError("SWEEP_DIR", expected="a sweep folder (with sweep.json) or a folder of run folders "
                          "(each with a config.json)", found=args.folder,
                          fix="pass the --run-dir the sweep was given, e.g. python -m job runs runs/sweep1")
    print(render(args.folder, table, args.by, higher=args.higher))
    return 0


__all__ = ["DEFAULT_METRIC", "Row", "best", "main", "render", "rows"]
