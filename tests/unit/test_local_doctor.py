"""`make doctor WHERE=local` (deploy/local/doctor.py): each check of the local launcher's run, against a machine the
test describes (cores, memory) and this machine's sockets and /dev/shm; ARGS' task, config and batch on its devices."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local import doctor as local_doctor
from deploy.local.doctor import Machine
from job.runtime import host
from tests.doubles import RecordingRunner
from tests.launching import ROOT, explain
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
    assert list(lines) == ["coordinator port", "/dev/shm", "cores", "memory", "venv", "run"]
    assert lines["cores"] == "ok    cores: 4 processes x 2 CPU device(s) on 16 usable core(s)"
    assert lines["run"] == ("skip  run: no ARGS given. To run it: ARGS='train ...' (its task, config and global "
                            "batch on 8 devices (NPROC=4 x DEVICES=2) are checked)")
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


def test_a_port_picked_free_but_taken_before_it_is_tried_is_picked_again(
        cpu_only: None, held_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # another program (a launcher beside this one) takes the port between the pick and the try: not a FAIL
    picks = iter([held_port, held_port])
    monkeypatch.setattr(local_doctor.launch, "coordinator_port", lambda port: next(picks, 0))
    code, lines = run_local_doctor(["-n", "2"], capsys)
    assert code == 0 and lines["coordinator port"] == ("ok    coordinator port: a free port on 127.0.0.1 (e.g. 0; the "
                                                       "launcher picks its own at the start)"), lines
    monkeypatch.setattr(local_doctor.launch, "coordinator_port", lambda port: held_port)  # taken every time
    code, lines = run_local_doctor(["-n", "2"], capsys)
    assert code == 1 and lines["coordinator port"] == (
        f"FAIL  coordinator port: each of {local_doctor.PORT_PICKS} ports picked free was taken before it could be "
        "tried. Fix: close programs that take ports, or pass --port with a port kept free for the launcher"), lines


def test_a_port_an_earlier_connection_left_in_time_wait_is_free_as_the_coordinator_binds_it() -> None:
    # an earlier run's coordinator, a gRPC server (SO_REUSEADDR), closed its side first: its port stays in
    # TIME_WAIT for a minute; portpicker, which binds the same way, calls it free
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()
            client.recv(1)
    assert local_doctor.port_problem("127.0.0.1", port) is None
    with socket.socket() as holder:  # one that listens on it is still found
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert local_doctor.port_problem("127.0.0.1", port) == os.strerror(errno.EADDRINUSE)


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
    assert host.cgroup_cpus(tmp_path / "self", tmp_path) == 1.5
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert host.cgroup_cpus(tmp_path / "self", tmp_path) is None
    assert host.cgroup_cpus(tmp_path / "missing", tmp_path) is None


def test_this_machine_is_read() -> None:
    machine = local_doctor.this_machine()
    assert machine.cores >= 1 and (machine.available is None or machine.available > 0)


# ---------------------------------------------------------------------------------------------------- the run
def test_a_task_that_does_not_import_is_the_runs_fail_line_with_the_fix(cpu_only: None,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--devices-per-process", "2", "--args",
                                    "train --task nosuch.mod:TASK --data.global-batch 30"], capsys)
    assert code == 1
    assert lines["run"] == ("FAIL  run: --task: expected an importable module nosuch.mod, found \"nosuch.mod:TASK (No "
                            "module named 'nosuch')\". Fix: pass --task PACKAGE.MODULE:ATTR with the module importable "
                            "(installed, or on PYTHONPATH)")
    assert [name for name, line in lines.items() if line.startswith("FAIL")] == ["run"]


def test_a_global_batch_that_does_not_split_over_nproc_x_devices_is_the_runs_fail_line(
        cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--devices-per-process", "2", "--args=train --data.global-batch 30"],
                                   capsys)
    assert code == 1
    assert lines["run"] == ("FAIL  run: --data.global-batch: expected a multiple of the data-parallel size 4 = 4, "
                            "found 30 on 4 devices (NPROC=2 x DEVICES=2). Fix: use --data.global-batch 32")


def test_args_that_fit_the_devices_pass_with_the_task_and_the_devices(cpu_only: None,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--devices-per-process", "4", "--args=train --model-axis 2"], capsys)
    assert code == 0, lines
    assert lines["run"] == "ok    run: task lm: global batch 32 splits over 8 devices (NPROC=2 x DEVICES=4)"


def test_a_mesh_axis_no_rule_maps_to_is_the_runs_fail_line_naming_the_nearest_axis(
        cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--devices-per-process", "2",
                                    "--args=train --mesh data=2,modle=2 --rule tensor"], capsys)
    assert code == 1
    assert lines["run"].startswith("FAIL  run: --mesh: expected axes that a rule maps a logical axis to: data, model, "
                                   "expert, sequence"), lines["run"]
    assert "found \"axis 'modle' in 'data=2,modle=2'\"" in lines["run"]
    assert lines["run"].endswith("Fix: did you mean 'model'? --mesh data=2,model=2")


def test_a_mesh_size_that_does_not_divide_the_devices_is_the_runs_fail_line_with_a_divisor(
        cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--devices-per-process", "2", "--args=train --mesh data=-1,model=3"],
                                   capsys)
    assert code == 1
    assert lines["run"].endswith("Fix: model=3 does not divide 4 devices; e.g. --mesh data=-1,model=2"), lines["run"]


def test_every_run_of_a_sweep_is_checked_against_the_devices(cpu_only: None, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["-n", "2", "--devices-per-process", "2", f"--args=train --run-dir {tmp_path / 'sweep'}"]
    code, lines = run_local_doctor([*argv, "--sweep=data.global-batch=32,30 seed=0"], capsys)
    assert code == 1
    assert lines["run"].startswith("FAIL  run: sweep run 'global-batch=30,seed=0': --data.global-batch: expected "
                                   "a multiple of the data-parallel size 4 = 4, found 30 on 4 devices")
    code, lines = run_local_doctor([*argv, "--sweep=seed=0,1"], capsys)
    assert lines["run"] == ("ok    run: 2 run(s) of SWEEP: each parses, validates and splits its global batch over 4 "
                            "devices (NPROC=2 x DEVICES=2)")
    assert not (tmp_path / "sweep").exists()  # checked, nothing written


def test_a_task_module_that_raises_as_it_is_imported_is_a_fail_line_not_a_crash(
        cpu_only: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "doctor_raising_task.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, lines = run_local_doctor(["-n", "2", "--args=train --task doctor_raising_task:TASK"], capsys)
    assert code == 1
    assert lines["run"] == (f"FAIL  run: checking ARGS raised RuntimeError: no GPU here (at "
                            f"{tmp_path / 'doctor_raising_task.py'}:1). Fix: correct the code there: every process of "
                            "the job would fail the same way at its start")


@pytest.mark.parametrize(("args", "line"), [
    ("eval --run-dir runs/a", "skip  run: ARGS runs `python -m job eval`, not train (only a training run's flags "
                              "are checked)"),
    ("--steps 5", "FAIL  run: ARGS: expected a command of python -m job first (train, eval, runs, ...), found "
                  "'--steps 5'. Fix: ARGS='train --steps 5'"),
])
def test_args_that_train_nothing_are_said_so(args: str, line: str, cpu_only: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert run_local_doctor(["-n", "2", f"--args={args}"], capsys)[1]["run"] == line


def test_check_run_0_leaves_the_run_unchecked_and_says_so(cpu_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_local_doctor(["-n", "2", "--args=train --task nosuch.mod:TASK", "--check-run=0"], capsys)
    assert code == 0 and lines["run"].startswith("skip  run: no ARGS given"), lines


def test_make_doctor_says_it_chose_local_and_checks_the_args_it_was_given(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS", "SWEEP", "TPU_NAME", "WHERE")}
    proc = subprocess.run([shutil.which("make") or "make", "--no-print-directory", "-o", f"{bin_dir}/.installed",
                           f"BIN={bin_dir}", "doctor", f"SLURM_ENV={tmp_path}/none", "NPROC=2", "DEVICES=2",
                           "ARGS=train --task nosuch.mod:TASK --data.global-batch 30"],
                          cwd=ROOT, env={**env, "PATH": str(tmp_path)},  # no sbatch, no TPU_NAME: local
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, explain(proc)
    first = proc.stdout.splitlines()[0]
    assert first == "make doctor: WHERE=local (no TPU_NAME, no sbatch on PATH; WHERE=slurm or WHERE=tpu to choose)"
    assert check_lines(proc.stdout)["run"].startswith("FAIL  run: --task: expected an importable module nosuch.mod"), \
        proc.stdout
