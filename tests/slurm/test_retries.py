"""Retries on the real local Slurm cluster: a rank killed on one node is retried away from that node and
the run completes as an uninterrupted one does (bitwise); a fault on every attempt stops once the budget is
spent, with the failure's code; a configuration error is never retried; Ctrl-C (scancel --signal=INT) saves and
stops, retrying nothing. The fault: tests/user_tasks/node_fault.py (SIGKILL of the process on a named node at a
step, on every attempt that runs there)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from job.observe.status import State, state_of
from job.runs.config import CheckpointConfig
from job.runs.local_tier import run_folder
from tests.launching import ROOT, explain, launcher_argv, run, wait_for_line
from tests.slurm.test_slurm import SMALL, deploy_argv, job_id, task_env

pytestmark = pytest.mark.slurm
FAULTY = ["--task", "tests.user_tasks.node_fault:TASK"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ended(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir / "attempts.jsonl") if r["event"] == "ended"]


def _submit(slurm_env: dict[str, str], tmp_path: Path, job: list[str], *options: str,
            fault: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**task_env(slurm_env), **fault}
    return subprocess.run(deploy_argv(tmp_path, "--wait", *options, job=job, nodes=2), env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=600)


def test_a_rank_killed_on_one_node_is_retried_on_other_nodes_and_matches_an_uninterrupted_run(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    # the faulty process asks for its rows of step 12 ahead of the step: it dies once step 8's save is committed
    flags = ["--steps", "24", "--ckpt.every", "8", "--log-every", "4", *SMALL]
    reference = run(launcher_argv(2, [sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path / "ref"),
                                      *flags], devices=1), timeout=300)
    assert reference.returncode == 0, explain(reference, reference.stdout, reference.stderr)
    run_dir = tmp_path / "run"
    proc = _submit(slurm_env, tmp_path, ["train", "--run-dir", str(run_dir), *FAULTY, *flags], "--retries", "2",
                   fault={"NODE_FAULT": "node2", "NODE_FAULT_STEP": "12",
                          "NODE_FAULT_AFTER": str(run_dir / "checkpoints" / "8")})
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    jid = job_id(proc.stdout)
    ours = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert ours["completed"] is True and ours["final_step"] == 24
    assert ours["params_sha256"] == ref["params_sha256"]  # resumed from its checkpoint, bitwise

    failed, done = _ended(run_dir)
    assert failed == {**failed, "job": jid, "attempt": 1, "outcome": "failed", "node": "node2", "process": "1",
                      "action": "requeue", "says": "retry 1 of 2, excluding node2"}, failed
    assert failed["code"] != 0 and "Killed" in failed["cause"]
    assert done == {**done, "job": jid, "attempt": 2, "outcome": "completed", "code": 0}, done
    # the second attempt ran elsewhere: Slurm kept node2 out of it
    batch = (tmp_path / "logs" / f"{jid}_0_log.out").read_text()
    assert f"job {jid} attempt 1 failed with exit code {failed['code']} (process 1 on node2: " in batch
    assert "resumed from step 8" in batch, batch
    shown = subprocess.run(["scontrol", "show", "job", jid], env=slurm_env, capture_output=True, text=True, check=True).stdout
    assert "ExcNodeList=node2" in shown and "Restarts=1" in shown, shown
    second = [line for line in (tmp_path / "logs" / f"{jid}_1_log.out").read_text().splitlines()
              if "process 1 of 2 (slurm) on" in line]
    assert len(second) == 2 and second[0].endswith("on node2") and not second[1].endswith("on node2"), second
    # goodput tells the time lost to the failure apart from preemption
    assert ours["goodput"]["failed_attempts"] == 1 and ours["goodput"]["lost_to_failures_s"] > 0
    assert ours["goodput"]["lost_to_preemption_s"] == 0
    assert state_of(run_dir).state is State.COMPLETED


def test_a_fault_on_every_attempt_stops_once_the_budget_is_spent_with_its_code(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = ["train", "--run-dir", str(run_dir), *FAULTY, "--steps", "12", "--ckpt.every", "4", *SMALL]
    proc = _submit(slurm_env, tmp_path, job, "--retries", "1", fault={"NODE_FAULT": "*", "NODE_FAULT_STEP": "6"})
    assert proc.returncode != 0, explain(proc, proc.stdout, proc.stderr)
    first, second = _ended(run_dir)
    assert first["outcome"] == second["outcome"] == "failed"
    assert first["says"].startswith("retry 1 of 1") and first["code"] != 0
    assert second["says"] == "not retried: the retry budget is spent (1 of 1)"
    jid = job_id(proc.stdout)
    batch = (tmp_path / "logs" / f"{jid}_0_log.out").read_text()
    assert f"job {jid} ends with exit code {second['code']}: not retried: the retry budget is spent (1 of 1)" in batch
    status = state_of(run_dir)
    assert status.state is State.FAILED and status.describe().startswith(f"failed (exit {second['code']}"), status


def test_a_configuration_error_is_never_retried(slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # a batch of 3 rows cannot be split over the job's 2 processes: found on the compute nodes, exit 2
    job = ["train", "--run-dir", str(run_dir), "--steps", "4", "--data.global-batch", "3", *SMALL]
    proc = _submit(slurm_env, tmp_path, job, "--retries", "3", fault={})
    assert proc.returncode != 0, explain(proc, proc.stdout, proc.stderr)
    jid = job_id(proc.stdout)
    (record,) = [r for r in _records(tmp_path / "logs" / f"{jid}-attempts.jsonl") if r["event"] == "ended"]
    assert record["outcome"] == "configuration error" and record["code"] == 2
    assert record["says"] == "not retried: the same flags would fail again"
    shown = subprocess.run(["scontrol", "show", "job", jid], env=slurm_env, capture_output=True, text=True, check=True).stdout
    assert "Restarts=0" in shown, shown


def _queue_state(slurm_env: dict[str, str], jid: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T"], env=slurm_env, capture_output=True, text=True,
                          check=False).stdout.strip()


@pytest.mark.parametrize("requeue", [True, False], ids=["requeue-allowed", "requeue-disabled"])
def test_a_killed_process_restarts_on_a_spare_inside_the_allocation_while_a_requeued_job_would_wait(
        slurm_env: dict[str, str], tmp_path: Path, requeue: bool) -> None:
    """SPARES=1 in partition `strict` (no oversubscription: a job that does not fit waits): process 1 is SIGKILLed on node2
    just after step 22; the supervisor starts a new step on node1 and node3 at once, from step 20's node-local
    checkpoint (persistent ones every 50 steps), process 1's shards sent by process 0, which held them on node1
    (each node's /dev/shm is its own: node3 has none of them), while a job asking for every node stays pending;
    the run ends bitwise equal to an uninterrupted one, in the same job (Restarts=0). With requeue disabled on the
    job (Requeue=0, as JobRequeue=0 or --no-requeue leave it), the same."""
    flags = ["--steps", "60", "--ckpt.every", "50", "--ckpt.local-every", "5", "--log-every", "2", *SMALL]
    reference = run(launcher_argv(2, [sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path / "ref"),
                                      *flags], devices=1), timeout=300)
    assert reference.returncode == 0, explain(reference, reference.stdout, reference.stderr)
    run_dir = tmp_path / "run"
    # on node2: process 0's step 20, held there for it, is in: so is process 1's, sent to node1 at the same time
    held = run_folder(CheckpointConfig.local_dir, str(run_dir)) / "20" / "process-0.jlt"
    env = {**task_env(slurm_env), "NODE_FAULT": "node2", "NODE_FAULT_STEP": "22", "NODE_FAULT_AFTER": str(held),
           "NODE_FAULT_SETTLE_S": "1"}
    argv = deploy_argv(tmp_path, "--wait", "--partition", "strict", "--spares", "1", "--retries", "2",
                       job=["train", "--run-dir", str(run_dir), *FAULTY, *flags], nodes=2)
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = wait_for_line(proc, "submitted Slurm job", timeout=120)
    jid = job_id("".join(seen))
    deadline = time.monotonic() + 120
    while _queue_state(slurm_env, jid) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    if not requeue:
        subprocess.run(["scontrol", "update", f"JobId={jid}", "Requeue=0"], env=slurm_env, check=True)
    blocker = subprocess.run(["sbatch", "--parsable", "--partition=strict", "--nodes=4", "--exclusive", "--time=10",
                              f"--output={tmp_path}/blocker.log", "--wrap=sleep 600"], env=slurm_env,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert proc.stdout is not None
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)
    reader.start()
    seen_while_ours_ran = set()
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            ours_now, theirs = _queue_state(slurm_env, jid), _queue_state(slurm_env, blocker)
            if ours_now == "RUNNING":
                seen_while_ours_ran.add(theirs)
            time.sleep(0.5)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        reader.join(timeout=30)
    finally:
        subprocess.run(["scancel", blocker], env=slurm_env, check=False)
    output = "".join(seen + rest)
    assert proc.returncode == 0, output
    assert seen_while_ours_ran == {"PENDING"}, seen_while_ours_ran  # a requeued job would have waited behind it
    shown = subprocess.run(["scontrol", "show", "job", jid], env=slurm_env, capture_output=True, text=True,
                           check=True).stdout
    assert "Restarts=0" in shown and "JobState=COMPLETED" in shown, shown
    assert ("Requeue=1" in shown) is requeue

    ours = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert ours["completed"] is True and ours["final_step"] == 60
    assert ours["params_sha256"] == ref["params_sha256"]  # resumed from its checkpoint, bitwise
    failed, done = _ended(run_dir)
    (resumed,) = [r for r in _records(run_dir / "attempts.jsonl") if r["event"] == "resumed"]
    assert resumed == {**resumed, "attempt": 2, "step": 21, "from_step": 20, "tier": "node-local"}, resumed
    assert 0 < resumed["gap_s"] == pytest.approx(resumed["time"] - failed["ended"], abs=0.01)
    assert failed == {**failed, "job": jid, "attempt": 1, "code": 137, "outcome": "failed", "node": "node2",
                      "process": "1", "cause": "Killed", "nodes": "node1,node2",
                      "action": "restart",
                      "says": "restart 1 of 2 in the allocation, on a spare instead of node2"}, failed
    assert done == {**done, "job": jid, "attempt": 2, "code": 0, "outcome": "completed", "nodes": "node1,node3"}, done
    first = (tmp_path / "logs" / f"{jid}_0_log.out").read_text()
    assert ("resumed from step 20 (the node-local tier: process 1's from process 0 on node1 over the network; the "
            "others' from their own node)") in first, first
    assert not (run_dir / "checkpoints" / "20").exists()  # not from the persistent tier: it has 50 and 60
    second = [line for line in (tmp_path / "logs" / f"{jid}_1_log.out").read_text().splitlines()
              if "process 1 of 2 (slurm) on" in line]
    assert [line.rsplit(" ", 1)[-1] for line in second] == ["node2", "node3"], second
    assert ours["goodput"]["failed_attempts"] == 1 and ours["goodput"]["lost_to_failures_s"] > 0
    assert state_of(run_dir).state is State.COMPLETED
    print(f"restart in the allocation: the next step began {done['began'] - failed['ended']:.1f} s after the failed "
          f"one ended, its first training step {resumed['gap_s']:.1f} s after; goodput: "
          f"{ours['goodput']['lost_to_failures_s']:.1f} s lost to the failure")


def _stopped_midway(slurm_env: dict[str, str], tmp_path: Path, via: str, *scancel: str) -> tuple[str, str, Path]:
    """A 2-node job of 2000 steps (--retries 2) through `via`'s batch script, sent `scancel SCANCEL JOBID` once its
    tasks logged step 4: (the job id, every log of the job, the run dir) once `make submit-slurm`'s wait ended."""
    run_dir = tmp_path / "run"
    flags = ["--steps", "2000", "--ckpt.every", "1000", "--log-every", "2", *SMALL]
    argv = deploy_argv(tmp_path, "--via", via, "--wait", "--retries", "2",
                       job=["train", "--run-dir", str(run_dir), *flags], nodes=2)
    proc = subprocess.Popen(argv, env=task_env(slurm_env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen = wait_for_line(proc, "submitted Slurm job", timeout=120)
    jid = job_id("".join(seen))
    deadline = time.monotonic() + 240
    logs = tmp_path / "logs"
    while time.monotonic() < deadline and not any(
            "step 4/2000" in p.read_text(errors="replace") for p in logs.glob(f"{jid}[-_]*")):
        assert proc.poll() is None, "".join(seen) + (proc.stdout.read() if proc.stdout else "")
        time.sleep(0.5)
    subprocess.run(["scancel", *scancel, jid], env=slurm_env, check=True)
    proc.communicate(timeout=180)
    deadline = time.monotonic() + 60  # the job's record goes when its last process has gone
    while _queue_state(slurm_env, jid) and time.monotonic() < deadline:
        time.sleep(0.5)
    everything = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"{jid}[-_]*")))
    return jid, everything, run_dir


@pytest.mark.parametrize("via", ["submitit", "sbatch"])
def test_ctrl_c_to_the_job_saves_stops_every_step_with_130_and_nothing_restarts(
        slurm_env: dict[str, str], tmp_path: Path, via: str) -> None:
    """`scancel --signal=INT --full`, Slurm's Ctrl-C to a batch job: the supervisor passes it on to the job's
    processes, which save the step in progress and exit 130; the attempt is recorded as stopped, nothing is retried
    or requeued, and `python -m job runs` says where it stopped. Both routes' batch scripts."""
    jid, everything, run_dir = _stopped_midway(slurm_env, tmp_path, via, "--signal=INT", "--full")
    saved = {int(n) for n in re.findall(r"stopped \(Ctrl-C\): saved step (\d+); exiting with 130", everything)}
    assert len(saved) == 1, everything  # every process saved the same step
    (stopped,) = saved
    assert "Traceback" not in everything, everything
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [str(stopped)]
    (record,) = _ended(run_dir)
    assert record == {**record, "job": jid, "attempt": 1, "code": 130, "outcome": "stopped"}, record
    assert record["action"] == "stop" and record["says"] == (
        "not retried: stopped with Ctrl-C after a save; the same command resumes"), record
    shown = subprocess.run(["scontrol", "show", "job", jid], env=slurm_env, capture_output=True, text=True,
                           check=True).stdout
    assert "Restarts=0" in shown, shown
    assert state_of(run_dir).describe() == f"stopped at step {stopped} (Ctrl-C; the same command resumes)"


def test_a_cancelled_job_saves_its_step_records_it_as_cancelled_and_is_not_requeued(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A plain `scancel JOBID`: Slurm sends every step SIGTERM, which the tasks take as a preemption notice (save,
    exit 75). The supervisor, sent SIGTERM too, waits for them, finds the job cancelled (not ended by its time
    limit or a preemption) and requeues nothing: `scontrol requeue` would take the completing job and run it again,
    undoing the scancel. The attempt is recorded as cancelled and `python -m job runs` says so."""
    jid, everything, run_dir = _stopped_midway(slurm_env, tmp_path, "submitit")
    saved = {int(n) for n in re.findall(r"preempted: saved step (\d+); exiting with 75", everything)}
    assert len(saved) == 1, everything
    (step,) = saved
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [str(step)]
    (record,) = _ended(run_dir)
    assert record == {**record, "job": jid, "attempt": 1, "code": 75, "outcome": "cancelled",
                      "action": "stop", "says": "not retried: the job was cancelled (scancel); the same command resumes"
                      }, record
    assert f"job {jid} attempt 1 ended with exit code 75, the job cancelled" in everything, everything
    assert "Traceback" not in everything, everything
    shown = subprocess.run(["scontrol", "show", "job", jid], env=slurm_env, capture_output=True, text=True,
                           check=True).stdout
    assert "JobState=CANCELLED" in shown and "Restarts=0" in shown, shown  # never requeued
    assert state_of(run_dir).describe() == f"cancelled at step {step} (scancel; the same command resumes)"
