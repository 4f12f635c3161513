"""The scripts that run on the workers, run here with bash and a stand-in `python3`.

The stand-in records its argv (NUL-separated), so these tests see exactly
what the job would receive; `sudo` and `fuser` are stand-ins too, so nothing
on this machine is ever killed for holding a device.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.tpu import remote as tpu_remote
from deploy.tpu.config import TpuConfig
from tests.launching import wait_for
from tests.tpu.harness import ROOT

HOSTILE = ("train", "--name", "a b; touch {pwned} $(touch {pwned}) `touch {pwned}`", "it's \"q\" \\ $HOME *",
           "", "--x=;|&<>")
PYTHON_STUB = """#!/bin/bash
printf '%s\\0' "$@" >"$HOME/argv.bin"
trap 'echo "saved at TERM"; exit 75' TERM
echo "job started"
if [ -n "$STUB_RUN_FOREVER" ]; then while :; do sleep 0.05; done; fi
exit "${STUB_EXIT:-0}"
"""


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Path]:
    """A worker's home with the code folder and stand-in programs first on PATH. Whatever job a test left
    running there (a test that failed before it stopped its job) is killed with its process group after it."""
    home = tmp_path / "home"
    (home / "jax-cluster-job").mkdir(parents=True)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in {"python3": PYTHON_STUB, "fuser": "#!/bin/sh\nexit 1\n",
                       "sudo": '#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n'}.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    yield home
    pid_file = home.joinpath(*LOGS, "job.pid")
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def ssh_session() -> None:
    """What an ssh session's shell starts with: SIGHUP at its default (a suite run under nohup ignores it, and
    an ignored signal stays ignored in every child, so the dropped connection would not end the session)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def env(home: Path, worker_id: int = 0, **extra: str) -> dict[str, str]:
    return {"HOME": str(home), "PATH": f"{home.parent / 'bin'}:/usr/bin:/bin", "TPU_WORKER_ID": str(worker_id),
            **extra}


def config(**changes: object) -> TpuConfig:
    base = {"name": "pod-1", "zone": "us-central2-b", "accelerator": "v4-8", "source_dir": str(ROOT),
            "job_args": ("train",)}
    return TpuConfig(**{**base, **changes})  # type: ignore[arg-type]


def bash(script: str, home: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], cwd=home, capture_output=True, text=True, timeout=60,
                          **kwargs)  # type: ignore[call-overload]


def received(home: Path) -> list[str]:
    return (home / "argv.bin").read_bytes().decode().split("\0")[:-1]


LOGS = ("jax-cluster-job", "logs")


def test_every_argument_reaches_the_job_verbatim_and_none_runs_as_shell(worker: Path, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    args = tuple(a.format(pwned=pwned) for a in HOSTILE)
    cfg = config(job_args=args)
    start = bash(tpu_remote.start_script(cfg), worker, env=env(worker, STUB_EXIT="3"))
    assert start.returncode == 0 and start.stdout == "", start.stderr  # started, detached: returns at once
    follow = bash(tpu_remote.follow_script(cfg), worker, env=env(worker))
    assert follow.returncode == 3, follow.stderr  # the job's status is the follower's
    assert received(worker) == ["-m", "job", *args]
    assert not pwned.exists()
    assert "job started" in follow.stdout  # worker 0's log streams ...
    assert worker.joinpath(*LOGS, "job.log").read_text() == "job started\n"  # ... and stays on the worker
    assert worker.joinpath(*LOGS, "job.exit").read_text() == "3\n"
    assert bash(tpu_remote.probe_script(cfg), worker, env=env(worker)).stdout == "ended 3\n"


def test_the_job_outlives_its_ssh_session_and_is_followed_again(worker: Path) -> None:
    cfg = config()
    session = subprocess.Popen(["bash", "-c", tpu_remote.start_script(cfg) + "\nsleep 60"], cwd=worker,
                               env=env(worker, STUB_RUN_FOREVER="1"), start_new_session=True, preexec_fn=ssh_session)
    log = wait_for(worker.joinpath(*LOGS, "job.log"), "job started")
    os.killpg(session.pid, signal.SIGHUP)  # the connection drops: its session's processes get SIGHUP
    assert session.wait(timeout=10) == -signal.SIGHUP
    pid = int(worker.joinpath(*LOGS, "job.pid").read_text())
    os.kill(pid, 0)  # the job goes on
    assert bash(tpu_remote.probe_script(cfg), worker, env=env(worker)).stdout == "running\n"
    follower = subprocess.Popen(["bash", "-c", tpu_remote.follow_script(cfg, "20")], cwd=worker, env=env(worker),
                                stdout=subprocess.PIPE, text=True)
    assert bash(tpu_remote.stop_script(config(stop_grace_s=20)), worker, env=env(worker)).returncode == 0
    out, _ = follower.communicate(timeout=30)
    assert follower.returncode == 75 and log in out and "saved at TERM" in out  # TERM: saved, exit 75
    assert bash(tpu_remote.probe_script(cfg), worker, env=env(worker)).stdout == "ended 75 stopped\n"


def test_other_workers_only_keep_their_log(worker: Path) -> None:
    proc = bash(tpu_remote.start_script(config()), worker, env=env(worker, worker_id=2))
    assert proc.returncode == 0 and proc.stdout == ""
    wait_for(worker.joinpath(*LOGS, "job.exit"), "0")
    assert worker.joinpath(*LOGS, "job.log").read_text() == "job started\n"


def test_following_a_job_that_vanished_without_an_exit_code_fails(worker: Path) -> None:
    cfg = config()
    assert bash(tpu_remote.start_script(cfg), worker, env=env(worker, STUB_RUN_FOREVER="1")).returncode == 0
    wait_for(worker.joinpath(*LOGS, "job.log"), "job started")
    os.killpg(int(worker.joinpath(*LOGS, "job.pid").read_text()), signal.SIGKILL)  # as a VM restart would
    follow = bash(tpu_remote.follow_script(cfg), worker, env=env(worker))
    assert follow.returncode == tpu_remote.GONE_EXIT and "left no exit code" in follow.stderr
    assert bash(tpu_remote.follow_script(config(remote_dir="never-ran")), worker, env=env(worker)).returncode == \
        tpu_remote.NO_JOB_EXIT


def test_stop_sends_term_so_the_job_saves_and_exits_with_the_requeue_code(worker: Path) -> None:
    cfg = config(stop_grace_s=20)
    assert bash(tpu_remote.start_script(cfg), worker, env=env(worker, STUB_RUN_FOREVER="1")).returncode == 0
    log = worker.joinpath(*LOGS, "job.log")
    wait_for(log, "job started")
    stop = bash(tpu_remote.stop_script(cfg), worker, env=env(worker))
    assert stop.returncode == 0, stop.stderr
    assert wait_for(worker.joinpath(*LOGS, "job.exit"), "\n") == "75\n"
    assert "saved at TERM" in log.read_text()


def test_a_stale_job_is_killed_before_the_new_one_starts_but_nothing_else(worker: Path) -> None:
    logs = worker.joinpath(*LOGS)
    logs.mkdir()
    stale = subprocess.Popen(["bash", "-c", "sleep 60; true", "-m", "job"])  # its command line says "-m job"
    other = subprocess.Popen(["sleep", "60"])
    try:
        (logs / "job.pid").write_text(f"{stale.pid}\n")
        assert bash(tpu_remote.start_script(config()), worker, env=env(worker)).returncode == 0
        assert stale.wait(timeout=10) == -signal.SIGKILL
        wait_for(logs / "job.exit", "0")
        (logs / "job.pid").write_text(f"{other.pid}\n")  # a reused pid: not ours, left alone
        assert bash(tpu_remote.start_script(config()), worker, env=env(worker)).returncode == 0
        assert other.poll() is None
        wait_for(logs / "job.exit", "0")
    finally:
        for proc in (stale, other):
            proc.kill()
            proc.wait()


def test_multislice_variables_reach_the_job_and_images_get_them_as_flags(worker: Path) -> None:
    megascale = {"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080", "MEGASCALE_NUM_SLICES": "2",
                 "MEGASCALE_SLICE_ID": "1", "MEGASCALE_PORT": "8080"}
    stub = worker.parent / "bin" / "python3"
    stub.write_text(stub.read_text().replace('echo "job started"', 'env | grep ^MEGASCALE_ | sort; echo "job started"'))
    assert bash(tpu_remote.start_script(config(), megascale), worker, env=env(worker)).returncode == 0
    log = wait_for(worker.joinpath(*LOGS, "job.log"), "job started")
    assert log.splitlines()[:4] == sorted(f"{k}={v}" for k, v in megascale.items())
    image = tpu_remote.job_command(config(image="us-docker.pkg.dev/p/r/job:1"), env=megascale)
    assert "--env=MEGASCALE_SLICE_ID=1" in shlex.split(image.replace("$", ""))


def test_setup_unpacks_the_code_replacing_what_was_shipped_before(worker: Path, tmp_path: Path) -> None:
    import tarfile

    code = worker / "jax-cluster-job"
    (code / "job").mkdir()
    (code / "job" / "removed_module.py").write_text("")
    (code / "runs").mkdir()
    source = tmp_path / "src"
    (source / "job").mkdir(parents=True)
    (source / "job" / "new.py").write_text("x = 1\n")
    with tarfile.open(worker / "jax-cluster-job.tar.gz", "w:gz") as tar:
        tar.add(source / "job", arcname="job")
    cfg = config(ship=("job",), source_dir=str(source), setup="echo setup ran in $(basename $PWD)")
    proc = bash(tpu_remote.setup_script(cfg), worker, env=env(worker))
    assert proc.returncode == 0, proc.stderr
    assert "setup ran in jax-cluster-job" in proc.stdout
    assert sorted(p.name for p in (code / "job").iterdir()) == ["new.py"]
    assert (code / "runs").is_dir()  # run folders and logs survive a new shipment


def test_only_google_registries_get_a_docker_login() -> None:
    assert tpu_remote.registry_host("us-docker.pkg.dev/p/r/job:1") == "us-docker.pkg.dev"
    assert tpu_remote.registry_host("europe-west4-docker.pkg.dev/p/r/job") == "europe-west4-docker.pkg.dev"
    assert tpu_remote.registry_host("gcr.io/p/job") == "gcr.io" and tpu_remote.registry_host("eu.gcr.io/p/j") == "eu.gcr.io"
    for other in ("docker.io/library/python:3.11", "localhost/job:cpu", "job:1", "ghcr.io/o/job"):
        assert tpu_remote.registry_host(other) is None
    assert "configure-docker" not in tpu_remote.setup_script(config(image="localhost/job:cpu"))


def test_a_failing_setup_stops_at_the_first_error(worker: Path) -> None:
    proc = bash(tpu_remote.setup_script(config(setup="false\necho after")), worker, env=env(worker))
    assert proc.returncode != 0 and "after" not in proc.stdout


def test_scripts_are_bash_syntax_clean() -> None:
    for cfg in (config(), config(image="us-docker.pkg.dev/p/r/job:1", job_args=("train", "--run-dir", "/a/b"))):
        scripts = (tpu_remote.setup_script(cfg), tpu_remote.start_script(cfg, {"MEGASCALE_SLICE_ID": "0"}),
                   tpu_remote.follow_script(cfg), tpu_remote.probe_script(cfg), tpu_remote.stop_script(cfg),
                   tpu_remote.check_run_dir_script(cfg, "gs://b/r"))
        for script in scripts:
            assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0
    assert os.access(ROOT / "tests" / "tpu" / "fake_gcloud" / "gcloud", os.X_OK)
