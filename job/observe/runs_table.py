"""`python -m job runs FOLDER [--by eval_loss] [--min|--max]`: one table of a sweep's runs, or of one run.

    python -m job runs runs/sweep1                       # or: make runs SWEEP_DIR=runs/sweep1
    python -m job runs gs://my-bucket/sweep1 --by eval_accuracy --max
    python -m job runs runs/lm1                          # one run: a one-row table

One line per run: its values, its state (job/observe/status.py), step of total,
the train and eval loss and the metric ranked by (a completed, stopped or
preempted run's from its summary.json, its last saved step's; else the newest
records'), throughput in each
task's unit (the `UNIT_per_s` of its train records: tok/s, samples/s), goodput,
and `*` on the best run by `--by` (SPLIT_METRIC of metrics.jsonl: eval_loss,
train_loss, eval_accuracy, ...; lower is better unless `--max`). A column no
run fills is left out, except the one ranked by; an empty cell reads `-`. It
reads only what runs write, so it works while they run and on a bucket. The
runs are those of FOLDER/sweep.json, else every subfolder with a config.json,
whose values are then the config fields that differ between them; else FOLDER
itself when it is one run's folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

from job.core import rundir, values
from job.core.errors import ConfigError
from job.observe.status import STALE_S, RunStatus, State, find_runs, state_of
from job.runs.sweep import Values, short_names

DEFAULT_METRIC = "eval_loss"
EMPTY = "-"  # a cell its run does not fill


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # the run's folder name
    values: Values
    status: RunStatus


def rows(folder: str, *, now: float | None = None, stale_s: float = STALE_S) -> list[Row]:
    """Every run in `folder` with where it stands; `folder` alone when it is one run's folder."""
    now = time.time() if now is None else now
    found = [Row(name, values, state_of(run_dir, now=now, stale_s=stale_s))
             for name, run_dir, values in find_runs(folder)]
    if found:
        return found
    itself = state_of(folder, now=now, stale_s=stale_s)
    name = str(folder).rstrip("/").rpartition("/")[2] or str(folder)
    return [] if itself.state is State.NOT_STARTED else [Row(name, (), itself)]


def best(table: Sequence[Row], metric: str, *, higher: bool = False) -> Row | None:
    """The run with the lowest (or highest) `metric`; None when no run has recorded it."""
    scored = [(row.status.metric(metric), i) for i, row in enumerate(table)]
    scored = [(value, i) for value, i in scored if value is not None and value == value]  # NaN never wins
    if not scored:
        return None
    _, index = max(scored, key=lambda pair: (pair[0], -pair[1])) if higher else min(scored)  # ties: the first
    return table[index]


def _number(value: float | None, digits: int = 4) -> str:
    return EMPTY if value is None else f"{value:.{digits}g}"


def _rate(status: RunStatus) -> tuple[str, float] | None:
    """(unit, value) of the newest train record's throughput, its `UNIT_per_s` (Reporter.train): ('tok/s', 61440.0)."""
    train = status.latest.get("train", {})
    key = next((k for k in reversed(list(train)) if k.endswith("_per_s")), None)  # the Reporter writes it last
    if key is None or not isinstance(train[key], int | float):
        return None
    return key.removesuffix("_per_s") + "/s", float(train[key])


def _throughput(statuses: Sequence[RunStatus]) -> tuple[str, list[str]]:
    """The throughput column: headed by the unit when every run has the same one, else each cell names its own."""
    rates = [_rate(s) for s in statuses]
    units = {rate[0] for rate in rates if rate is not None}
    one = units.pop() if len(units) == 1 else None
    cells = [EMPTY if rate is None else f"{rate[1]:,.0f}" + ("" if one else f" {rate[0]}") for rate in rates]
    return one or "throughput", cells


def _step(status: RunStatus) -> str:
    if status.state is State.NOT_STARTED:
        return EMPTY
    return f"{status.step}/{status.total if status.total is not None else '?'}"


def _header(metric: str) -> str:
    """'eval_accuracy' -> 'eval accuracy'."""
    return metric.replace("_", " ")


def _columns(table: Sequence[Row], metric: str) -> list[tuple[str, list[str]]]:
    """(header, cells) of every column a run could fill, in order: run, values, state, step, metrics, rates."""
    names = list(dict.fromkeys(name for row in table for name, _ in row.values))
    short = short_names(names)
    statuses = [row.status for row in table]
    metrics = dict.fromkeys(("train_loss", "eval_loss", metric))  # the one ranked by, after the losses
    return [("run", [row.name for row in table]),
            *((short[n], [dict(row.values).get(n, EMPTY) for row in table]) for n in names),
            ("state", [s.describe() for s in statuses]),
            ("step", [_step(s) for s in statuses]),
            *((_header(m), [_number(s.metric(m)) for s in statuses]) for m in metrics),
            _throughput(statuses),
            ("goodput", [EMPTY if s.goodput is None else f"{s.goodput:.0%}" for s in statuses])]


def _filled(table: Sequence[Row], metric: str) -> list[tuple[str, list[str]]]:
    """The columns some run fills, and always the run, its state and the metric it is ranked by."""
    kept = ("run", "state", _header(metric))
    return [(h, cells) for h, cells in _columns(table, metric) if h in kept or any(c != EMPTY for c in cells)]


def render(folder: str, table: Sequence[Row], metric: str = DEFAULT_METRIC, *, higher: bool = False) -> str:
    """The table as text: a heading, then one aligned line per run."""
    winner = best(table, metric, higher=higher)
    columns = [("", ["*" if row is winner else "" for row in table]), *_filled(table, metric)]
    lines = [[header for header, _ in columns], *zip(*(cells for _, cells in columns), strict=True)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines]
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
    parser.add_argument("folder", help="a sweep folder (the sweep's --run-dir), any folder of run folders, "
                        "or one run's folder")
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
        raise ConfigError("SWEEP_DIR", expected=f"a sweep folder (with {rundir.SWEEP_PLAN}), a folder of run "
                          f"folders (each with a {rundir.CONFIG}) or one run's folder (its {rundir.CONFIG}, "
                          f"{rundir.METRICS}, {rundir.SUMMARY})", found=args.folder,
                          fix="pass the --run-dir the sweep or the run was given, e.g. python -m job runs runs/sweep1")
    print(render(args.folder, table, args.by, higher=args.higher))
    return 0


__all__ = ["DEFAULT_METRIC", "Row", "best", "main", "render", "rows"]
