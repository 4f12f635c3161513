"""`python -m job plot RUN_DIR [--out FILE]`: loss, eval loss, learning rate and throughput against step.

    python -m job plot runs/example                 # writes runs/example/metrics.png
    make plot RUN_DIR=runs/example
    python -m job plot runs/sweep1                  # a sweep: every run's eval loss, runs/sweep1/eval_loss.png
    python -m job plot gs://my-bucket/run1          # a run in a bucket: its PNG written beside it

Reads RUN_DIR/metrics.jsonl (job/observe/metrics.py writes it). Given a folder of
runs instead (a sweep folder, or any folder whose subfolders hold a config.json:
job/observe/status.py's `find_runs`), it draws each run's eval loss on one
figure, labelled by the run's values. Needs matplotlib: the `plot` extra
(`pip install 'jax-cluster-job[plot]'`).
"""

from __future__ import annotations

import argparse
import io
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from job.core import rundir
from job.core.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SWEEP_PLOT = rundir.SWEEP_PLOT  # a folder of runs' figure, in that folder


def series(records: list[dict[str, Any]], split: str, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name` in `split`, the last record of a step winning."""
    points = {r["step"]: float(r[name]) for r in records if r.get("split") == split and name in r}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _pyplot() -> ModuleType:
    try:
        import matplotlib  # optional (the plot extra): only this command draws
    except ImportError:
        raise ConfigError("python -m job plot", expected="matplotlib installed (the `plot` extra)",
                          found="no matplotlib module", fix="pip install 'jax-cluster-job[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend when imported

    return plt


def _png(plt: ModuleType, fig: Figure) -> bytes:
    """The figure as a PNG's bytes (a file in a bucket is written whole), then closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def render(records: list[dict[str, Any]], title: str) -> bytes:
    """One run's figure: loss, learning rate and throughput against step, the PNG's bytes."""
    plt = _pyplot()
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
    return _png(plt, fig)


def eval_curves(folder: str) -> list[tuple[str, list[int], list[float]]]:
    """(label, steps, eval losses) of every run in `folder` that has evaluated, labelled by its values."""
    # etils and the runs' status: python -m job imports this module for every command; only plotting loads them
    from job.core import storage
    from job.observe.status import find_runs
    from job.runs.sweep import short_names

    found = find_runs(folder)
    short = short_names(list(dict.fromkeys(name for _, _, values in found for name, _ in values)))
    curves = []
    for name, run_dir, values in found:
        steps, losses = series(rundir.records(rundir.metrics(storage.run_path(run_dir))), "eval", "loss")
        if steps:
            curves.append((" ".join(f"{short[n]}={v}" for n, v in values) or name, steps, losses))
    return curves


def render_runs(curves: list[tuple[str, list[int], list[float]]], title: str) -> bytes:
    """One figure, one eval loss curve per run: the PNG's bytes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, steps, losses in curves:
        ax.plot(steps, losses, "o-", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=1 if len(curves) <= 12 else 2)
    ax.set_title(title)
    fig.tight_layout()
    return _png(plt, fig)


def _holds_runs(folder: str) -> bool:
    # only plotting loads the runs' status, as in eval_curves
    from job.observe.status import find_runs

    return bool(find_runs(folder))


def _plot_runs(folder: str, out: str | None) -> int:
    """`python -m job plot SWEEP_DIR`: every run's eval loss on one figure (SWEEP_DIR/eval_loss.png)."""
    from job.core import storage  # only plotting loads etils, as in eval_curves

    curves = eval_curves(folder)
    if not curves:
        raise ConfigError("SWEEP_DIR", expected="a folder of runs of which at least one has evaluated",
                          found=folder, fix="plot it again once a run has logged an eval loss")
    target = storage.run_path(out) if out is not None else rundir.sweep_plot(storage.run_path(folder))
    target.write_bytes(render_runs(curves, f"{folder}: eval loss of {len(curves)} run(s)"))
    print(target)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m job plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl, or a folder of runs (a sweep)")
    parser.add_argument("--out", default=None, help="the PNG to write, a path or gs:// URL "
                        "(default RUN_DIR/metrics.png, or SWEEP_DIR/eval_loss.png)")
    args = parser.parse_args(argv)
    # etils: python -m job imports this module for every command; only plotting loads it
    from job.core import storage

    run_dir = storage.run_path(args.run_dir)
    source = rundir.metrics(run_dir)
    if not source.is_file() and _holds_runs(args.run_dir):
        try:
            return _plot_runs(args.run_dir, args.out)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    records = rundir.records(source)
    out = storage.run_path(args.out) if args.out else rundir.plot(run_dir)
    try:
        if not any(r.get("split") == "train" for r in records):
            raise ConfigError("RUN_DIR", expected=f"a run directory whose {rundir.METRICS} has train records",
                              found=str(run_dir), fix="pass the --run-dir of a run that logged a step")
        out.write_bytes(render(records, str(run_dir)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
