"""`make tpu-pod SWEEP=...` against the gcloud simulator: a sweep's runs one after another on one slice."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.launching import explain
from tests.tpu.harness import SMALL, ZONE, Cloud


@pytest.mark.slow
def test_a_sweep_runs_each_run_on_the_same_slice_then_skips_them(cloud: Cloud, tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    args = f"train --run-dir {shlex.quote(str(folder))} --steps 4 --log-every 2 --eval-every 4 {SMALL}"
    slice_ = {"TPU_NAME": "pod-s", "ZONE": ZONE, "ACCELERATOR": "v4-16", "ARGS": args, "SWEEP": "seed=0,1"}
    proc = cloud.make("tpu-pod", **slice_)
    assert proc.returncode == 0, explain(proc)
    assert "2 run(s) to run" in proc.stderr and "all 2 run(s) completed" in proc.stderr
    for seed in (0, 1):
        run_dir = folder / f"seed={seed}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] is True and summary["final_step"] == 4
        assert json.loads((run_dir / "config.json").read_text())["seed"] == seed
    assert cloud.verbs().count("tpu-vm create") == 1  # one slice for both runs

    again = cloud.make("tpu-pod", **slice_)
    assert again.returncode == 0, explain(again)
    assert "nothing to run: 2 of 2 complete" in again.stderr
    assert cloud.verbs().count("tpu-vm create") == 1


def test_a_sweep_with_one_bad_value_runs_nothing(cloud: Cloud, tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    proc = cloud.make("tpu-pod", TPU_NAME="pod-t", ZONE=ZONE, ACCELERATOR="v4-8", SWEEP="optim.lr=1e-3,-1",
                      ARGS=f"train --run-dir {shlex.quote(str(folder))} --steps 4")
    assert proc.returncode == 2, explain(proc)
    assert "sweep run 'lr=-1': --optim.lr" in proc.stderr and "nothing was run" in proc.stderr
    assert cloud.calls() == [] and not folder.exists()


def test_the_first_failed_run_stops_the_sweep_with_its_exit_code(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.tpu import cli as tpu
    from deploy.tpu.config import TpuConfig
    from tests.tpu.harness import ROOT
    from tests.tpu.sim_runner import SimRunner

    monkeypatch.chdir(tmp_path)
    cfg = TpuConfig(name="pod-1", zone=ZONE, accelerator="v4-32", retries=0, source_dir=str(ROOT),
                    job_args=("train", "--run-dir", str(tmp_path / "sweep")), sweep="seed=0,1,2")
    runner = SimRunner(job_outcomes=[(0, None), (3, None), (0, None)])
    assert tpu.sweep_pod(cfg, runner) == 3
    started = [re.findall(r"--seed (\d)", " ".join(call)) for call in runner.calls]
    assert [seeds[0] for seeds in started if seeds] == ["0", "1"]  # the run after the failure never started
