"""What reaches the workers, decided on this machine (deploy/tpu/ship.py): every task's package with the template,
SHIP's paths, and one error naming the fix for a task whose module would not get there; with IMAGE, the image
looked into where this machine has it. In one process, against a source folder of the test's own."""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from deploy.tpu import cli as tpu
from deploy.tpu import job as tpu_job
from deploy.tpu import remote, ship
from deploy.tpu.config import DEFAULT_SHIP, TpuConfig
from job.errors import ConfigError
from tests.doubles import RecordingRunner
from tests.tpu.sim_runner import SimRunner

USER_PACKAGE = Path(__file__).with_name("user_package") / "mypkg"  # a user's package, as docs/training.md writes one
TASK = "mypkg.tasks:TASK"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A fork's checkout: the template's shipped paths (empty stand-ins) and the user's mypkg/ beside job/."""
    root = tmp_path / "fork"
    for path in DEFAULT_SHIP:
        (root / path).mkdir(parents=True) if "." not in path else (root / path).write_text("")
    (root / "job" / "__init__.py").write_text("")
    (root / "requirements.lock").write_text("absl-py==2.5.1\n")
    shutil.copytree(USER_PACKAGE, root / "mypkg")
    return root


def pod_request(source: Path, *args: str, **changes: object) -> TpuConfig:
    return TpuConfig(name="pod-1", zone="us-central2-b", accelerator="v4-16", source_dir=str(source),
                     job_args=("train", "--run-dir", "/mnt/bucket/run", *args), **changes)  # type: ignore[arg-type]


def test_the_tasks_package_in_the_checkout_ships_with_the_template_once(checkout: Path) -> None:
    cfg = ship.resolved(pod_request(checkout, "--task", TASK, "--task", TASK))
    assert cfg.ship == (*DEFAULT_SHIP, "mypkg")
    assert ship.resolved(cfg) == cfg  # resolving again changes nothing
    assert ship.describe(pod_request(checkout, "--task", TASK), RecordingRunner()) == (
        "ships job, deploy, pyproject.toml, requirements.lock, README.md, mypkg (--task mypkg.tasks:TASK) to every "
        "worker")


@pytest.mark.parametrize("task", [None, "lm", "job.tasks.lm.task:TASK", "classify"])
def test_the_templates_own_tasks_add_nothing(checkout: Path, task: str | None) -> None:
    cfg = pod_request(checkout, *(("--task", task) if task else ()))
    assert ship.resolved(cfg).ship == DEFAULT_SHIP


def test_a_single_module_task_and_ship_paths_are_shipped_in_order(checkout: Path) -> None:
    (checkout / "mytask.py").write_text((USER_PACKAGE / "tasks.py").read_text())
    (checkout / "data").mkdir()
    cfg = ship.resolved(pod_request(checkout, "--task", "mytask:TASK", also_ship=("data", "README.md")))
    assert cfg.ship == (*DEFAULT_SHIP, "data", "mytask.py") and cfg.also_ship == ()


def test_every_sweep_runs_task_package_is_shipped(checkout: Path) -> None:
    shutil.copytree(USER_PACKAGE, checkout / "otherpkg")
    cfg = pod_request(checkout, sweep=f"task={TASK},otherpkg.tasks:TASK seed=0,1")
    assert ship.task_specs(cfg) == (TASK, "otherpkg.tasks:TASK")
    assert ship.resolved(cfg).ship == (*DEFAULT_SHIP, "mypkg", "otherpkg")


def test_a_package_outside_the_source_folder_is_one_error_naming_where_it_is_and_the_fix(
        checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(checkout / "mypkg", elsewhere / "mypkg")
    monkeypatch.syspath_prepend(str(elsewhere))  # importable here, as through PYTHONPATH: the run's check passes
    with pytest.raises(ConfigError) as caught:
        ship.resolved(pod_request(checkout, "--task", TASK))
    message = str(caught.value)
    assert message.startswith(f"ARGS --task {TASK}: expected its top-level package mypkg at the top of the source "
                              f"folder {checkout}"), message
    assert f"found 'mypkg at {elsewhere / 'mypkg'}'" in message and f"Fix: move (or copy) mypkg to {checkout / 'mypkg'}" in message
    with pytest.raises(ConfigError, match="found 'nopkg neither in .* nor on the import path here'"):
        ship.resolved(pod_request(checkout, "--task", "nopkg.tasks:TASK"))


def test_a_module_the_archive_would_leave_out_is_one_error(checkout: Path, tmp_path: Path) -> None:
    (checkout / "mypkg" / "tasks.py").rename(checkout / "mypkg" / "id_rsa_tasks.py")
    with pytest.raises(ConfigError, match=r"found 'mypkg/id_rsa_tasks.py: its name says it may hold a secret"):
        ship.resolved(pod_request(checkout, "--task", "mypkg.id_rsa_tasks:TASK"))
    (checkout / "compiled.pyc").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"found 'compiled.pyc: compiled bytecode \(.pyc\), never shipped"):
        ship.resolved(pod_request(checkout, "--task", "compiled:TASK"))
    with pytest.raises(ConfigError, match=r"found 'mypkg: no file of mypkg.nothere in it'"):
        ship.resolved(pod_request(checkout, "--task", "mypkg.nothere:TASK"))
    (tmp_path / "linked").mkdir()
    (checkout / "linkpkg").symlink_to(tmp_path / "linked")
    (tmp_path / "linked" / "tasks.py").write_text("")
    with pytest.raises(ConfigError, match=r"found 'linkpkg/tasks.py: a symbolic link"):
        ship.resolved(pod_request(checkout, "--task", "linkpkg.tasks:TASK"))


def test_ship_paths_outside_or_missing_are_refused_before_any_gcloud_call(checkout: Path) -> None:
    runner = SimRunner()
    for paths, says in ((("../x",), "relative, without '..'"), (("nothere",), "paths that exist under")):
        with pytest.raises(ConfigError, match=rf"SHIP \(--also-ship\): expected .*{re.escape(says)}"):
            tpu.dispatch("run", pod_request(checkout, also_ship=paths), runner)
    assert runner.calls == []


def test_run_ships_the_package_in_the_archive_and_replaces_it_on_the_workers(
        checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (checkout / "mypkg" / "__pycache__").mkdir()
    (checkout / "mypkg" / "__pycache__" / "tasks.cpython-313.pyc").write_bytes(b"")
    runner = SimRunner(node="READY", accelerator="v4-16")
    assert tpu.dispatch("run", pod_request(checkout, "--task", TASK, local_dir=str(tmp_path / "local")), runner) == 0
    with tarfile.open(tmp_path / "local" / "pod-1" / tpu_job.ARCHIVE) as tar:
        names = tar.getnames()
    assert {"mypkg", "mypkg/__init__.py", "mypkg/tasks.py"} <= set(names) and not any("__pycache__" in n for n in names)
    setup = next(a for c in runner.calls for a in c if a.startswith("--command=set -e"))
    assert "rm -rf -- job deploy pyproject.toml requirements.lock README.md mypkg\n" in setup


# ---------------------------------------------------------------------------------------------------- IMAGE
IMAGE = "us-docker.pkg.dev/p/r/job:1"


def image_runner(*, inspect: int = 0, run: tuple[int, str] = (0, "")) -> RecordingRunner:
    return RecordingRunner(available=("docker",), responses={
        ("/usr/bin/docker", "image", "inspect"): (inspect, ""), ("/usr/bin/docker", "run"): run})


def test_with_an_image_nothing_is_shipped_and_the_image_is_looked_into_where_it_is_here(checkout: Path) -> None:
    cfg = pod_request(checkout, "--task", TASK, image=IMAGE)
    assert ship.resolved(cfg) == cfg and ship.image_modules(cfg) == ("mypkg",)
    runner = image_runner()
    assert ship.describe(cfg, runner) == f"IMAGE {IMAGE} holds mypkg (looked up in the image on this machine)"
    assert runner.calls[-1] == ["/usr/bin/docker", "run", "--rm", "--network=none", "--entrypoint", "python", IMAGE,
                                "-c", ship.FIND_IN_IMAGE, "mypkg"]
    with pytest.raises(ConfigError) as caught:
        ship.describe(cfg, image_runner(run=(ship.MISSING_IN_IMAGE, "mypkg\n")))
    assert f"found '{IMAGE} has no mypkg'. Fix: copy each into the image beside job/" in str(caught.value)


@pytest.mark.parametrize(("runner", "says"), [
    (RecordingRunner(), "not checked here (no docker or podman on this machine)"),
    (image_runner(inspect=1), "not checked here (not on this machine"),
    (image_runner(run=(125, "docker: Error response from daemon")), "not checked here (docker run exited 125: docker:"),
])
def test_an_image_this_machine_cannot_look_into_is_left_to_the_workers(checkout: Path, runner: RecordingRunner,
                                                                       says: str) -> None:
    line = ship.describe(pod_request(checkout, "--task", TASK, image=IMAGE), runner)
    assert says in line and line.endswith("every worker checks that it holds mypkg after its pull"), line


def test_the_workers_set_up_stops_when_the_pulled_image_lacks_the_package(checkout: Path, tmp_path: Path) -> None:
    image = "registry.example.com/job:1"  # not Google's: no registry login first
    script = remote.setup_script(pod_request(checkout, "--task", TASK, image=image))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\n[ "$1" = run ] || exit 0\necho "$@" >"$HOME/run.args"\n'
                                    'echo mypkg; exit 3\n')
    (bin_dir / "docker").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run(["bash", "-c", script], cwd=home, capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "TPU_WORKER_ID": "1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"worker 1: expected the image {image} to hold the tasks' packages mypkg (nothing "
                                  "is shipped with IMAGE), found it without mypkg. Fix: copy each"), proc.stderr
    assert (home / "run.args").read_text().startswith(f"run --rm --network=none --entrypoint python {image} -c ")
    assert "--task" not in remote.setup_script(pod_request(checkout, image=IMAGE))  # the template's tasks: nothing to look for
    assert "docker run" not in remote.setup_script(pod_request(checkout, image=IMAGE))


def test_the_archive_never_holds_secret_like_names_or_caches(checkout: Path, tmp_path: Path) -> None:
    for name in (".env", "key.pem", "__pycache__/x.pyc", "id_ed25519", "tasks.py"):
        (checkout / "mypkg" / name).parent.mkdir(exist_ok=True)
        (checkout / "mypkg" / name).write_text("x")
    cfg = ship.resolved(pod_request(checkout, "--task", TASK, local_dir=str(tmp_path / "l")))
    with tarfile.open(tpu_job.build_archive(cfg)) as tar:
        names = {n for n in tar.getnames() if n.startswith("mypkg/")}
    assert names == {f"mypkg/{module.name}" for module in USER_PACKAGE.glob("*.py")}
