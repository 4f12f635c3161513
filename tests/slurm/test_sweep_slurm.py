"""A sweep on the real local Slurm cluster: one job array of 2-node jobs, two at once, one element
preempted and requeued alone, every run completing with its own metrics; a bad value submits nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launching import ROOT, explain, wait_for_line
from tests.slurm.test_slurm import SMALL, deploy_argv, task_env

pytestmark = pytest.mark.slurm


def _steps(run_dir: Path) -> int:
    """The newest step in the run's metrics (written as it trains)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip().endswith("}")), default=0)


def _squeue(slurm_env: dict[str, str], array_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-r", "-j", array_id, "-o", "%i %T"], env=slurm_env, capture_output=True,
                          text=True).stdout


def test_a_sweep_is_one_array_two_at_once_and_a_preempted_element_is_requeued_alone(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    # 120 steps: element 0 must still be running when the signal comes (at 30 it could end first on a busy machine)
    job = ["train", "--run-dir", str(folder), "--steps", "120", "--ckpt.every", "10", "--log-every", "1", *SMALL]
    argv = deploy_argv(tmp_path, "--sweep", "seed=0,1,2,3", "--sweep-parallel", "2", "--wait", job=job, nodes=2)
    proc = subprocess.Popen(argv, env=task_env(slurm_env), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = wait_for_line(proc, "submitted Slurm job array", timeout=240)
    array_id = re.search(r"submitted Slurm job array (\d+): 4 run\(s\), 2 at once", "".join(seen))
    assert array_id, "".join(seen)
    array_id = array_id.group(1)
    target = folder / "seed=0"
    deadline, most = time.monotonic() + 240, 0
    while _steps(target) < 5 and time.monotonic() < deadline:
        most = max(most, _squeue(slurm_env, array_id).count(" RUNNING"))
        time.sleep(0.5)
    assert _steps(target) >= 5, "".join(seen)
    assert most <= 2
    # the element's own job id (SLURM_JOB_ID); its training step is step 0. Signalled once, as a preemption signals
    # a job's steps: `scancel --signal=USR2 JOB` of an element whose array still has pending elements is answered
    # "Job can not be altered now, try again later" though the signal was delivered, and scancel sends it again
    # 5, 11, 18, ... 81 s later: one of those reached the requeued element once it ran again and preempted it a
    # second time (Slurm 22.05). A step's signal is sent once.
    own = subprocess.run(["squeue", "-h", "-r", "-j", f"{array_id}_0", "-o", "%A"], env=slurm_env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert own.isdigit(), own
    subprocess.run(["scancel", "--signal=USR2", f"{own}.0"], env=slurm_env, check=True, timeout=30)
    while proc.poll() is None and time.monotonic() < deadline + 300:
        most = max(most, _squeue(slurm_env, array_id).count(" RUNNING"))
        time.sleep(1)
    out, _ = proc.communicate(timeout=60)
    output = "".join(seen) + out
    assert proc.returncode == 0, output
    assert most == 2, f"expected two elements at once at most and at some point, found {most}\n{output}"
    assert f"array {array_id}: all 4 run(s) completed" in output

    # the preempted element alone was requeued (its own job id) and resumed; the others ran once
    logs = {task: (tmp_path / "logs" / f"{array_id}_{task}_0_log.out").read_text() for task in range(4)}
    assert re.search(r"job \d+ saved its state after a preemption signal: requeueing \(restart 1\)", logs[0]), logs[0]
    assert "(restart 2)" not in logs[0] and "received SIGUSR2 during start-up" not in logs[0], logs[0]  # one signal
    assert re.search(r"resumed from step (\d+)", logs[0]), logs[0]
    for task in (1, 2, 3):
        assert "requeueing" not in logs[task] and "resumed from step" not in logs[task], logs[task]
    for seed in range(4):
        run_dir = folder / f"seed={seed}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] is True and summary["final_step"] == 120
        assert json.loads((run_dir / "config.json").read_text())["seed"] == seed
        assert "process 0 of 2 (slurm)" in logs[seed] and _steps(run_dir) == 120

    table = subprocess.run([sys.executable, "-m", "job", "runs", str(folder)], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    assert table.returncode == 0, table.stderr
    states = [line.split()[-8:-5] for line in table.stdout.splitlines()[2:]]
    assert states == [[f"seed={s}", str(s), "completed"] for s in range(4)], table.stdout

    again = subprocess.run(argv, env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, explain(again, again.stdout, again.stderr)
    assert "nothing new to submit: 4 of 4 complete" in again.stdout
    assert "submitted" not in again.stdout


def test_the_sbatch_route_submits_an_array_of_the_pending_runs_only(slurm_env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    job = ["train", "--run-dir", str(folder), "--steps", "4", "--log-every", "2", *SMALL]
    first = deploy_argv(tmp_path, "--via", "sbatch", "--sweep", "seed=0", "--wait", job=job, nodes=2)
    proc = subprocess.run(first, env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    both = deploy_argv(tmp_path, "--via", "sbatch", "--sweep", "seed=0,1", "--sweep-parallel", "2", "--wait",
                       job=job, nodes=2)
    dry = subprocess.run([*both[:-len(job) - 1], "--dry-run", "--", *job], env=task_env(slurm_env), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, explain(dry, dry.stdout, dry.stderr)
    assert "--array=1%2" in dry.stdout and f"sweep-run {folder}" in dry.stdout
    assert "1 of 2 already complete, skipped: seed=0; 1 to submit" in dry.stderr
    proc = subprocess.run(both, env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "1 of 2 already complete, skipped: seed=0; 1 to submit" in proc.stdout
    array_id = re.search(r"submitted Slurm job array (\d+)", proc.stdout).group(1)  # type: ignore[union-attr]
    assert f"{array_id}_1: {folder}/seed=1" in proc.stdout
    batch = "".join(p.read_text() for p in (tmp_path / "logs").glob("*-batch.log"))
    assert f"python -m job sweep-run {folder}" in batch
    for seed in (0, 1):
        summary = json.loads((folder / f"seed={seed}" / "summary.json").read_text())
        assert summary["completed"] is True and summary["final_step"] == 4
        assert json.loads((folder / f"seed={seed}" / "config.json").read_text())["seed"] == seed


@pytest.mark.parametrize("via", ["submitit", "sbatch"])
def test_a_sweep_with_one_bad_value_submits_nothing(slurm_env: dict[str, str], tmp_path: Path, via: str) -> None:
    job = ["train", "--run-dir", str(tmp_path / "sweep"), "--steps", "4", *SMALL]
    argv = deploy_argv(tmp_path, "--via", via, "--sweep", "optim.lr=1e-3,-1", job=job, nodes=2)
    before = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True).stdout
    proc = subprocess.run(argv, env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert "error: sweep run 'lr=-1': --optim.lr" in proc.stderr and "found -1" in proc.stderr
    assert "nothing was submitted" in proc.stderr and "submitted Slurm" not in proc.stdout
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "logs").exists()
    after = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True).stdout
    assert after == before
