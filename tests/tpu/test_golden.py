"""The exact gcloud argv of every TPU command, checked against golden files in tests/tpu/golden/.

Each golden file is the JSON list of the argv lists one command runs, in
order, against an in-process stand-in for gcloud. After an intended change,
rerun with UPDATE_GOLDEN=1 (see tests/golden.py) and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from deploy.tpu import cli as tpu
from deploy.tpu import gcloud
from deploy.tpu.config import TpuConfig
from tests.golden import check_golden
from tests.tpu.harness import ROOT
from tests.tpu.sim_runner import SimRunner

GOLDEN = Path(__file__).with_name("golden")
HOSTILE = ("train", "--run-dir", "/mnt/bucket/run 1", "--name", "a b; touch /tmp/pwned $(id)", "it's \"x\"")
BASE = TpuConfig(name="pod-1", zone="us-central2-b", accelerator="v4-32", source_dir=str(ROOT),
                 job_args=("train", "--run-dir", "/mnt/bucket/run1", "--steps", "100"))


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the code archive and logs land in ./runs/tpu/NAME, a fixed relative path


def dispatch(command: str, cfg: TpuConfig, runner: SimRunner) -> int:
    runner.dry_run = cfg.dry_run
    return tpu.dispatch(command, cfg, runner)


NETWORK_OPTIONS = {"reserved": True, "internal_ip": True, "network": "my-vpc", "subnetwork": "my-subnet",
                   "service_account": "job@my-project.iam.gserviceaccount.com", "tags": ("tpu", "train"),
                   "project": "my-project"}
STOCKOUT = ('ERROR: (gcloud.compute.tpus.tpu-vm.create) {"code": 8, "message": "There is no more capacity in the '
            'zone \\"us-central2-b\\"; you can try in another zone where Cloud TPU Nodes are offered"}')


CASES = {
    # name: (command, config changes, runner state)
    "create_on_demand": ("create", {}, {}),
    "create_spot": ("create", {"spot": True, "project": "my-project"}, {}),
    "create_queued": ("create", {"queued": True, "spot": True}, {}),
    "create_reuses_ready_slice": ("create", {}, {"node": "READY"}),
    "create_recreates_preempted_slice": ("create", {"spot": True}, {"node": "PREEMPTED"}),
    "run": ("run", {"job_args": HOSTILE}, {"node": "READY"}),
    "run_image": ("run", {"image": "us-docker.pkg.dev/p/r/job:1", "accelerator": "v4-8"},
                  {"node": "READY", "accelerator": "v4-8"}),
    "logs": ("logs", {}, {"node": "READY"}),
    "stop": ("stop", {}, {"node": "READY"}),
    "status": ("status", {}, {"node": "READY"}),
    "delete": ("delete", {}, {"node": "READY"}),
    "delete_queued": ("delete", {"queued": True}, {"node": "READY", "queued": "ACTIVE"}),
    "delete_absent": ("delete", {}, {}),
    "pod_dry_run": ("pod", {"dry_run": True, "accelerator": "v4-16"}, {}),
    "pod_preempted_then_resumed": ("pod", {"spot": True}, {"job_outcomes": [(255, "PREEMPTED"), (0, None)]}),
    "create_with_network_options": ("create", NETWORK_OPTIONS, {}),
    "create_queued_with_network_options": ("create", {**NETWORK_OPTIONS, "queued": True}, {}),
    "create_spot_after_a_stockout": ("create", {"spot": True, "stockout_backoff_s": 0.001},
                                     {"create_errors": [STOCKOUT]}),
    "create_two_slices": ("create", {"queued": True, "slices": 2}, {}),
    "status_two_slices": ("status", {"queued": True, "slices": 2}, {"node": "READY", "queued": "ACTIVE"}),
    "delete_two_slices": ("delete", {"queued": True, "slices": 2}, {"node": "READY", "queued": "ACTIVE"}),
    "doctor": ("doctor", {"project": "my-project"}, {"node": "READY"}),
    "pod_failed_then_retried": ("pod", {}, {"job_outcomes": [(1, None), (0, None)], "worker_outcomes": [[
        "worker 0: ended 1 1700000002.0 RuntimeError: lost process 3", "worker 3: ended 137 1700000001.0 step 7"]]}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gcloud_argv_matches_golden_file(name: str) -> None:
    command, changes, state = CASES[name]
    cfg = dataclasses.replace(BASE, **changes)
    runner = SimRunner(**state)
    assert dispatch(command, cfg, runner) == 0
    check_golden(GOLDEN / f"{name}.json", json.dumps(runner.calls, indent=1) + "\n")


def test_ssh_and_scp_reach_a_slice_by_its_internal_ip() -> None:
    cfg = dataclasses.replace(BASE, internal_ip=True, queued=True, slices=2)
    argv = [gcloud.upload(cfg, "code.tar.gz", "code.tar.gz", node=cfg.slice_names[1]),
            gcloud.download(cfg, 3, "job.log", "worker-3.log", node=cfg.slice_names[0]),
            gcloud.ssh_all(cfg, "hostname", node=cfg.slice_names[1])]
    check_golden(GOLDEN / "ssh_scp_internal_ip.json", json.dumps(argv, indent=1) + "\n")


def test_user_arguments_travel_as_one_quoted_argv_element() -> None:
    cfg = dataclasses.replace(BASE, job_args=HOSTILE)
    runner = SimRunner(node="READY")
    dispatch("run", cfg, runner)
    ssh_run = [c for c in runner.calls if c[4] == "ssh"][2]  # probe, setup, start
    assert sum(a.startswith("--command=") for a in ssh_run) == 1
    script = next(a for a in ssh_run if a.startswith("--command="))
    # the job runs in a detached `bash -c WRAPPER`: quoted once for that shell, once inside it
    script = shlex.split(script[script.index("setsid nohup bash -c "):])[4]
    assert "'a b; touch /tmp/pwned $(id)'" in script
    assert "'/mnt/bucket/run 1'" in script
    assert """'it'"'"'s "x"'""" in script
