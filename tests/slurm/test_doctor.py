"""`make doctor` against the real local Slurm cluster: each check passes on the cluster as it is, and each failing
case is made real (a partition that does not exist or is DOWN, a TIME over MaxTime, more nodes than there are, a run
dir the compute nodes do not see, an interpreter they do not have, a container runtime they lack)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.launching import ROOT
from tests.records import check_lines
from tests.slurm.conftest import CLUSTER_DIR
from tests.slurm.test_slurm import deploy_argv, task_env

pytestmark = pytest.mark.slurm
ISLAND = "island"  # slurm/local-cluster.sh: a node alone in a hidden partition, with a /tmp of its own


def make_doctor(slurm_env: dict[str, str], **variables: str) -> subprocess.CompletedProcess[str]:
    """`make doctor VAR=...` of this checkout (its venv as it is: never rebuilt here)."""
    bin_dir = Path(sys.executable).parent
    argv = ["make", "--no-print-directory", "-o", f"{bin_dir}/.installed", f"BIN={bin_dir}", "doctor",
            *(f"{k}={v}" for k, v in variables.items())]
    env = {k: v for k, v in task_env(slurm_env).items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def doctor(slurm_env: dict[str, str], tmp_path: Path, *flags: str, run_dir: Path | None = None,
           ) -> subprocess.CompletedProcess[str]:
    """`python -m deploy.slurm.doctor FLAGS -- train --run-dir RUN_DIR` (default: a folder under tmp_path)."""
    run = run_dir or tmp_path / "run"
    argv = [sys.executable, "-m", "deploy.slurm.doctor", "--nodes", "4", *flags, "--", "train", "--run-dir", str(run)]
    return subprocess.run(argv, cwd=ROOT, env=task_env(slurm_env), capture_output=True, text=True, timeout=300)


def failing(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]


@pytest.fixture
def partition(slurm_env: dict[str, str]) -> Iterator[Callable[..., str]]:
    """Make a hidden partition for one test (`scontrol create`), deleted after it: partition debug, which
    the other tests use, stays as it is, and sinfo lists no more partitions than before."""
    made: list[str] = []

    def create(**settings: str) -> str:
        name = f"doctor{os.getpid()}x{len(made)}"
        subprocess.run(["scontrol", "create", f"PartitionName={name}", "Hidden=YES",
                        *(f"{k}={v}" for k, v in settings.items())], env=slurm_env, check=True, capture_output=True)
        made.append(name)
        return name

    yield create
    for name in made:
        subprocess.run(["scontrol", "delete", f"PartitionName={name}"], env=slurm_env, capture_output=True)


def test_make_doctor_on_the_local_cluster_passes_every_check(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = make_doctor(slurm_env, NODES="4", ARGS=f"train --run-dir {tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = check_lines(proc.stdout)
    assert set(found) == {"partition", "access", "GPUs per node", "CPUs per node", "memory per node", "nodes",
                          "time limit", "nodes answer", "run", "probe job", "submit folder on a compute node",
                          "run dir on a compute node", "interpreter on a compute node"}, proc.stdout
    assert all(line.startswith("ok ") for line in found.values()), proc.stdout
    assert "debug (the default) is UP, 4 node(s)" in found["partition"]
    assert "within debug's MaxTime 7-00:00:00" in found["time limit"]
    assert f"{tmp_path / 'run'} is the same folder on node" in found["run dir on a compute node"]
    assert not (tmp_path / "run").exists()  # made for the probe, removed after it: the job makes its own
    probe = re.search(r"in ([0-9.]+) s", found["probe job"])
    assert probe, found["probe job"]
    print(f"make doctor: the probe took {probe.group(1)} s")


def test_make_doctor_names_a_partition_that_does_not_exist_and_the_fix(slurm_env: dict[str, str]) -> None:
    proc = make_doctor(slurm_env, NODES="4", PARTITION="nosuch")
    assert proc.returncode != 0
    assert failing(proc) == ["FAIL  partition: PARTITION: expected one of debug, found 'nosuch'. Fix: pick a listed "
                             "partition (sinfo shows them) or leave PARTITION unset"], proc.stdout
    assert "probe job" not in proc.stdout  # nothing to probe without a partition


def test_make_doctor_names_a_time_over_the_partitions_max_time_and_the_fix(slurm_env: dict[str, str]) -> None:
    proc = make_doctor(slurm_env, NODES="4", TIME="99-00:00:00")
    assert proc.returncode != 0
    assert failing(proc) == ["FAIL  time limit: TIME: expected at most partition debug's MaxTime 7-00:00:00, found "
                             "'99-00:00:00'. Fix: TIME=7-00:00:00 or less (the job saves and requeues itself at its "
                             "limit)"], proc.stdout
    assert check_lines(proc.stdout)["probe job"].startswith("ok")  # the rest is still checked: every problem at once


def test_a_partition_set_down_is_one_line_with_an_up_one_to_use(slurm_env: dict[str, str], tmp_path: Path,
                                                                 partition: Callable[..., str]) -> None:
    down = partition(Nodes="node[1-4]", State="DOWN")
    proc = doctor(slurm_env, tmp_path, "--partition", down)
    assert proc.returncode == 1
    assert failing(proc) == [f"FAIL  partition: PARTITION: expected a partition in state UP (DOWN queues jobs that "
                             f"never start, DRAIN and INACTIVE refuse them), found '{down}, which is DOWN'. Fix: "
                             f"PARTITION=debug (debug UP), or ask the admins when {down} comes back"], proc.stdout


def test_more_nodes_than_the_partition_has_is_one_line(slurm_env: dict[str, str], tmp_path: Path,
                                                      partition: Callable[..., str]) -> None:
    proc = doctor(slurm_env, tmp_path, "--nodes", "5", "--quick", "--check-run", "0")  # the batch: its own test
    assert proc.returncode == 1
    assert failing(proc) == ["FAIL  nodes: NODES: expected at most 4: partition debug has 4 node(s), found 5. "
                             "Fix: NODES=4, or another PARTITION"], proc.stdout
    two = partition(Nodes="node[1-2]")
    proc = doctor(slurm_env, tmp_path, "--partition", two, "--quick")
    assert failing(proc) == [f"FAIL  nodes: NODES: expected at most 2: partition {two} has 2 node(s), found 4. "
                             "Fix: NODES=2, or another PARTITION (debug)"], proc.stdout


def test_gpus_per_node_over_what_the_nodes_have_is_one_line(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = doctor(slurm_env, tmp_path, "--gpus-per-node", "8", "--quick")
    assert proc.returncode == 1
    assert failing(proc)[0] == ("FAIL  GPUs per node: GPUS_PER_NODE: expected at most 4: the most GPUs a node of "
                                "partition debug has, found '8'. Fix: GPUS_PER_NODE=4"), proc.stdout


def test_a_run_dir_the_compute_nodes_do_not_share_is_one_line(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The island node's jobs see a /tmp of their own (slurm/local-cluster.sh): tmp_path, under this machine's
    /tmp, is the login-node-only folder users pick by mistake. A checkout under /tmp (a clone made there) is
    hidden from the island too: then its interpreter and submit folder fail as well, each in its own line."""
    state = subprocess.run(["sinfo", "--noheader", "--partition", ISLAND, "--format", "%T"], env=slurm_env,
                           capture_output=True, text=True).stdout.strip()
    if state not in ("idle", "mixed", "allocated"):
        pytest.skip(f"node {ISLAND} is {state or 'absent'}: slurm/local-cluster.sh up starts it (needs unshare "
                    "--mount, root with CAP_SYS_ADMIN); its log says why not")
    hidden_checkout = ROOT.resolve().is_relative_to("/tmp")
    also = {"submit folder on a compute node", "interpreter on a compute node"} if hidden_checkout else set()
    proc = doctor(slurm_env, tmp_path, "--nodes", "1", "--partition", ISLAND)
    assert proc.returncode == 1, proc.stdout
    run = tmp_path / "run"
    found = check_lines(proc.stdout)
    assert {name for name, line in found.items() if line.startswith("FAIL")} == {"run dir on a compute node", *also}
    assert found["run dir on a compute node"] == (
        f"FAIL  run dir on a compute node: --run-dir {run} (made here) does not exist on "
        f"{ISLAND}: the compute nodes do not see this folder. Fix: a --run-dir on a file system "
        "the compute nodes mount too (a shared home or project folder, not /tmp or a login "
        "node's own disk), e.g. ARGS='train --run-dir runs/NAME' from a shared checkout, or gs://"), proc.stdout
    assert not run.exists()
    # the same request with a run dir the island node shares (outside /tmp) passes that check
    shared_dir = Path(tempfile.mkdtemp(prefix="jax-job-doctor-", dir="/var/tmp"))
    try:
        shared = doctor(slurm_env, tmp_path, "--nodes", "1", "--partition", ISLAND, run_dir=shared_dir / "run")
    finally:
        shutil.rmtree(shared_dir, ignore_errors=True)
    failing_now = {name for name, line in check_lines(shared.stdout).items() if line.startswith("FAIL")}
    assert failing_now == also and shared.returncode == (1 if also else 0), shared.stdout


def test_a_node_whose_slurmd_died_is_named_and_make_slurm_up_starts_it_again(slurm_env: dict[str, str],
                                                                              tmp_path: Path) -> None:
    pid_file = CLUSTER_DIR / "run" / "slurmd-node4.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    try:
        deadline, state = time.monotonic() + 90, "idle"
        while not state.endswith("*") and time.monotonic() < deadline:  # the controller's next ping misses it
            time.sleep(1)
            state = subprocess.run(["sinfo", "--noheader", "--partition", "debug", "--nodes", "node4", "--format",
                                    "%T"], env=slurm_env, capture_output=True, text=True).stdout.strip()
        proc = doctor(slurm_env, tmp_path, "--nodes", "2", "--quick", "--check-run", "0")
        assert proc.returncode == 1, proc.stdout
        assert failing(proc) == [
            "FAIL  nodes answer: expected every node of partition debug to answer the controller (its slurmd "
            f"running), found 1 of 4 that do not: node4 ({state}: not responding). Fix: start slurmd on node4 again "
            "(the local cluster: `make slurm-up NODES=...` with its node count starts any that died; elsewhere: ask "
            "the admins), then, if it stays down, `scontrol update nodename=node4 state=resume`"], proc.stdout
    finally:
        up = subprocess.run(["bash", str(ROOT / "slurm" / "local-cluster.sh"), "up", "4"], env=slurm_env,
                            capture_output=True, text=True, timeout=120)
    assert up.returncode == 0 and "slurmd of node4 was not running: starting it again" in up.stderr, up.stderr
    assert doctor(slurm_env, tmp_path, "--quick", "--check-run", "0").returncode == 0


def test_an_interpreter_missing_on_the_compute_nodes_is_one_line(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = doctor(slurm_env, tmp_path, "--python", "/nonexistent")
    assert proc.returncode == 1
    assert failing(proc) == ["FAIL  interpreter on a compute node: PYTHON=/nonexistent does not exist on node1. Fix: "
                             "PYTHON=an interpreter on a file system the compute nodes mount (`make venv` in a "
                             "shared checkout), or IMAGE=... to run from an image"], proc.stdout


def test_an_interpreter_without_the_job_on_the_compute_nodes_is_one_line(slurm_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = doctor(slurm_env, tmp_path, "--python", str(bare / "bin" / "python"))
    assert proc.returncode == 1
    (line,) = failing(proc)
    assert f"PYTHON={bare / 'bin' / 'python'} on node1 cannot `import job, jax` (exit 1: ModuleNotFoundError" in line
    assert "Fix: install the job into it" in line


def test_an_image_whose_runtime_the_nodes_lack_is_one_line(slurm_env: dict[str, str], tmp_path: Path) -> None:
    proc = doctor(slurm_env, tmp_path, "--image", "docker://example/job:cpu", "--container-runtime", "apptainer")
    assert proc.returncode == 1
    assert failing(proc) == ["FAIL  container runtime: IMAGE=docker://example/job:cpu runs through apptainer, which "
                             "is not on PATH on node1. Fix: CONTAINER_RUNTIME=podman (or apptainer) where it is "
                             "installed, `module load apptainer` in the shell that runs make, or unset IMAGE to run "
                             "from the shared venv"], proc.stdout


def test_an_image_whose_runtime_the_nodes_have_passes(slurm_env: dict[str, str], podman_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    # podman_env: without podman this skips with the reason (a failure under JOB_REQUIRE_ALL_TIERS=1)
    podman = doctor(slurm_env, tmp_path, "--image", "docker://example/job:cpu", "--container-runtime", "podman")
    runtime = check_lines(podman.stdout)["container runtime"]
    assert runtime.startswith("ok    container runtime: podman at "), podman.stdout


@pytest.mark.parametrize("request_flags", [["--partition", "nosuch"], ["--time", "99-00:00:00"], ["--nodes", "5"]])
def test_submit_slurm_refuses_a_quick_check_failure_before_queueing_anything(
        slurm_env: dict[str, str], tmp_path: Path, request_flags: list[str]) -> None:
    proc = subprocess.run(deploy_argv(tmp_path, *request_flags, job=["train", "--run-dir", str(tmp_path / "run")]),
                          env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Fix: " in proc.stderr
    assert "submitted" not in proc.stdout
    assert not (tmp_path / "logs").exists()  # made just before sbatch: nothing got that far


def test_a_sweep_refuses_a_time_over_max_time_before_writing_or_queueing_anything(slurm_env: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    job = ["train", "--run-dir", str(tmp_path / "sweep")]
    proc = subprocess.run(deploy_argv(tmp_path, "--time", "8-00:00:00", "--sweep", "seed=0,1", job=job),
                          env=task_env(slurm_env), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "TIME: expected at most partition debug's MaxTime 7-00:00:00, found '8-00:00:00'" in proc.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "logs").exists()
