"""The scripts that run on the workers, run here with bash and a stand-in `python3`.

The stand-in records its argv (NUL-separated), so these tests see exactly
what the job would receive; `sudo` and `fuser` are stand-ins too, so nothing
on this machine is ever killed for holding a device.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from deploy import tpu_remote
from deploy.tpu_config import TpuConfig
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
def worker(tmp_path: Path) -> Path:
    """A worker's home with the code folder and stand-in programs first on PATH."""
    home = tmp_path / "home"
    (home / "jax-cluster-job").mkdir(parents=True)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in {"python3": PYTHON_STUB, "fuser": "#!/bin/sh\nexit 1\n",
                       "sudo": '#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n'}.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    return home


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


def test_every_argument_reaches_the_job_verbatim_and_none_runs_as_shell(worker: Path, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    args = tuple(a.format(pwned=pwned) for a in HOSTILE)
    proc = bash(tpu_remote.run_script(config(job_args=args)), worker, env=env(worker, STUB_EXIT="3"))
    assert proc.returncode == 3, proc.stderr  # the job's status is the script's
    assert received(worker) == ["-m", "job", *args]
    assert not pwned.exists()
    assert "job started" in proc.stdout  # worker 0 streams its log ...
    assert (worker / "jax-cluster-job" / "logs" / "job.log").read_text() == "job started\n"  # ... and keeps it
    assert not (worker / "jax-cluster-job" / "logs" / "job.pid").exists()


def test_other_workers_only_keep_their_log(worker: Path) -> None:
    proc = bash(tpu_remote.run_script(config()), worker, env=env(worker, worker_id=2))
    assert proc.returncode == 0 and proc.stdout == ""
    assert (worker / "jax-cluster-job" / "logs" / "job.log").read_text() == "job started\n"


def test_stop_sends_term_so_the_job_saves_and_exits_with_the_requeue_code(worker: Path) -> None:
    cfg = config(stop_grace_s=20)
    run = subprocess.Popen(["bash", "-c", tpu_remote.run_script(cfg)], cwd=worker,
                           env=env(worker, STUB_RUN_FOREVER="1"), stdout=subprocess.PIPE, text=True)
    log = worker / "jax-cluster-job" / "logs" / "job.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and "job started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop = bash(tpu_remote.stop_script(cfg), worker, env=env(worker))
    assert stop.returncode == 0, stop.stderr
    assert run.wait(timeout=30) == 75
    assert "saved at TERM" in log.read_text()
    assert not (worker / "jax-cluster-job" / "logs" / "job.pid").exists()


def test_a_stale_job_is_killed_before_the_new_one_starts_but_nothing_else(worker: Path) -> None:
    logs = worker / "jax-cluster-job" / "logs"
    logs.mkdir()
    stale = subprocess.Popen(["bash", "-c", "sleep 60; true", "-m", "job"])  # its command line says "-m job"
    other = subprocess.Popen(["sleep", "60"])
    try:
        (logs / "job.pid").write_text(f"{stale.pid}\n")
        assert bash(tpu_remote.run_script(config()), worker, env=env(worker)).returncode == 0
        assert stale.wait(timeout=10) == -signal.SIGKILL
        (logs / "job.pid").write_text(f"{other.pid}\n")  # a reused pid: not ours, left alone
        assert bash(tpu_remote.run_script(config()), worker, env=env(worker)).returncode == 0
        assert other.poll() is None
    finally:
        for proc in (stale, other):
            proc.kill()
            proc.wait()


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


def test_a_failing_setup_stops_at_the_first_error(worker: Path) -> None:
    proc = bash(tpu_remote.setup_script(config(setup="false\necho after")), worker, env=env(worker))
    assert proc.returncode != 0 and "after" not in proc.stdout


def test_scripts_are_bash_syntax_clean() -> None:
    for cfg in (config(), config(image="us-docker.pkg.dev/p/r/job:1")):
        for script in (tpu_remote.setup_script(cfg), tpu_remote.run_script(cfg), tpu_remote.stop_script(cfg)):
            assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0
    assert os.access(ROOT / "tests" / "tpu" / "fake_gcloud" / "gcloud", os.X_OK)
