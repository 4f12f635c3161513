"""BUCKET=gs://... on the gcloud simulator, with a Cloud Storage emulator as the simulated cloud's storage:
the workers' access is checked before the job starts, and the run dir lives in the bucket."""

from __future__ import annotations

import json

import pytest

from tests.gcs_emulator import Emulator
from tests.launching import explain
from tests.tpu.harness import SMALL, ZONE, Cloud

pytestmark = pytest.mark.gcs


def bucket_env(cloud: Cloud, gcs: Emulator) -> dict[str, str]:
    """The simulated workers, and the pod loop that records each attempt in the run dir, reach Cloud Storage at the
    emulator."""
    return cloud.env(FAKE_GCLOUD_WORKER_ENV=json.dumps(gcs.env), **gcs.env)


def test_a_bucket_the_workers_cannot_write_is_one_error_naming_the_service_account(cloud: Cloud, gcs: Emulator) -> None:
    proc = cloud.make("tpu-pod", TPU_NAME="pod-k", ZONE=ZONE, ACCELERATOR="v4-16", BUCKET="gs://no-such-bucket/run1",
                      ARGS=f"train --steps 5 {SMALL}", env=bucket_env(cloud, gcs))
    assert proc.returncode != 0 and "tpu-pod] Error 1" in proc.stderr, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert "cannot write to gs://no-such-bucket/run1" in errors[0] and "service account default@fake-project.iam" \
        in errors[0] and "found worker 0: gs://no-such-bucket/run1: bucket does not exist" in errors[0], errors[0]
    assert errors[0].count("Fix: ") == 1
    assert ("Fix: gcloud storage buckets add-iam-policy-binding gs://no-such-bucket "
            "--member=serviceAccount:default@fake-project.iam --role=roles/storage.objectAdmin") in errors[0]
    assert not any("setsid nohup" in " ".join(c) for c in cloud.calls())  # the job never started
    asked = [c for c in cloud.tpu_calls() if c[3] == "describe" and "--format=value(serviceAccount.email)" in c]
    assert len(asked) == 1


def test_two_bucket_run_dirs_are_refused_before_any_gcloud_call(cloud: Cloud) -> None:
    proc = cloud.make("tpu-pod", TPU_NAME="pod-k", ZONE=ZONE, BUCKET="gs://b1/run", ARGS="train --run-dir gs://b2/run")
    assert proc.returncode == 2 and "error: BUCKET (--bucket)" in proc.stderr and "Fix: " in proc.stderr
    assert cloud.calls() == []


@pytest.mark.slow
def test_a_two_worker_run_keeps_its_checkpoints_in_the_bucket(cloud: Cloud, gcs: Emulator) -> None:
    proc = cloud.make("tpu-pod", TPU_NAME="pod-l", ZONE=ZONE, ACCELERATOR="v4-16", BUCKET=f"gs://{gcs.bucket}/run1",
                      ARGS=f"train --steps 10 --ckpt.every 5 --log-every 5 --eval-every 10 {SMALL}",
                      env=bucket_env(cloud, gcs), timeout=400)
    assert proc.returncode == 0, explain(proc)
    assert "checking that every worker can write to gs://job-test/run1" in proc.stderr
    assert json.loads(gcs.read("run1/summary.json"))["final_step"] == 10
    assert any(name.startswith("run1/checkpoints/10/") for name in gcs.objects("run1/checkpoints/"))
    started, record = [json.loads(line) for line in gcs.read("run1/attempts.jsonl").decode().splitlines()]
    assert started == {**started, "event": "started", "attempt": 1}, started  # process 0's, at its start
    assert record == {**record, "event": "ended", "job": "pod-l", "attempt": 1, "code": 0, "outcome": "completed",
                      "action": "none", "says": "none"}, record
