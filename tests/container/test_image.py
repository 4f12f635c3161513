"""The real CPU image, built with podman: who it runs as, its entrypoint, its
layer cache, and two containers that train the example job as one cluster."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.container.conftest import ROOT, Built, build_image, figure, podman
from tests.launching import explain, launcher_argv, run
from tests.records import summary
from tests.unit.test_security import KEPT_OUT, dockerignore, ignored

# The first test to ask for the image may also make the base and build it: minutes on a busy machine.
pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

SMALL = ("--steps", "20", "--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64", "--eval-every", "1000")
IMAGE_UID = 10001  # docker/Dockerfile's USER
CONTEXT = ("requirements.lock", ".dockerignore", "job", "docker")  # what a build of this repo reads


def run_local(env: dict[str, str], image: str, runs: Path, *job_args: str, n: int = 2,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(ROOT / "docker" / "run_local.py"), "--engine", "podman", "-n", str(n),
            "--devices-per-process", "1", "--image", image, "--runs", str(runs), "--", *job_args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_job_runs_as_a_fixed_non_root_user(cpu_image: Built, podman_env: dict[str, str]) -> None:
    configured = podman(podman_env, "image", "inspect", "--format", "{{.Config.User}}", cpu_image.tag)
    assert configured.stdout.strip() == f"{IMAGE_UID}:{IMAGE_UID}", configured.stderr
    ids = podman(podman_env, "run", "--rm", cpu_image.tag, "id", "-u")
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.strip() == str(IMAGE_UID)


def test_the_engine_leaves_every_secret_out_of_the_build_context(podman_env: dict[str, str],
                                                                 tmp_path: Path) -> None:
    # The real .dockerignore, read by podman itself (a FROM scratch image of the whole context: no base,
    # no RUN). It also checks tests/unit/test_security.py's reading of .dockerignore, used where podman is not.
    context = tmp_path / "context"
    paths = (*KEPT_OUT, "requirements.lock", "docker/requirements-cuda.lock", "docker/entrypoint.sh",
             "docker/run_local.py", "job/__init__.py", "job/sub/data.py")
    for path in paths:
        (context / path).parent.mkdir(parents=True, exist_ok=True)
        (context / path).write_text(f"{path}\n")
    shutil.copy2(ROOT / ".dockerignore", context / ".dockerignore")
    (tmp_path / "Containerfile").write_text("FROM scratch\nCOPY . /ctx/\n")
    tag = "localhost/jax-cluster-job-test:context"
    built = podman(podman_env, "build", "--pull=never", "--file", str(tmp_path / "Containerfile"), "--tag", tag,
                   str(context))
    assert built.returncode == 0, built.stdout + built.stderr
    container = podman(podman_env, "create", tag, "none").stdout.strip()
    try:
        exported = subprocess.run(["podman", "export", container], env=podman_env, capture_output=True,
                                  timeout=120, check=True).stdout
    finally:
        podman(podman_env, "rm", "--force", container)
        podman(podman_env, "rmi", "--force", tag)
    with tarfile.open(fileobj=io.BytesIO(exported)) as tar:
        sent = {m.name.removeprefix("ctx/") for m in tar.getmembers() if m.isfile() and m.name.startswith("ctx/")}
    rules = dockerignore((ROOT / ".dockerignore").read_text())
    assert sent == {p for p in paths if not ignored(rules, p)}
    assert sent == {"requirements.lock", "docker/requirements-cuda.lock", "docker/entrypoint.sh", "job/__init__.py",
                    "job/sub/data.py"}


def test_base_glibc_is_new_enough_for_every_flavours_wheels(cpu_image: Built, podman_env: dict[str, str]) -> None:
    # The cuda lock is resolved for manylinux_2_28, the tpu lock (libtpu) for 2_31.
    proc = podman(podman_env, "run", "--rm", cpu_image.tag, "python", "-c",
                  "import platform; print(platform.libc_ver()[1])")
    assert proc.returncode == 0, proc.stderr
    assert tuple(map(int, proc.stdout.strip().split("."))) >= (2, 31), proc.stdout


def test_the_entrypoint_runs_python_m_job_with_the_arguments(cpu_image: Built, podman_env: dict[str, str]) -> None:
    proc = podman(podman_env, "run", "--rm", cpu_image.tag, "no-such-command")
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert "expected one of the commands above, found 'no-such-command'" in proc.stderr
    # A program as the first argument runs as given: the TPU path runs `IMAGE python -m job ...`.
    proc = podman(podman_env, "run", "--rm", cpu_image.tag, "python", "-c", "import job, sys; print(sys.prefix)")
    assert (proc.returncode, proc.stdout.strip()) == (0, "/opt/venv"), proc.stderr


def test_a_code_only_change_reuses_the_dependency_layer(cpu_image: Built, podman_env: dict[str, str],
                                                        base_image: str, tmp_path: Path,
                                                        pytestconfig: pytest.Config) -> None:
    context = tmp_path / "repo"
    context.mkdir()
    for name in CONTEXT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, context / name)
    (context / "job" / "_rebuild_probe.py").write_text('TOKEN = "rebuilt after a code change"\n')
    tag = cpu_image.tag.replace(":cpu", ":rebuild")
    try:
        rebuilt = build_image(context, tag, base_image, podman_env, timeout=300)
        figure(pytestconfig, "code-only rebuild", rebuilt.seconds)
        step = next(line for line in rebuilt.log.splitlines() if line.startswith("STEP") and "pip install" in line)
        after = rebuilt.log.split(step, 1)[1].lstrip().splitlines()[0]
        assert after.startswith("--> Using cache"), f"the dependency layer was rebuilt:\n{rebuilt.log[-4000:]}"
        assert "Successfully installed" not in rebuilt.log
        probe = podman(podman_env, "run", "--rm", tag, "python", "-c", "import job._rebuild_probe as p; print(p.TOKEN)")
        assert probe.stdout.strip() == "rebuilt after a code change", probe.stderr
    finally:
        podman(podman_env, "rmi", "--force", tag)


@pytest.mark.slow
def test_two_containers_train_as_one_cluster_like_two_local_processes(
        cpu_image: Built, podman_env: dict[str, str], tmp_path: Path, pytestconfig: pytest.Config) -> None:
    runs = tmp_path / "runs"
    began = time.monotonic()
    proc = run_local(podman_env, cpu_image.tag, runs, "train", "--run-dir", "runs/two", *SMALL)
    figure(pytestconfig, "2-container training run (20 steps)", time.monotonic() - began)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    logs = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}]" in logs and f"process {rank} of 2 (local)" in logs, logs[-4000:]
    in_containers = summary(runs / "two")
    assert in_containers["completed"] and in_containers["final_step"] == 20, in_containers
    # Written by the containers, through the shared folder, as the image's user.
    assert (runs / "two" / "summary.json").stat().st_uid == IMAGE_UID

    # Only process 0 reports; the same job as 2 local processes is the reference.
    reference = run(launcher_argv(2, [sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path / "ref"),
                                      *SMALL], devices=1), timeout=300,
                    JOB_TESTS_COMPILE="default")  # compiled as in the containers (tests/container/conftest.py)
    assert reference.returncode == 0, explain(reference, reference.stdout, reference.stderr)
    on_host = summary(tmp_path / "ref")
    assert in_containers["train_loss"] == pytest.approx(on_host["train_loss"], rel=1e-6)
    assert in_containers["eval_loss"] == pytest.approx(on_host["eval_loss"], rel=1e-6)
    # bitwise where the image and this host run the same jax and jaxlib on the same CPU; the image installs the
    # project's lock for Python 3.12+, so a host on Python 3.11 (jax 0.10.2) agrees in losses only (above)
    versions = [{name: provenance(folder)["packages"].get(name) for name in ("jax", "jaxlib")}
                for folder in (runs / "two", tmp_path / "ref")]
    if versions[0] == versions[1]:
        assert in_containers["params_sha256"] == on_host["params_sha256"], "same jaxlib, same CPU: bitwise equal"


def provenance(run_dir: Path) -> dict:
    """The newest attempt of a run dir's provenance.json (what ran: its packages' versions, ...)."""
    return json.loads((run_dir / "provenance.json").read_text())["attempts"][-1]


def test_one_failing_container_stops_the_others(cpu_image: Built, podman_env: dict[str, str],
                                                tmp_path: Path) -> None:
    program = ("import os, sys, time\n"
               "print('started', flush=True)\n"
               "if os.environ['JOB_LAUNCH_PROCESS_ID'] == '1': time.sleep(3); sys.exit(3)\n"
               "time.sleep(300)\n")
    # rank 0 sleeps 300 s: a run_local that ends inside its 120 s timeout stopped it
    proc = run_local(podman_env, cpu_image.tag, tmp_path / "runs", "python", "-c", program, timeout=120)
    assert proc.returncode == 3, explain(proc, proc.stdout, proc.stderr)
    assert "[rank 0] started" in proc.stdout and "rank 1 exited with code 3" in proc.stderr, proc.stdout + proc.stderr
    left = podman(podman_env, "ps", "--all", "--quiet", f"--filter=ancestor={cpu_image.tag}")
    assert left.stdout.split() == [], "containers left behind"
