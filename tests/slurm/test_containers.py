"""The containerised Slurm path for real: the CPU image (built once per session by the container
tier's fixture, tests/conftest.py) submitted to the local cluster with CONTAINER_RUNTIME=podman.

slurm/train.sbatch starts every task as `podman run --rm --network=host ... IMAGE python -m job`;
the 4 containers, one per node, form one JAX cluster and train.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import pytest

from tests.container.conftest import Built
from tests.launching import ROOT, explain
from tests.slurm.test_slurm import SMALL, deploy_argv, job_id, task_env

# The image may have to be built first (the stand-in base too): minutes on a busy machine.
pytestmark = [pytest.mark.slurm, pytest.mark.container, pytest.mark.timeout(900)]


def container_starts(env: dict[str, str], image: str, since: str) -> set[str]:
    """Ids of the containers of `image` that podman started since `since` (its event log)."""
    proc = subprocess.run(["podman", "events", "--stream=false", "--since", since, "--filter", "event=start",
                           "--format", "{{.ID}} {{.Image}}"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {line.split()[0] for line in proc.stdout.splitlines() if line.split()[1:] == [image]}


def test_the_cpu_image_trains_in_4_podman_containers_on_4_nodes(slurm_env: dict[str, str], cpu_image: Built,
                                                                podman_env: dict[str, str], tmp_path: Path) -> None:
    # the containers compile as XLA does by default (JOB_TESTS_COMPILE: tests/site/sitecustomize.py would add
    # its fast compile to the XLA_FLAGS deploy.slurm exports to the batch script, which passes it to podman)
    env = {**task_env(slurm_env), "CONTAINERS_CONF": podman_env["CONTAINERS_CONF"], "JOB_TESTS_COMPILE": "default"}
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    job = ["train", "--run-dir", str(tmp_path / "run"), "--steps", "4", "--log-every", "2", *SMALL]
    argv = deploy_argv(tmp_path, "--container-runtime", "podman", "--image", cpu_image.tag, "--wait", job=job)
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    jid = job_id(proc.stdout)
    batch = (tmp_path / "logs" / f"{jid}-batch.log").read_text()
    assert f"job {jid} (restart 0) on node[1-4]: podman run " in batch, batch
    assert f" {cpu_image.tag} python -m job train " in batch, batch
    for rank in range(4):
        log = (tmp_path / "logs" / f"{jid}-{rank}.log").read_text()
        assert f"process {rank} of 4 (slurm) on node{rank + 1}" in log, log
    assert "slurm cluster: process 0 of 4, coordinator node1:" in proc.stdout  # process 0's log, streamed
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] is True and summary["final_step"] == 4
    # podman's own record: at least 4 containers of the image started (other runs may add theirs)
    assert len(container_starts(podman_env, cpu_image.tag, since)) >= 4
