"""A sweep on this machine (`make run-local SWEEP=...`): every run checked first, then run in turn
through the local launcher, completed runs skipped when it runs again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import ROOT, explain, run

pytestmark = pytest.mark.multiprocess

SMALL = ("--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")


def sweep(spec: str, folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "deploy.local.sweep", "--sweep", spec, "-n", "2", "--devices-per-process", "1",
            "--", "train", "--steps", "4", "--log-every", "2", "--eval-every", "4", "--run-dir", str(folder),
            *SMALL, *flags]
    return run(argv, timeout=240)


def test_local_sweep_runs_each_run_then_skips_them(tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    proc = sweep("seed=0,1", folder)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "2 run(s) to run" in proc.stderr
    for seed in (0, 1):
        run_dir = folder / f"seed={seed}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] is True and summary["final_step"] == 4
        assert json.loads((run_dir / "config.json").read_text())["seed"] == seed
        assert any(json.loads(line)["split"] == "eval" for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert [r["name"] for r in json.loads((folder / "sweep.json").read_text())["runs"]] == ["seed=0", "seed=1"]

    table = subprocess.run([sys.executable, "-m", "job", "runs", str(folder)], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()[2:]]
    assert [row[-8:-5] for row in rows] == [["seed=0", "0", "completed"], ["seed=1", "1", "completed"]], table.stdout
    assert "lower is better" in table.stdout

    again = sweep("seed=0,1", folder)
    assert again.returncode == 0, explain(again, again.stdout, again.stderr)
    assert "nothing to run: 2 of 2 complete" in again.stderr
    assert "job.launch" not in again.stdout + again.stderr and "[rank" not in again.stdout


def test_local_sweep_with_one_bad_value_runs_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    proc = sweep("optim.lr=1e-3,-1", folder)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert "sweep run 'lr=-1'" in proc.stderr and "-1" in proc.stderr
    assert "nothing was run" in proc.stderr
    assert not folder.exists()
