"""`python -m job plot RUN_DIR [--out FILE]`: loss, eval loss, learning rate and throughput against step.

    python -m job plot runs/example                 # writes runs/example/metrics.png
    make plot RUN_DIR=runs/example

Reads RUN_DIR/metrics.jsonl (job/observe/metrics.py writes it). Needs matplotlib: the
`plot` extra (`pip install 'jax-cluster-job[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from job.core.errors import ConfigError


def read_metrics(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a killed run
    return records


def series(records: list[dict[str, Any]], split: str, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name` in `split`, the last record of a step winning."""
    points = {r["step"]: float(r[name]) for r in records if r.get("split") == split and name in r}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def render(records: list[dict[str, Any]], out: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("python -m job plot", expected="matplotlib installed (the `plot` extra)",
                          found="no matplotlib module", fix="pip install 'jax-cluster-job[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = next((k for r in records for k in r if k.endswith("_per_s")), None)
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss, lr, speed = axes
    loss.plot(*series(records, "train", "loss"), label="train loss")
    loss.plot(*series(records, "eval", "loss"), "o-", label="eval loss")
    loss.set_ylabel("loss")
    loss.legend()
    lr.plot(*series(records, "train", "lr"), color="tab:green")
    lr.set_ylabel("learning rate")
    if rate is not None:
        speed.plot(*series(records, "train", rate), color="tab:red")
    speed.set_ylabel(rate.replace("_", " ").replace(" per s", "/s") if rate else "throughput")
    speed.set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m job plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="the PNG to write (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    source = args.run_dir / "metrics.jsonl"
    records = read_metrics(source) if source.is_file() else []
    out = args.out or args.run_dir / "metrics.png"
    try:
        if not any(r.get("split") == "train" for r in records):
            raise ConfigError("RUN_DIR", expected="a run directory whose metrics.jsonl has train records",
                              found=str(args.run_dir), fix="pass the --run-dir of a run that logged a step")
        render(records, out, str(args.run_dir))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
