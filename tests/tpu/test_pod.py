"""`make tpu-*` end to end against the gcloud simulator: the real training job on simulated TPU workers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from etils import epath

from job.observe.status import State, state_of
from job.runs import attempts as attempt_records
from tests.launching import explain
from tests.records import summary
from tests.tpu import fake_gcloud
from tests.tpu.harness import SMALL, ZONE, Cloud

REQUEUE = 75


def train_args(run_dir: Path, steps: int) -> str:
    return (f"train --run-dir {shlex.quote(str(run_dir))} --steps {steps} --ckpt.every 5 --log-every 5 "
            f"--eval-every {steps} {SMALL}")


@pytest.mark.slow
def test_pod_trains_on_four_workers_then_reuses_the_slice(cloud: Cloud, tmp_path: Path) -> None:
    # The run folder's name has spaces, quotes, `$()` and `;`: the job must get it verbatim.
    run_dir = tmp_path / "run 1; $(touch pwned) 'q'"
    slice_ = {"TPU_NAME": "pod-a", "ZONE": ZONE, "ACCELERATOR": "v4-32", "ARGS": train_args(run_dir, 10)}
    first = cloud.make("tpu-pod", **slice_)
    assert first.returncode == 0, explain(first)
    assert summary(run_dir)["completed"] is True and summary(run_dir)["final_step"] == 10
    assert "tpu cluster: process 0 of 4" in first.stdout and "step 10/10" in first.stdout  # worker 0 streams
    logs = cloud.local / "pod-a" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"worker-{i}.log" for i in range(4)]
    for i in range(1, 4):
        text = (logs / f"worker-{i}.log").read_text()
        assert f"process {i} of 4" in text or f"Rank {i} " in text, text
    assert not list(tmp_path.rglob("pwned"))
    assert cloud.verbs().count("tpu-vm create") == 1

    second = cloud.make("tpu-pod", **{**slice_, "ARGS": train_args(run_dir, 12)})  # two more steps
    assert second.returncode == 0, explain(second)
    assert "reusing slice pod-a" in second.stderr and "resumed from step 10" in second.stdout
    assert cloud.verbs().count("tpu-vm create") == 1

    status = cloud.make("tpu-status", **slice_)
    assert "pod-a: READY, v4-32, 4 workers" in status.stdout, explain(status)
    logs_out = cloud.make("tpu-logs", **slice_)
    assert logs_out.returncode == 0 and "last" in logs_out.stdout and "resumed from step 10" in logs_out.stdout
    assert cloud.make("tpu-delete", **slice_).returncode == 0
    assert "pod-a: NOT_FOUND" in cloud.make("tpu-status", **slice_).stdout
    again = cloud.make("tpu-delete", **slice_)
    assert again.returncode == 0 and "nothing to delete" in again.stderr


@pytest.mark.slow
def test_preempted_spot_slice_is_recreated_and_the_run_resumes(cloud: Cloud, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake_gcloud.schedule_preemption(cloud.state, "pod-b", ZONE, when_exists=run_dir / "checkpoints" / "5")
    # the workers' SIGTERM comes within 0.1 s of checkpoint 5 and, on CPU, is agreed at the next step by a
    # collective: 100 steps outlast it many times over
    proc = cloud.make("tpu-pod", TPU_NAME="pod-b", ZONE=ZONE, ACCELERATOR="v4-16", SPOT="1", RETRIES="2",
                      ARGS=train_args(run_dir, 100))
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"preempted \(slice PREEMPTED, job exit code 255\): recreating the slice and resuming from the "
                     r"newest checkpoint; preemption 1, which does not spend the retry budget \(0 of 2 retries used\)",
                     proc.stderr), proc.stderr
    resumed = re.search(r"resumed from step (\d+)", proc.stdout)
    assert resumed and 5 <= int(resumed.group(1)) < 100, explain(proc)
    assert summary(run_dir)["completed"] is True and summary(run_dir)["final_step"] == 100
    assert cloud.verbs().count("tpu-vm create") == 2 and cloud.verbs().count("tpu-vm delete") == 1
    assert all("--spot" in c for c in cloud.tpu_calls() if c[3] == "create")


def kill_once_setup(worker: int, when_exists: Path) -> str:
    """--setup for every worker: its `.venv/bin/python` (which the job runs) is python3, except that on `worker`
    the first training job is killed with SIGKILL once `when_exists` appears: a fault keyed by worker."""
    mark = shlex.quote(str(when_exists))
    wrapper = "\n".join([
        "#!/bin/bash",
        f'if [ "$TPU_WORKER_ID" = {worker} ] && [ "$2 $3" = "job train" ] && [ ! -e "$HOME/fault-done" ]; then',
        '  touch "$HOME/fault-done"',
        '  python3 "$@" & pid=$!',
        f'  while kill -0 "$pid" 2>/dev/null; do [ -e {mark} ] && kill -KILL "$pid"; sleep 0.2; done',
        '  wait "$pid"; exit $?',
        "fi",
        'exec python3 "$@"',
    ])
    return f"mkdir -p .venv/bin\ncat >.venv/bin/python <<'EOF'\n{wrapper}\nEOF\nchmod +x .venv/bin/python"


@pytest.mark.slow
def test_a_worker_killed_once_is_retried_from_the_checkpoint_on_the_same_slice(cloud: Cloud, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = cloud.cli("pod", "--name=pod-r", f"--zone={ZONE}", "--accelerator=v4-16", "--retries=2",
                     f"--local-dir={cloud.local}", f"--setup={kill_once_setup(1, run_dir / 'checkpoints' / '5')}",
                     f"--args={train_args(run_dir, 30)}", timeout=400)
    assert proc.returncode == 0, explain(proc)
    # worker 0 ended in reaction to losing process 1; the worker that died is the one named
    retry = re.search(r"retry 1 of 2 after exit code 137 \(SIGKILL\) on worker 1(: .*)?: rerunning from the newest "
                      r"checkpoint on the same slice \(READY", proc.stderr)
    assert retry, explain(proc)
    resumed = re.search(r"resumed from step (\d+)", proc.stdout)
    assert resumed and 5 <= int(resumed.group(1)) < 30, explain(proc)
    assert summary(run_dir)["completed"] is True and summary(run_dir)["final_step"] == 30
    assert cloud.verbs().count("tpu-vm create") == 1 and cloud.verbs().count("tpu-vm delete") == 0
    assert sum("setsid nohup" in " ".join(c) for c in cloud.calls()) == 2  # the run, and its one retry
    # RUN_DIR/attempts.jsonl: the failed attempt names the process that died and its host, then the retry completed
    failed, completed = attempt_records.ended(epath.Path(run_dir))
    assert (failed.job, failed.attempt, failed.code, failed.outcome, failed.process, failed.node, failed.says) == (
        "pod-r", 1, 137, "failed", "1", "pod-r worker 1", "restart 1 of 2 in the allocation, on the same nodes")
    assert (completed.attempt, completed.code, completed.outcome) == (2, 0, "completed")
    assert state_of(run_dir).state is State.COMPLETED


@pytest.mark.slow
def test_a_worker_killed_with_retries_off_leaves_a_run_that_reads_failed_naming_it(cloud: Cloud,
                                                                                   tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = cloud.cli("pod", "--name=pod-s", f"--zone={ZONE}", "--accelerator=v4-16", "--retries=0",
                     f"--local-dir={cloud.local}", f"--setup={kill_once_setup(1, run_dir / 'checkpoints' / '5')}",
                     f"--args={train_args(run_dir, 30)}", timeout=400)
    assert proc.returncode == 137, explain(proc)
    assert "the job failed with exit code 137 (SIGKILL) on worker 1" in proc.stderr, explain(proc)
    (record,) = attempt_records.ended(epath.Path(run_dir))
    assert (record.outcome, record.process, record.node, record.says) == (
        "failed", "1", "pod-s worker 1", "not retried: retries are off (RETRIES=0)")
    status = state_of(run_dir)
    assert status.state is State.FAILED and status.step >= 5, status
    assert status.describe() == f"failed (exit 137, process 1 on pod-s worker 1) at step {status.step}"


@pytest.mark.slow
def test_hostile_args_reach_the_job_verbatim_and_create_no_file(cloud: Cloud) -> None:
    pwned = Path("/tmp/pwned")
    before = pwned.stat().st_mtime_ns if pwned.exists() else None
    hostile = "a b; touch /tmp/pwned $(id)"
    proc = cloud.make("tpu-pod", TPU_NAME="pod-c", ZONE=ZONE, ACCELERATOR="v4-8", ARGS=f'train --name "{hostile}"')
    assert proc.returncode != 0 and "exit code 2" in proc.stderr, explain(proc)  # the job refuses --name
    log = (cloud.local / "pod-c" / "logs" / "worker-0.log").read_text()
    assert f"Unrecognized options: --name, {hostile}" in log, log  # one argument, exactly as given
    assert "uid=" not in log and "uid=" not in proc.stdout
    assert (pwned.stat().st_mtime_ns if pwned.exists() else None) == before
    # probe, setup, start, follow, asking worker 0 whether `tpu-stop` stopped it, and every worker how its job
    # ended: a configuration error, so no retry
    assert re.search(r"the job failed with exit code 2 \(a configuration error\) on worker 0: .*never retried",
                     proc.stderr), proc.stderr
    assert cloud.verbs().count("tpu-vm ssh") == 6


def test_dry_run_prints_every_change_and_only_queries(cloud: Cloud) -> None:
    proc = cloud.make("tpu-pod", TPU_NAME="pod-d", ZONE=ZONE, ACCELERATOR="v4-32", SPOT="1", DRY_RUN="1",
                      ARGS="train --run-dir /mnt/bucket/run")
    assert proc.returncode == 0, explain(proc)
    printed = [shlex.split(line) for line in re.findall(r"^gcloud .*?(?=^gcloud |\Z)", proc.stdout, re.M | re.S)]
    assert [" ".join(c[3:5]) for c in printed] == [  # create, ship, set up, start, follow, fetch the logs
        "tpu-vm create", "tpu-vm scp", "tpu-vm ssh", "tpu-vm ssh", "tpu-vm ssh", *["tpu-vm scp"] * 4]
    questions = [["auth", "list"], ["config", "get-value"], ["tpu-vm", "accelerator-types"], ["tpu-vm", "versions"],
                 ["tpu-vm", "describe"]]  # the quick checks, then the slice's state
    assert all(c[0:2] in questions or c[2:4] in questions for c in cloud.calls()), cloud.calls()
    assert fake_gcloud.node(cloud.state, "pod-d", ZONE) is None


def test_queued_create_waits_until_ready_then_status_and_delete(cloud: Cloud) -> None:
    env = cloud.env(FAKE_GCLOUD_QUEUE_SECONDS="1")
    zone = "us-west4-a"  # v5e (v5litepod) is not offered in us-central2-b
    slice_ = {"TPU_NAME": "pod-e", "ZONE": zone, "ACCELERATOR": "v5litepod-16", "QUEUED": "1", "SPOT": "1",
              "ARGS": "train --run-dir /mnt/bucket/run"}
    proc = cloud.cli("create", "--name=pod-e", f"--zone={zone}", "--accelerator=v5litepod-16", "--queued",
                     "--spot", "--poll-seconds=0.2", "--args=train --run-dir /mnt/bucket/run", env=env)
    assert proc.returncode == 0, explain(proc)
    assert fake_gcloud.node(cloud.state, "pod-e", zone)["state"] == "READY"
    assert "queued-resources create" in " ".join(cloud.verbs())
    status = cloud.make("tpu-status", **slice_)
    assert "pod-e: READY (queued resource ACTIVE), v5litepod-16, 4 workers" in status.stdout, explain(status)
    assert cloud.make("tpu-delete", **slice_).returncode == 0
    assert cloud.calls()[-1][2:4] == ["queued-resources", "delete"] and "--force" in cloud.calls()[-1]


@pytest.mark.parametrize(("variables", "says"), [
    ({"ZONE": ZONE}, "TPU_NAME"),
    ({"TPU_NAME": "pod-f"}, "ZONE"),
    ({"TPU_NAME": "pod-f", "ZONE": ZONE, "ACCELERATOR": "v4_32"}, "ACCELERATOR"),
    ({"TPU_NAME": "pod-f", "ZONE": ZONE, "ACCELERATOR": "v4-"}, "ACCELERATOR"),
    ({"TPU_NAME": "pod-f", "ZONE": ZONE, "ACCELERATOR": "v4-32", "ARGS": "train --run-dir runs/x"}, "ARGS --run-dir"),
])
def test_bad_input_is_one_clear_error_before_any_gcloud_call(cloud: Cloud, variables: dict, says: str) -> None:
    proc = cloud.make("tpu-pod", **variables)
    assert proc.returncode != 0
    assert re.search(rf"^error: {re.escape(says)}.*expected .*Fix: ", proc.stderr, re.M), proc.stderr
    assert cloud.calls() == []


def test_missing_gcloud_says_how_to_install_it(cloud: Cloud) -> None:
    proc = cloud.make("tpu-pod", TPU_NAME="pod-g", ZONE=ZONE, env=cloud.env(with_gcloud=False))
    assert proc.returncode != 0
    assert "error: gcloud: expected the Google Cloud CLI on PATH" in proc.stderr
    assert "https://cloud.google.com/sdk/docs/install" in proc.stderr
    assert cloud.calls() == []
