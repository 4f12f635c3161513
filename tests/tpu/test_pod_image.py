"""IMAGE runs on the gcloud simulator: every worker runs the job in the project's CPU image, with podman
as the VMs' `docker`; and the registry login the workers do first."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.launching import explain
from tests.records import summary
from tests.tpu.harness import ZONE, Cloud
from tests.tpu.test_pod import train_args


@pytest.mark.slow
@pytest.mark.container
@pytest.mark.timeout(900)  # the first image build of a session takes minutes
def test_image_trains_in_containers_and_leaves_its_checkpoints_on_the_host(
        cloud: Cloud, tmp_path: Path, cpu_image, podman_env: dict[str, str]) -> None:  # noqa: ANN001
    run_dir = tmp_path / "run"
    env = cloud.env(CONTAINERS_CONF=podman_env["CONTAINERS_CONF"])
    try:
        proc = cloud.make("tpu-pod", TPU_NAME="pod-j", ZONE=ZONE, ACCELERATOR="v4-16", IMAGE=cpu_image.tag,
                          ARGS=train_args(run_dir, 10), env=env, timeout=400)
    finally:  # containers outlive a killed client: remove what a failed run left
        subprocess.run(["bash", "-c", "podman ps -aq --filter name=jax-cluster-job-vm | xargs -r podman rm -f"],
                       env=podman_env, capture_output=True)
    assert proc.returncode == 0, explain(proc)
    assert "pulling localhost/jax-cluster-job-test:cpu on 2 workers" in proc.stderr
    assert summary(run_dir)["completed"] is True and summary(run_dir)["final_step"] == 10
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "5"]
    for worker in (0, 1):
        log = (cloud.local / "pod-j" / "logs" / f"worker-{worker}.log").read_text()
        assert re.search(rf"process {worker} of 2 \(tpu\)", log), log
    assert not (Path.cwd() / "jax-cluster-job").exists()  # nothing shipped: the code came in the image
    assert not any(c[3] == "scp" and c[-1] == "--worker=all" for c in cloud.tpu_calls())


def test_configure_docker_is_accepted_only_in_its_real_form(cloud: Cloud, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    ok = subprocess.run([str(Path(__file__).parent / "fake_gcloud" / "gcloud"), "auth", "configure-docker",
                         "us-docker.pkg.dev", "--quiet"], env={**cloud.env(), "HOME": str(home)},
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((home / ".docker" / "config.json").read_text()) == {
        "credHelpers": {"us-docker.pkg.dev": "gcloud"}}
    assert cloud.gcloud("auth", "configure-docker", "us-docker.pkg.dev").returncode == 1  # it would prompt
    bad = cloud.gcloud("auth", "configure-docker", "us-docker.pkg.dev", "--quiet", "--zone=us-central2-b")
    assert bad.returncode == 2 and "unrecognized arguments: --zone=us-central2-b" in bad.stderr
    assert cloud.gcloud("auth", "configure-docker", "--quiet").returncode == 2  # no registry named
