"""The tests' warm start (tests/site/warmstart.py): a process handed to a warm child runs as it would cold.

Each test starts real processes through sitecustomize.py, as every process the suite launches starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launching import ROOT

SITE = ROOT / "tests" / "site"
PROBE = textwrap.dedent("""\
    import json, os, signal, sys, time
    warm = "jax" in sys.modules  # imported before this line only in a warm child
    mode = sys.argv[1]
    if mode == "report":
        import jax
        print(json.dumps({"warm": warm, "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
                          "ppid": os.getppid(), "path0": sys.path[0], "mine": os.environ.get("MINE"),
                          "umask": os.umask(0), "devices": len(jax.devices()), "main": __name__,
                          "sigint": {signal.SIG_IGN: "ignored", signal.default_int_handler: "Python's"}.get(
                              signal.getsignal(signal.SIGINT), "other")}))
        print("to stderr", file=sys.stderr)
        sys.exit(int(sys.argv[2]))
    if mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), os._exit(7)))
        print(os.getpid(), flush=True)
        time.sleep(60)
    if mode == "die":
        os.kill(os.getpid(), signal.SIGUSR1)
    if mode == "sleep":
        print(os.getpid(), flush=True)
        time.sleep(60)
    if mode == "burn":
        end = time.process_time() + float(sys.argv[2])
        while time.process_time() < end:
            pass
""")


@pytest.fixture(scope="module")
def warm() -> Iterator[tuple[Path, Path]]:
    """A folder of warm parents (short: a socket's path has at most 107 bytes) and a probe script in a scenarios
    folder, with its parent started by a first, cold run."""
    folder = Path(tempfile.mkdtemp(prefix="warm-", dir=tempfile.gettempdir()))
    scenarios = folder / "tests" / "scenarios"
    scenarios.mkdir(parents=True)
    probe = scenarios / "probe.py"
    probe.write_text(PROBE)
    parents = folder / "parents"
    parents.mkdir()
    first = start(parents, probe, "report", "0")
    assert first.returncode == 0 and '"warm": false' in first.stdout, first.stderr
    deadline = time.monotonic() + 120
    while not any(parents.glob("*.sock")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(parents.glob("*.sock")), list(parents.iterdir())
    yield parents, probe
    shutil.rmtree(folder, ignore_errors=True)  # its parent ends within a second


def env_for(parents: Path, **extra: str) -> dict[str, str]:
    """The probe's environment: this process's, less pytest's, XLA's flags and coverage's (`make coverage`
    starts every process cold, measured: these processes must start warm to be what the tests look at)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS", "COVERAGE_", "COV_CORE_"))}
    env.update(JOB_TESTS_WARM=str(parents), PYTHONPATH=str(SITE), JAX_PLATFORMS="cpu", MINE="mine",
               XLA_FLAGS="--xla_force_host_platform_device_count=3")
    env.update(extra)
    return env


def start(parents: Path, probe: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(probe), *args], env=env_for(parents, **extra), capture_output=True,
                          text=True, cwd=probe.parent.parent, timeout=120)


def test_a_warm_child_runs_the_program_with_the_processs_argv_environment_folder_and_streams(warm) -> None:
    parents, probe = warm
    done = subprocess.run([sys.executable, str(probe), "report", "3"], env=env_for(parents), capture_output=True,
                          text=True, cwd=probe.parent.parent, timeout=120, preexec_fn=lambda: os.umask(0o027))
    assert done.returncode == 3, done.stderr
    import json

    seen = json.loads(done.stdout)
    assert seen["warm"] is True  # jax was imported before the script's first line
    assert seen["argv"] == [str(probe), "report", "3"] and seen["main"] == "__main__"
    assert seen["cwd"] == str(probe.parent.parent) and seen["path0"] == str(probe.parent)
    assert seen["mine"] == "mine" and seen["umask"] == 0o027
    assert seen["devices"] == 3  # XLA_FLAGS is the child's own: read when its backend starts
    assert seen["sigint"] == "Python's"
    assert done.stderr == "to stderr\n"


def test_a_program_started_cold_on_purpose_or_by_another_interpreter_import_set_runs_cold(warm) -> None:
    parents, probe = warm
    assert '"warm": false' in start(parents, probe, "report", "0", JOB_TESTS_WARM="").stdout
    before = set(parents.glob("*.sock"))
    # a variable read while jax is imported: another parent, started by this cold run
    assert '"warm": false' in start(parents, probe, "report", "0", JAX_ENABLE_X64="1").stdout
    deadline = time.monotonic() + 120
    while len(set(parents.glob("*.started"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(set(parents.glob("*.started"))) == 2 and before <= set(parents.glob("*.sock"))


def started(parents: Path, probe: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    """The probe in `mode`, running: its process and the pid its program reports (a warm child's own)."""
    proc = subprocess.Popen([sys.executable, str(probe), mode], env=env_for(parents), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=probe.parent)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_signal_to_the_process_reaches_the_child_and_the_process_exits_as_it_did(warm) -> None:
    proc, child = started(*warm, "term")
    assert child != proc.pid  # the program runs in a warm child
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7 and "got SIGTERM" in out


def test_a_child_killed_by_a_signal_kills_its_process_with_the_same_signal(warm) -> None:
    parents, probe = warm
    assert start(parents, probe, "die").returncode == -signal.SIGUSR1
    proc, child = started(parents, probe, "sleep")
    os.kill(child, signal.SIGKILL)  # the child itself, as a peer or the kernel would
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and out == "" and err == ""  # and the program never ran again


def test_sigkill_to_the_process_ends_its_child(warm) -> None:
    proc, child = started(*warm, "sleep")
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()


def test_an_ignored_signal_stays_ignored_in_the_child(warm) -> None:
    parents, probe = warm
    done = subprocess.run([sys.executable, str(probe), "report", "0"], env=env_for(parents), capture_output=True,
                          text=True, cwd=probe.parent, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert '"warm": true' in done.stdout and '"sigint": "ignored"' in done.stdout, done.stdout


def test_the_childs_cpu_is_on_its_parents_ledger(warm) -> None:
    parents, probe = warm

    def ledger() -> float:
        return sum(float(p.read_text()) for p in parents.glob("cpu-*"))

    before = ledger()
    assert start(parents, probe, "burn", "0.5").returncode == 0
    assert ledger() - before >= 0.5
