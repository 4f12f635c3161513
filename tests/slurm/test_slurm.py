"""`make submit-slurm` against a real Slurm cluster on this machine (slurmctld, 4 slurmd, munge)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.runner import Runner
from deploy.slurm.submit import Submission, wait
from tests.launching import ROOT, explain, launcher_argv, run, wait_for_line

pytestmark = pytest.mark.slurm
SMALL = ["--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64", "--eval-every", "1000"]


def deploy_argv(tmp: Path, *options: str, job: list[str], nodes: int = 4) -> list[str]:
    return [sys.executable, "-m", "deploy.slurm", "--nodes", str(nodes), "--log-dir", str(tmp / "logs"), *options,
            "--", *job]


def task_env(slurm_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in slurm_env.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
    return env


def job_id(stdout: str) -> str:
    found = re.search(r"submitted Slurm job (\d+)", stdout)
    assert found, stdout
    return found.group(1)


def test_sbatch_script_trains_on_4_nodes(slurm_env: dict[str, str], tmp_path: Path) -> None:
    job = ["train", "--run-dir", str(tmp_path / "run"), "--steps", "12", "--log-every", "4", *SMALL]
    proc = subprocess.run(deploy_argv(tmp_path, "--via", "sbatch", "--wait", job=job), env=task_env(slurm_env),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    jid = job_id(proc.stdout)
    batch = (tmp_path / "logs" / f"{jid}-batch.log").read_text()
    assert f"job {jid} (restart 0) on node[1-4]" in batch
    for rank in range(4):
        assert f"process {rank} of 4 (slurm) on node{rank + 1}" in (tmp_path / "logs" / f"{jid}-{rank}.log").read_text()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_step"] == 12


def test_submitit_trains_on_4_nodes_and_a_preempted_job_is_requeued_to_match_an_uninterrupted_run(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    # on CPU the notice is agreed at the next step by a collective: 80 steps outlast its way from scancel many times
    flags = ["--steps", "80", "--ckpt.every", "20", "--log-every", "1", *SMALL]
    job = [sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path / "ref"), *flags]
    reference = run(launcher_argv(4, job, devices=1), timeout=300)
    assert reference.returncode == 0, explain(reference, reference.stdout, reference.stderr)
    proc = subprocess.Popen(
        deploy_argv(tmp_path, "--wait", job=["train", "--run-dir", str(tmp_path / "run"), *flags]),
        env=task_env(slurm_env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen = wait_for_line(proc, "step 5/80", timeout=300)
    jid = job_id("".join(seen))
    subprocess.run(["scancel", "--signal=USR2", jid], env=slurm_env, check=True)
    out, _ = proc.communicate(timeout=300)
    output = "".join(seen) + out
    assert proc.returncode == 0, output
    assert "received SIGUSR2" in output and "exiting with 75 (requeue)" in output
    assert re.search(r"resumed from step (\d+)", output), output
    ours = json.loads((tmp_path / "run" / "summary.json").read_text())
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert ours["completed"] is True and ours["final_step"] == 80
    assert ours["params_sha256"] == ref["params_sha256"]
    # one process per node, each told its place by Slurm; process 0's log streamed while waiting
    assert f"job {jid} completed" in output
    assert "slurm cluster: process 0 of 4, coordinator node1:" in output
    for rank in range(4):
        log = (tmp_path / "logs" / f"{jid}_{rank}_log.out").read_text()
        assert f"global_rank={rank}(4)" in log and f"node={rank}(4)" in log
        assert f"process {rank} of 4 (slurm) on node{rank + 1}" in log
    # the batch script's own step (slurm/requeue.sh, which slurm/train.sbatch takes too) requeued it
    batch = (tmp_path / "logs" / f"{jid}_0_log.out").read_text()
    assert f"job {jid} saved its state after a preemption signal: requeueing (restart 1)" in batch


def _submit_scenario(slurm_env: dict[str, str], logs: Path, *args: str) -> Submission:
    logs.mkdir(parents=True, exist_ok=True)
    command = " ".join([sys.executable, str(ROOT / "tests" / "scenarios" / "hold.py"), *args])
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes=4", "--ntasks-per-node=1", f"--output={logs}/%j-batch.log",
         f"--wrap=srun --kill-on-bad-exit=1 --output={logs}/%j-%t.log {command}"],
        env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    return Submission(out, logs / f"{out}-0.log", f"{logs}/{out}-*")


@pytest.fixture
def in_cluster(slurm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm_env["PATH"])


def test_a_task_that_raises_is_reported_and_ends_the_job(slurm_env: dict[str, str], in_cluster: None, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    sub = _submit_scenario(slurm_env, tmp_path, "raise", "2")
    code = wait(sub, Runner(), poll_s=0.5)
    elapsed = time.monotonic() - started
    print(f"raise on rank 2: reported after {elapsed:.1f} s")
    assert code != 0
    assert "RuntimeError: injected failure on rank 2" in capsys.readouterr().err


def test_a_task_killed_with_sigkill_ends_the_job(slurm_env: dict[str, str], in_cluster: None,
                                                            tmp_path: Path) -> None:
    sub = _submit_scenario(slurm_env, tmp_path, "hold")
    deadline = time.monotonic() + 120
    pid = None
    while pid is None and time.monotonic() < deadline:
        log = tmp_path / f"{sub.job_id}-2.log"
        found = re.search(r"ready pid=(\d+)", log.read_text()) if log.exists() else None
        pid = int(found.group(1)) if found else None
        time.sleep(0.2)
    assert pid is not None, "rank 2 never became ready"
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    code = wait(sub, Runner(), poll_s=0.5)
    elapsed = time.monotonic() - killed
    print(f"SIGKILL of rank 2: reported after {elapsed:.1f} s")
    assert code != 0  # the others hold forever: srun --kill-on-bad-exit ended them


def test_unknown_partition_is_refused_before_submitting(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = subprocess.run(deploy_argv(tmp_path, "--partition", "nope", job=["train"]), env=task_env(slurm_env),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "PARTITION: expected one of debug, found 'nope'" in proc.stderr
    assert not (tmp_path / "logs").exists()
