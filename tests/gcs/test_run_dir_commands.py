"""`python -m job plot` and `python -m job runs` (and `make plot`) on a run dir and a sweep folder in a bucket,
against the Cloud Storage emulator: they read the run's files through the storage layer, and the PNG is
written back into the bucket beside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from job.core import rundir
from tests.gcs_emulator import BUCKET, Emulator
from tests.launching import run

pytestmark = pytest.mark.gcs

PNG = b"\x89PNG\r\n\x1a\n"
JOB = [sys.executable, "-m", "job"]


def write_run(gcs: Emulator, folder: str, loss: float, *, seed: int = 0, steps: int = 40, reached: int = 40) -> None:
    """A run's files as its writers leave them, in gs://BUCKET/FOLDER: config.json, metrics.jsonl (a train
    record every 10 steps, an eval every 20, a torn last line) and, once it reached `steps`, summary.json."""
    records = [{"step": s, "split": "train", "loss": loss + 1 / s, "lr": 1e-3, "tokens_per_s": 2048.0}
               for s in range(10, reached + 1, 10)]
    records += [{"step": s, "split": "eval", "loss": loss + 2 / s} for s in range(20, reached + 1, 20)]
    gcs.write(f"{folder}/{rundir.CONFIG}", json.dumps({"steps": steps, "run_dir": f"gs://{BUCKET}/{folder}",
                                                       "seed": seed}).encode())
    gcs.write(f"{folder}/{rundir.METRICS}", ("".join(map(rundir.line, records)) + '{"step": 4').encode())
    if reached == steps:
        gcs.write(f"{folder}/{rundir.SUMMARY}", json.dumps({"final_step": steps, "completed": True}).encode())


def test_a_run_in_a_bucket_is_plotted_into_the_bucket(gcs: Emulator) -> None:
    write_run(gcs, "run1", 1.5)
    done = run([*JOB, "plot", f"gs://{BUCKET}/run1"], **gcs.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"gs://{BUCKET}/run1/{rundir.PLOT}"
    assert gcs.read(f"run1/{rundir.PLOT}").startswith(PNG)


def test_a_run_in_a_bucket_is_tabled_with_its_state_step_and_losses(gcs: Emulator) -> None:
    write_run(gcs, "run1", 1.5)
    done = run([*JOB, "runs", f"gs://{BUCKET}/run1"], **gcs.env)
    assert done.returncode == 0, done.stderr
    heading, header, row = done.stdout.splitlines()
    assert heading == f"gs://{BUCKET}/run1: 1 run(s): 1 completed; best by eval_loss (lower is better): run1 (1.55)"
    assert header.split() == ["run", "state", "step", "train", "loss", "eval", "loss", "tokens/s"]
    assert row.split() == ["*", "run1", "completed", "40/40", "1.525", "1.55", "2,048"]


def test_a_sweep_folder_in_a_bucket_is_tabled_and_plotted(gcs: Emulator) -> None:
    write_run(gcs, "sweep1/seed=0", 1.5)
    write_run(gcs, "sweep1/seed=1", 1.2, seed=1, reached=20)
    table = run([*JOB, "runs", f"gs://{BUCKET}/sweep1"], **gcs.env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0] == (f"gs://{BUCKET}/sweep1: 2 run(s): 1 completed, 1 stopped; best by "
                                            "eval_loss (lower is better): seed=1 (1.3)")
    assert [line.split() for line in table.stdout.splitlines()[2:]] == [
        ["seed=0", "0", "completed", "40/40", "1.525", "1.55", "2,048"],
        ["*", "seed=1", "1", "stopped", "at", "step", "20", "20/40", "1.25", "1.3", "2,048"]]
    plotted = run([*JOB, "plot", f"gs://{BUCKET}/sweep1"], **gcs.env)
    assert plotted.returncode == 0, plotted.stderr
    assert plotted.stdout.strip() == f"gs://{BUCKET}/sweep1/{rundir.SWEEP_PLOT}"
    assert gcs.read(f"sweep1/{rundir.SWEEP_PLOT}").startswith(PNG)


def test_make_plot_passes_a_bucket_run_dir_through(gcs: Emulator) -> None:
    write_run(gcs, "run1", 1.5)
    bin_dir = Path(sys.executable).parent
    done = run(["make", "--no-print-directory", "-o", f"{bin_dir}/.installed", f"BIN={bin_dir}", "plot",
                f"RUN_DIR=gs://{BUCKET}/run1"], **gcs.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"gs://{BUCKET}/run1/{rundir.PLOT}"
    assert gcs.read(f"run1/{rundir.PLOT}").startswith(PNG)
