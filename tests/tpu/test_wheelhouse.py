"""WHEELHOUSE on a TPU slice (deploy/tpu/wheels.py): `make wheelhouse` fills a folder (a small lock here: the target
does the whole one), a worker's set-up installs from it with the network refused, and the folder is checked for
TPU VMs before any gcloud call."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import wheelhouse
from deploy.tpu import cli as tpu
from deploy.tpu import job as tpu_job
from deploy.tpu import remote, wheels
from deploy.tpu.config import TpuConfig
from job.errors import ConfigError
from tests.launching import explain
from tests.records import check_lines
from tests.tpu.harness import ROOT, ZONE, Cloud, makefile_flags
from tests.tpu.sim_runner import SimRunner
from tests.unit.test_wheelhouse import hand_made, made_folder

PYTHON = "{}.{}".format(*sys.version_info[:2])  # the interpreter under the tests' venv: the "VM"'s python3 here
SMALL_LOCK = "absl-py==2.5.1\n    # via a comment, as uv writes them\ncolorama==0.4.6 ; sys_platform == 'win32'\n" \
             "typing-extensions==4.15.0\n"
CLOSED = "http://127.0.0.1:9"  # nothing listens: a request through this proxy fails at once
NO_NETWORK = {"https_proxy": CLOSED, "http_proxy": CLOSED, "HTTPS_PROXY": CLOSED, "HTTP_PROXY": CLOSED,
              "PIP_INDEX_URL": f"{CLOSED}/simple", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": "/dev/null"}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make wheelhouse` of a small lock for this Python: the download is pip's, from the index pip is set up for."""
    where = tmp_path_factory.mktemp("wheels")
    (where / "small.lock").write_text(SMALL_LOCK)
    proc = subprocess.run(["make", "--no-print-directory", *makefile_flags(), "-o", f"{Path(sys.executable).parent}"
                           "/.installed", f"BIN={Path(sys.executable).parent}", "wheelhouse",
                           f"WHEELHOUSE={where / 'w'}", f"WHEEL_LOCK={where / 'small.lock'}", f"WHEEL_PYTHON={PYTHON}",
                           "WHEEL_PLATFORM=manylinux_2_28_x86_64"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "3 wheels, " in proc.stdout and f"for Python {PYTHON} on manylinux_2_28_x86_64" in proc.stdout
    return where / "w"


def test_make_wheelhouse_leaves_the_targets_pins_their_wheels_and_pip(small: Path) -> None:
    assert (small / wheelhouse.PINS).read_text() == "absl-py==2.5.1\ntyping-extensions==4.15.0\n"  # no colorama
    assert sorted(p.name.split("-")[0] for p in small.glob("*.whl")) == ["absl_py", "pip", "typing_extensions"]
    assert wheelhouse.problems(small) == []
    assert json.loads((small / wheelhouse.MANIFEST).read_text())["python"] == PYTHON


def worker_home(tmp_path: Path, folder: Path) -> tuple[TpuConfig, Path, dict[str, str]]:
    """A worker's home holding what tpu-run sends (the code's and the wheelhouse's archives), a PATH whose python3
    is this machine's bare interpreter (-S: no site-packages, so none of the job's dependencies), and no network."""
    cfg = TpuConfig(name="pod-w", zone=ZONE, source_dir=str(ROOT), local_dir=str(tmp_path / "local"),
                    wheelhouse=str(folder), job_args=("train",))
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(tpu_job.build_archive(cfg), home / f"{cfg.remote_dir}.tar.gz")
    shutil.copy(wheels.build_archive(cfg), home / wheels.remote_archive(cfg))
    bare = tmp_path / "vm-bin"
    bare.mkdir()
    (bare / "python3").write_text(f'#!/bin/sh\nexec {Path(sys.base_prefix) / "bin" / "python3"} -S "$@"\n')
    (bare / "python3").chmod(0o755)
    return cfg, home, {"PATH": f"{bare}:/usr/bin:/bin", "HOME": str(home), "TPU_WORKER_ID": "0", **NO_NETWORK}


@pytest.mark.slow
def test_a_worker_installs_from_the_wheelhouse_with_the_network_refused(small: Path, tmp_path: Path) -> None:
    cfg, home, env = worker_home(tmp_path, small)
    setup = subprocess.run(["bash", "-c", remote.setup_script(cfg)], cwd=home, env=env, capture_output=True,
                           text=True, timeout=300)
    assert setup.returncode == 0, f"{setup.stdout}\n{setup.stderr}"
    venv_python = home / cfg.remote_dir / ".venv" / "bin" / "python"
    check = subprocess.run([str(venv_python), "-c", "import absl, typing_extensions, pip; print(pip.__version__)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout.strip() == json.loads(
        (small / wheelhouse.MANIFEST).read_text())["pip"], check.stderr
    again = subprocess.run(["bash", "-c", remote.setup_script(cfg)], cwd=home, env=env, capture_output=True,
                           text=True, timeout=300)  # the next attempt's set-up: the venv is there, nothing to add
    assert again.returncode == 0, again.stderr


def test_a_worker_whose_python3_is_another_version_says_which_to_build(small: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(small, other)
    made = json.loads((other / wheelhouse.MANIFEST).read_text())
    (other / wheelhouse.MANIFEST).write_text(json.dumps({**made, "python": "3.11" if PYTHON != "3.11" else "3.12"}))
    cfg, home, env = worker_home(tmp_path, other)
    setup = subprocess.run(["bash", "-c", remote.setup_script(cfg)], cwd=home, env=env, capture_output=True,
                           text=True, timeout=120)
    assert setup.returncode == 1
    want = "3.11" if PYTHON != "3.11" else "3.12"
    assert setup.stderr.strip() == (
        f"worker 0: expected python3 to be Python {want} (the wheelhouse's), found Python {PYTHON}. Fix: make "
        f"wheelhouse FLAVOR=tpu WHEEL_PYTHON={PYTHON} (3.11 or newer), or a RUNTIME whose python3 is {want}")


def tpu_folder(tmp_path: Path) -> Path:
    """A wheelhouse as make wheelhouse FLAVOR=tpu leaves it (hand-made stand-ins for the wheels, libtpu's included)."""
    folder = made_folder(tmp_path / "tpu-wheels", ["tinyjob==1.0", "libtpu==0.0.50.1"], lock=tmp_path / "tpu.lock")
    hand_made(folder, "libtpu", "0.0.50.1")
    return folder


def test_run_sends_the_wheelhouse_and_the_set_up_installs_from_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = TpuConfig(name="pod-w", zone=ZONE, accelerator="v4-16", source_dir=str(ROOT), wheelhouse=str(tpu_folder(tmp_path)),
                    job_args=("train", "--run-dir", "/mnt/b/run"))
    runner = SimRunner(node="READY", accelerator="v4-16")
    assert tpu.dispatch("run", cfg, runner) == 0
    sent = [c for c in runner.calls if c[4] == "scp" and c[-1] == "--worker=all"]
    assert [c[5:7] for c in sent] == [["runs/tpu/pod-w/code.tar.gz", "pod-w:jax-cluster-job.tar.gz"],
                                      ["runs/tpu/pod-w/wheels.tar", "pod-w:jax-cluster-job-wheels.tar"]]
    setup = next(a for c in runner.calls for a in c if a.startswith("--command=set -e"))
    assert "tar -xf ../jax-cluster-job-wheels.tar -C .wheelhouse" in setup and remote.WHEELHOUSE_SETUP in setup
    assert not any(online in setup for online in ("uv venv", "uv pip", "pip install --quiet --user"))  # no index


@pytest.mark.parametrize(("change", "says"), [
    ("no libtpu", "expected wheels for TPU VMs: x86_64, with libtpu"),
    ("aarch64", "expected wheels for TPU VMs: x86_64, with libtpu"),
    ("a missing wheel", "expected a folder made by make wheelhouse, every pin's wheel in it, found"),
    ("with an image", "expected WHEELHOUSE or IMAGE"),
])
def test_a_wheelhouse_tpu_vms_cannot_use_is_refused_before_any_gcloud_call(tmp_path: Path, change: str,
                                                                           says: str) -> None:
    folder = tpu_folder(tmp_path)
    cfg = TpuConfig(name="pod-w", zone=ZONE, source_dir=str(ROOT), wheelhouse=str(folder), job_args=("train",))
    made = json.loads((folder / wheelhouse.MANIFEST).read_text())
    if change == "no libtpu":
        (folder / wheelhouse.PINS).write_text("tinyjob==1.0\n")
    elif change == "aarch64":
        (folder / wheelhouse.MANIFEST).write_text(json.dumps({**made, "platform": "manylinux_2_28_aarch64"}))
    elif change == "a missing wheel":
        (folder / "libtpu-0.0.50.1-py3-none-any.whl").unlink()
    else:
        cfg = dataclasses.replace(cfg, image="registry.example.com/job:1")
    runner = SimRunner()
    with pytest.raises(ConfigError, match=says):
        tpu.dispatch("run", cfg, runner)
    assert runner.calls == []


def test_the_doctor_says_what_the_wheelhouse_is_for(cloud: Cloud, tmp_path: Path) -> None:
    folder = tpu_folder(tmp_path)
    ok = cloud.make("tpu-doctor", TPU_NAME="pod-w", ZONE=ZONE, ACCELERATOR="v4-8", WHEELHOUSE=str(folder), ARGS="train")
    assert check_lines(ok.stdout)["wheelhouse"] == (
        f"ok    wheelhouse: {folder}: Python 3.12 on manylinux_2_35_x86_64, 2 pins of {tmp_path / 'tpu.lock'}, 0 MiB; "
        "every worker installs from it with no index (its python3 must be that version)"), explain(ok)
    (folder / wheelhouse.PINS).write_text("tinyjob==1.0\n")
    bad = cloud.make("tpu-doctor", TPU_NAME="pod-w", ZONE=ZONE, ACCELERATOR="v4-8", WHEELHOUSE=str(folder),
                     ARGS="train")
    assert check_lines(bad.stdout)["wheelhouse"].startswith("FAIL  wheelhouse: WHEELHOUSE (--wheelhouse): expected "
                                                            "wheels for TPU VMs: x86_64, with libtpu"), explain(bad)
