"""Detached runs on the gcloud simulator: the job outlives the ssh that started it or follows it.

The simulator drops a follow session (exit 255) while the workers keep running
(`ssh.schedule_drop`); `make tpu-pod` re-attaches and reports the run as if
nothing happened. A second `make tpu-pod`, `make tpu-stop` and `make tpu-logs`
work from other machines (other TPU_LOCAL_DIRs) with only the slice's name.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.launching import explain, wait_for, wait_for_line
from tests.records import summary
from tests.tpu.fake_gcloud import ssh as fake_ssh
from tests.tpu.harness import ROOT, ZONE, Cloud
from tests.tpu.test_pod import train_args

pytestmark = pytest.mark.slow


def worker0_follows(cloud: Cloud) -> int:
    """How many times worker 0's log was followed (ssh --worker=0 with `tail -F`)."""
    return sum(c[3] == "ssh" and "--worker=0" in c and any(" -F logs/job.log" in a for a in c)
               for c in cloud.tpu_calls())


def test_dropped_connections_are_reattached_while_the_workers_keep_training(cloud: Cloud, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for step in (5, 10):  # the follow session drops twice; the detached job never notices
        fake_ssh.schedule_drop(cloud.state, "pod-h", ZONE, when_exists=run_dir / "checkpoints" / str(step))
    proc = cloud.make("tpu-pod", TPU_NAME="pod-h", ZONE=ZONE, ACCELERATOR="v4-16", ARGS=train_args(run_dir, 20))
    assert proc.returncode == 0, explain(proc)
    assert summary(run_dir)["completed"] is True and summary(run_dir)["final_step"] == 20
    drops = re.findall(r"the connection to worker 0 of pod-h dropped \(exit code 255\)", proc.stderr)
    reattached = [float(s) for s in re.findall(r"re-attaching to worker 0's log, ([0-9.]+) s after the drop",
                                               proc.stderr)]
    assert len(drops) == 2 and len(reattached) == 2, explain(proc)
    print(f"drop to re-attach: {', '.join(f'{s:.1f} s' for s in reattached)}")  # a figure, not an assertion
    assert worker0_follows(cloud) == 3 and "step 20/20" in proc.stdout and "done: " in proc.stdout  # the summary
    assert "resumed from step" not in proc.stdout  # one run, never restarted
    assert cloud.verbs().count("tpu-vm create") == 1 and "preempted" not in proc.stderr
    assert "must be the same shared mount (gcsfuse, Filestore) on all 2 workers" in proc.stderr  # a /tmp path
    for worker in (0, 1):
        log = (cloud.local / "pod-h" / "logs" / f"worker-{worker}.log").read_text()
        assert f"process {worker} of 2" in log or f"Rank {worker} " in log, log


def test_a_second_pod_attaches_and_stop_and_logs_work_from_other_machines(cloud: Cloud, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    slice_ = {"TPU_NAME": "pod-i", "ZONE": ZONE, "ACCELERATOR": "v4-16", "ARGS": train_args(run_dir, 2000)}
    first = subprocess.Popen(cloud.make_argv("tpu-pod", **slice_), cwd=ROOT, env=cloud.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(run_dir / "checkpoints" / "5", timeout_s=300, proc=first)
        second = subprocess.Popen(cloud.make_argv("tpu-pod", **slice_, TPU_LOCAL_DIR=str(tmp_path / "laptop")),
                                  cwd=ROOT, env=cloud.env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        # the second follower has found the job and attached before anyone stops it (stopped earlier, it would
        # find no job running and start one)
        attached = wait_for_line(second, "attaching to it instead of starting another", timeout=300, stderr=True)
        stop = cloud.make("tpu-stop", **slice_, TPU_LOCAL_DIR=str(tmp_path / "desktop"))
        assert stop.returncode == 0, explain(stop)
        outs = [p.communicate(timeout=120) for p in (first, second)]
        outs[1] = (outs[1][0], "".join(attached) + outs[1][1])
    finally:
        for p in (first, second) if "second" in locals() else (first,):
            p.kill()
    # 75: saved and stopped. (134 when jax's coordination service aborts process 0 after its save because
    # process 1 exited first: the job's own shutdown race; the launcher reports whatever code the job left.)
    codes = set()
    for p, (out, err) in zip((first, second), outs):
        found = re.search(r"the job was stopped by `tpu-stop` \(exit code (\d+)\): not restarting it", err)
        assert p.returncode != 0 and found, f"exit {p.returncode}\n{out}\n{err}"
        assert found.group(1) in ("75", "134") and not re.search(r"^\[tpu\] (retry \d|preempted)", err, re.M), err
        codes.add(found.group(1))
    assert len(codes) == 1  # both followers report the one job's exit code
    assert "a job is already running on pod-i: attaching to it instead of starting another" in outs[1][1]
    assert cloud.verbs().count("tpu-vm create") == 1
    assert sum("setsid nohup" in " ".join(c) for c in cloud.calls()) == 1  # started once
    logs = cloud.make("tpu-logs", **slice_, TPU_LOCAL_DIR=str(tmp_path / "tablet"))
    assert logs.returncode == 0, explain(logs)
    assert f"the job ended with exit code {codes.pop()} (stopped by `tpu-stop`)" in logs.stdout
    assert "preempted: saved step" in (tmp_path / "tablet" / "pod-i" / "logs" / "worker-0.log").read_text()


def test_two_slices_form_one_cluster_of_four_processes(cloud: Cloud, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    slice_ = {"TPU_NAME": "pod-m", "ZONE": ZONE, "ACCELERATOR": "v4-16", "QUEUED": "1", "SLICES": "2",
              "ARGS": train_args(run_dir, 10)}
    proc = cloud.make("tpu-pod", **slice_)
    assert proc.returncode == 0, explain(proc)
    assert summary(run_dir)["completed"] is True and summary(run_dir)["final_step"] == 10
    logs = cloud.local / "pod-m" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"worker-{i}.log" for i in range(4)]
    for rank in range(4):  # worker I of slice S is process 2*S+I of one cluster of 4
        text = (logs / f"worker-{rank}.log").read_text()
        assert re.search(rf"process {rank} of 4 \(tpu\)", text), text
    starts = [c for c in cloud.tpu_calls() if c[3] == "ssh" and "setsid nohup" in " ".join(c)]
    assert [c[4] for c in starts] == ["pod-m-0", "pod-m-1"]
    for slice_id, call in enumerate(starts):
        script = next(a for a in call if a.startswith("--command="))
        assert f"MEGASCALE_SLICE_ID={slice_id} " in script and "MEGASCALE_NUM_SLICES=2 " in script
        assert "MEGASCALE_COORDINATOR_ADDRESS=127.0.0.1:8080 " in script and "MEGASCALE_PORT=8080 " in script
