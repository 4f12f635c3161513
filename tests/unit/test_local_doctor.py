"""`make doctor WHERE=local` (deploy/local_doctor.py): each check of the local launcher's run, against a machine the
test describes (cores, memory) and this machine's sockets and /dev/shm."""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import local_doctor
from deploy.local_doctor import Machine
from tests.doubles import RecordingRunner
from tests.records import check_lines

ROOMY = Machine(cores=16, available=64 << 30)


def run_local_doctor(argv: list[str], capsys: pytest.CaptureFixture[str], *, machine: Machine = ROOMY,
                     runner: RecordingRunner | None = None) -> tuple[int, dict[str, str]]:
    """The local doctor's exit code and each check's line by its name."""
    runner = runner or RecordingRunner(responses={(sys.executable,): (0, "3.11.7 0.10.2 /repo/job/__init__.py\n")})
    code = local_doctor.main(argv, runner=runner, machine=machine)
    return code, check_lines(capsys.readouterr().out)


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # as make doctor runs it: no GPU is handed out


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_the_default_request_passes_on_a_roomy_machine(cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(responses={(sys.executable,): (0, "3.11.7 0.10.2 /repo/job/__init__.py\n")})
    code, lines = run_local_doctor(["-n", "4", "--devices-per-process", "2"], capsys, runner=runner)
    assert code == 0, lines
    assert list(lines) == ["coordinator port", "/dev/shm", "cores", "memory", "venv"]
    assert lines["cores"] == "ok    cores: 4 processes x 2 CPU device(s) on 16 usable core(s)"
    assert lines["venv"] == f"ok    venv: {sys.executable}: Python 3.11.7, jax 0.10.2, job from /repo/job/__init__.py"
    assert runner.calls == [[sys.executable, "-c", local_doctor.VENV_PROBE]]


def test_a_coordinator_port_already_taken_is_one_line(cpu_only: None, held_port: int,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--port", str(held_port)], capsys)
    assert code == 1
    assert lines["coordinator port"] == (
        f"FAIL  coordinator port: --port {held_port} on 127.0.0.1: {os.strerror(errno.EADDRINUSE)} (another program "
        "holds it: process 0 would crash at its start). Fix: leave --port out (the launcher picks a free one), or "
        "another --port")


def test_a_host_that_is_not_this_machine_is_one_line(cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    # TEST-NET-1: never an address of this machine
    code, lines = run_local_doctor(["-n", "2", "--host", "192.0.2.1"], capsys)
    assert code == 1 and "FAIL  coordinator port: --host 192.0.2.1: cannot listen there" in lines["coordinator port"]


def test_more_processes_than_the_cores_carry_is_one_line(cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "17", "--devices-per-process", "1"], capsys,
                                   machine=Machine(cores=2, available=64 << 30))
    assert code == 1
    assert lines["cores"].startswith("FAIL  cores: 17 processes x 1 CPU device(s) on 2 usable core(s): over 8 "
                                     "processes per core")
    assert lines["cores"].endswith("Fix: NPROC=16 or fewer (-n 16)")
    code, lines = run_local_doctor(["-n", "16", "--devices-per-process", "2"], capsys,
                                   machine=Machine(cores=2, available=64 << 30))
    assert lines["cores"] == ("ok    cores: 16 processes x 2 CPU device(s) on 2 usable core(s) (16.0 devices per "
                              "core: slower than one each, works)")


def test_too_little_memory_for_the_processes_is_one_line(cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "8"], capsys, machine=Machine(cores=16, available=1 << 30))
    assert code == 1
    assert lines["memory"] == ("FAIL  memory: 1.0 GiB available, under the 2.3 GiB that 8 processes of jax need before "
                               "the model (about 300 MiB each). Fix: NPROC=3 or fewer, or free memory")


def test_no_shared_memory_folder_is_one_line(cpu_only: None, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    machine = Machine(cores=16, available=64 << 30, shm=tmp_path / "none")
    code, lines = run_local_doctor(["-n", "2"], capsys, machine=machine)
    assert code == 1 and lines[str(tmp_path / "none")].startswith(f"FAIL  {tmp_path / 'none'}: ")
    assert "Fix: mount it" in lines[str(tmp_path / "none")]


def test_gpus_need_a_gigabyte_of_shared_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")

    class Small:  # docker's default /dev/shm: 64 MiB
        f_blocks = f_bavail = 16384
        f_frsize = 4096

    monkeypatch.setattr(local_doctor.os, "statvfs", lambda _path: Small)
    code, lines = run_local_doctor(["-n", "2"], capsys, machine=Machine(cores=16, available=64 << 30, shm=tmp_path))
    assert code == 1
    assert lines[str(tmp_path)] == (f"FAIL  {tmp_path}: 64 MiB, 64 MiB free: under the 1.0 GiB NCCL needs between the "
                                    "GPUs of 2 processes. Fix: docker run --shm-size=8g, or mount -o remount,size=8g "
                                    "/dev/shm")


def test_a_venv_without_jax_is_one_line(cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(responses={("/venv/bin/python",): (1, "")})
    code, lines = run_local_doctor(["-n", "2", "--python", "/venv/bin/python"], capsys, runner=runner)
    assert code == 1
    assert lines["venv"] == ("FAIL  venv: /venv/bin/python cannot `import job, jax` (exit 1: no message). Fix: make "
                             "venv (again: it installs requirements.lock and this checkout)")


def test_a_bad_process_count_is_refused_by_the_launchers_own_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        local_doctor.main(["-n", "0"], runner=RecordingRunner(), machine=ROOMY)
    assert stop.value.code == 2 and "-n/--nproc" in capsys.readouterr().err


def test_the_cgroup_cpu_quota_caps_the_cores(tmp_path: Path) -> None:
    (tmp_path / "self").write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")
    assert local_doctor.cgroup_cpus(tmp_path / "self", tmp_path) == 1.5
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert local_doctor.cgroup_cpus(tmp_path / "self", tmp_path) is None
    assert local_doctor.cgroup_cpus(tmp_path / "missing", tmp_path) is None


def test_this_machine_is_read() -> None:
    machine = local_doctor.here()
    assert machine.cores >= 1 and (machine.available is None or machine.available > 0)
