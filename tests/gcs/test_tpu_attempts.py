"""The TPU pod loop's RUN_DIR/attempts.jsonl in a gs:// run dir (BUCKET), against the Cloud Storage emulator: an
object cannot be appended to, so each record rewrites it; `python -m job runs` reads it from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.tpu import cli as tpu
from deploy.tpu.config import TpuConfig
from job.observe.status import State, state_of
from tests.gcs_emulator import BUCKET, Emulator
from tests.tpu.harness import ROOT
from tests.tpu.sim_runner import SimRunner

pytestmark = pytest.mark.gcs

WORKER_1_KILLED = ["worker 0: ended 1 1700000003.5 RuntimeError: lost process 1",
                   "worker 1: ended 137 1700000003.1 Killed"]


def test_every_attempt_of_a_bucket_run_is_one_record_in_the_bucket(gcs_here: Emulator, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    gcs_here.write("run1/config.json", json.dumps({"steps": 30}).encode())
    cfg = TpuConfig(name="pod-b", zone="us-central2-b", accelerator="v4-16", retries=1, source_dir=str(ROOT),
                    job_args=("train", "--run-dir", f"gs://{BUCKET}/run1"))
    runner = SimRunner(job_outcomes=[(1, None)] * 2, worker_outcomes=[WORKER_1_KILLED] * 2)
    assert tpu.pod(cfg, runner) == 137
    lines = [json.loads(line) for line in gcs_here.read("run1/attempts.jsonl").decode().splitlines()]
    assert [(r["attempt"], r["code"], r["node"], r["process"], r["cause"], r["says"]) for r in lines] == [
        (1, 137, "pod-b worker 1", "1", "Killed", "restart 1 of 1 in the allocation, on the same nodes"),
        (2, 137, "pod-b worker 1", "1", "Killed", "not retried: the retry budget is spent (1 of 1)")]
    status = state_of(f"gs://{BUCKET}/run1")
    assert status.state is State.FAILED
    assert status.describe() == "failed (exit 137, process 1 on pod-b worker 1) at step 0"
