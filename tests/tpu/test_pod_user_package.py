"""A user's own package on the gcloud simulator: `mypkg/` in a fork of the template (beside job/, written as
docs/training.md shows: a classifier with dropout and input jitter drawing from rng streams the model keeps, in
three modules of its own package) trains on every worker of a multi-worker pod with only `--task mypkg.tasks:TASK`,
reading its class centres from a data folder shipped with SHIP, stops with `make tpu-stop` and resumes; the same
package outside the source folder is refused by `make tpu-doctor` and `make tpu-pod` before anything is created."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from deploy.tpu.config import DEFAULT_SHIP
from tests.launching import explain, wait_for
from tests.records import check_lines, summary
from tests.tpu.harness import ROOT, ZONE, Cloud

USER_PACKAGE = Path(__file__).with_name("user_package") / "mypkg"
TASK = "mypkg.tasks:TASK"
MODULES = ("mypkg/__init__.py", "mypkg/model.py", "mypkg/data.py", "mypkg/tasks.py")  # the package, whole


@pytest.fixture
def fork(tmp_path: Path) -> Path:
    """A user's checkout: the template's shipped paths, copied, and their own package mypkg/ beside job/."""
    root, shipped = tmp_path / "fork", set(DEFAULT_SHIP)
    shutil.copytree(ROOT, root, ignore=lambda folder, names: [
        name for name in names if name == "__pycache__" or (Path(folder) == ROOT and name not in shipped)])
    shutil.copytree(USER_PACKAGE, root / "mypkg")
    return root


def make(cloud: Cloud, where: Path, target: str, *, env: dict[str, str] | None = None,
         **variables: str) -> subprocess.CompletedProcess[str]:
    """`make TARGET` run from the folder `where` (the fork's checkout, the user's working directory)."""
    return subprocess.run(cloud.make_argv(target, **variables), cwd=where, env=env or cloud.env(),
                          capture_output=True, text=True, timeout=300)


def task_args(run_dir: Path, steps: int, *more: str) -> str:
    return (f"train --task {TASK} --run-dir {shlex.quote(str(run_dir))} --steps {steps} --ckpt.every 5 "
            f"--log-every 5 --eval-every {steps} {shlex.join(more)}").rstrip()


@pytest.mark.slow
def test_a_users_package_trains_on_every_worker_stops_and_resumes(cloud: Cloud, fork: Path, tmp_path: Path) -> None:
    run_dir, centres = tmp_path / "run", ("--data.centres", "data/centres.json")  # relative: the workers' copy
    (fork / "data").mkdir()
    (fork / "data" / "centres.json").write_text(json.dumps([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]]))
    slice_ = {"TPU_NAME": "pod-u", "ZONE": ZONE, "ACCELERATOR": "v4-16", "SHIP": "data",
              "ARGS": task_args(run_dir, 2000, *centres)}
    doctor = make(cloud, fork, "tpu-doctor", **slice_)
    assert doctor.returncode == 0, explain(doctor)
    assert check_lines(doctor.stdout)["code"] == (
        "ok    code: ships job, deploy, pyproject.toml, requirements.lock, README.md, data (SHIP), "
        "mypkg (--task mypkg.tasks:TASK) to every worker")
    first = subprocess.Popen(cloud.make_argv("tpu-pod", **slice_), cwd=fork, env=cloud.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(run_dir / "checkpoints" / "5", timeout_s=300, proc=first)
        stop = make(cloud, fork, "tpu-stop", **slice_)
        assert stop.returncode == 0, explain(stop)
        out, err = first.communicate(timeout=180)
    finally:
        first.kill()
    assert re.search(r"the job was stopped by `tpu-stop` \(exit code (75|134)\): not restarting it", err), \
        f"exit {first.returncode}\n{out}\n{err}"
    assert "shipping job, deploy, pyproject.toml, requirements.lock, README.md, data, mypkg (" in err
    with tarfile.open(cloud.local / "pod-u" / "code.tar.gz") as tar:
        assert {*MODULES, "data/centres.json"} <= set(tar.getnames())
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())

    again = make(cloud, fork, "tpu-pod", **{**slice_, "ARGS": task_args(run_dir, saved + 5, *centres)})
    assert again.returncode == 0, explain(again)
    assert f"resumed from step {saved}" in again.stdout, explain(again)
    done = summary(run_dir)
    assert (done["completed"], done["final_step"], done["task"]) == (True, saved + 5, "clusters"), done
    assert done["eval_accuracy"] is not None and done["parameters"] == 4 * 32 + 32 + 32 * 3 + 3, done
    for worker in (0, 1):  # every worker unpacked the user's package, imported it from there and joined the cluster
        code = cloud.home("pod-u", worker) / "jax-cluster-job"
        assert all((code / name).read_bytes() == (fork / name).read_bytes()
                   for name in (*MODULES, "data/centres.json")), worker
        log = (cloud.local / "pod-u" / "logs" / f"worker-{worker}.log").read_text()
        assert "No module named" not in log and re.search(rf"process {worker} of 2 \(tpu\)", log), log
    assert [" ".join(c[2:4]) for c in cloud.calls()].count("tpu-vm create") == 1


def test_a_package_outside_the_source_folder_fails_the_doctor_and_the_pod_before_anything_is_created(
        cloud: Cloud, fork: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(fork / "mypkg", elsewhere / "mypkg")
    env = cloud.env(PYTHONPATH=str(elsewhere))  # importable here: the task imports, the run's check passes
    slice_ = {"TPU_NAME": "pod-v", "ZONE": ZONE, "ACCELERATOR": "v4-16", "ARGS": task_args(Path("/mnt/b/run"), 10)}
    doctor = make(cloud, fork, "tpu-doctor", env=env, **slice_)
    assert doctor.returncode == 2 and "1 check(s) failed" in doctor.stdout, explain(doctor)  # make's 2 for a failure
    found = check_lines(doctor.stdout)
    assert found["run"].startswith("ok    run: task mypkg.tasks:TASK: global batch 16 splits over 8 devices")
    assert found["code"].startswith(f"FAIL  code: ARGS --task {TASK}: expected its top-level package mypkg at the "
                                    f"top of the source folder {fork}"), found["code"]
    assert f"found 'mypkg at {elsewhere / 'mypkg'}'. Fix: move (or copy) mypkg to {fork / 'mypkg'}" in found["code"]
    pod = make(cloud, fork, "tpu-pod", env=env, **slice_)
    assert pod.returncode == 2 and f"error: ARGS --task {TASK}: expected its top-level package" in pod.stderr, \
        explain(pod)
    assert not any(verb in c for c in cloud.calls() for verb in ("create", "scp", "ssh"))
