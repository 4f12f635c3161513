"""DRY_RUN against the real cluster: the job is printed (sbatch script or command, and the srun
line), checked as a real submission would be, and nothing reaches Slurm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from job.core import internals
from tests.launching import ROOT, explain
from tests.slurm.test_slurm import deploy_argv, task_env

pytestmark = pytest.mark.slurm

IMAGE = "localhost/jax-cluster-job-test:cpu"  # never pulled nor run: only printed
CASES = {
    "submitit-gres": (("--gpus-per-node", "4", "--tasks-per-node", "4", "--gres"),
                      ("#SBATCH --gres=gpu:4", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                       f"srun --unbuffered --output {{logs}}/%j_%t_log.out --kill-on-bad-exit=1 {sys.executable} "
                       f"-u -m {internals.SUBMITIT_TASK_MODULE} {{logs}}")),
    "sbatch-per-task": (("--via", "sbatch", "--gpus-per-node", "4", "--tasks-per-node", "2"),
                        ("sbatch --parsable ", " --nodes=2 ", " --ntasks-per-node=2 ", " --gpus-per-task=2 ",
                         f"JOB_PYTHON={sys.executable}", f"{ROOT}/slurm/train.sbatch train --steps 3",
                         f"srun --kill-on-bad-exit=1 --output={{logs}}/%j-%t.log {sys.executable} -m job train "
                         "--steps 3")),
    "sbatch-podman": (("--container-runtime", "podman", "--image", IMAGE),
                      ("CONTAINER_RUNTIME=podman", f"IMAGE={IMAGE}",
                       f"srun --kill-on-bad-exit=1 --output={{logs}}/%j-%t.log podman run --rm ",
                       " --network=host ", f" {IMAGE} python -m job train --steps 3")),
}


def jobs_writing_under(folder: Path, env: dict[str, str]) -> list[str]:
    """Jobs slurmctld knows (queued, running, or ended within MinJobAge, 300 s) whose output lies in `folder`."""
    listed = subprocess.run(["squeue", "-h", "-t", "all", "-O", "JobID:20,STDOUT:4000"], env=env,
                            capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if str(folder) in line]


@pytest.mark.parametrize("case", CASES)
def test_dry_run_prints_the_job_and_submits_nothing(case: str, slurm_env: dict[str, str], tmp_path: Path) -> None:
    options, printed = CASES[case]
    env = {**task_env(slurm_env), "JOB_SKIP_GPU_CHECK": "1"}  # stand-in GPUs
    argv = deploy_argv(tmp_path, *options, "--python", sys.executable, "--dry-run", job=["train", "--steps", "3"],
                       nodes=2)
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    for text in printed:
        assert text.format(logs=tmp_path / "logs") in proc.stdout, f"{text!r} not in:\n{proc.stdout}"
    assert "nothing submitted" in proc.stderr
    assert "submitted Slurm job" not in proc.stdout
    assert jobs_writing_under(tmp_path, env) == []
    assert not (tmp_path / "logs").exists()
