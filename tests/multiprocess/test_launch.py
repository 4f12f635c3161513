"""`python -m job.launch`: bad input, output, fail-fast, signals. Real processes."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launching import ROOT, child_env, explain, launcher_argv, rank_pids, run, scenario, wait_for_line

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0"], "argument -n/--nproc: expected a whole number >= 1, found '0'"),
        (["-n", "abc"], "argument -n/--nproc: expected a whole number >= 1, found 'abc'"),
        (["-n", "2", "--devices-per-process", "-1"], "expected a whole number >= 1, found '-1'"),
        (["-n", "2", "--port", "70000"], "expected a TCP port 1..65535, found '70000'"),
        (["-n", "2", "--"], "expected a command after '--', found none"),
        (["-n", "2"], "expected a command after '--', found none"),
        (["-n", "2", "--", "no-such-program-xyz"], "found 'no-such-program-xyz' (not on PATH)"),
    ],
)
def test_bad_input_is_one_clear_error_and_starts_nothing(args: list[str], message: str, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    if "--" in args:
        argv = [sys.executable, "-m", "job.launch", *args] if args[-1] != "--" else [sys.executable, "-m", "job.launch", *args]
    else:
        argv = [sys.executable, "-m", "job.launch", *args]
    if args == ["-n", "2", "--devices-per-process", "-1"] or args[:2] == ["-n", "0"] or args[:2] == ["-n", "abc"]:
        argv += ["--", *command]
    if "--port" in args:
        argv += ["--", *command]
    proc = run(argv, timeout=30)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert "usage: python -m job.launch" in proc.stderr
    assert not marker.exists()


def test_output_is_prefixed_per_rank_and_gloo_noise_dropped() -> None:
    code = "import job, jax; job.initialize(); print('devices', jax.local_device_count(), jax.device_count())"
    proc = run(launcher_argv(3, [sys.executable, "-c", code]), timeout=120)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    for rank in range(3):
        assert f"[rank {rank}] devices 2 6\n" in proc.stdout
    assert "[Gloo]" not in proc.stdout + proc.stderr


def test_exit_code_of_the_first_failure_passes_through() -> None:
    proc = run(launcher_argv(4, scenario("hold.py", "exit", "3", "7")), timeout=120)  # the others hold forever
    assert proc.returncode == 7, explain(proc, proc.stdout, proc.stderr)
    assert "rank 3 exited with code 7; stopping the other 3 process(es)" in proc.stderr


def test_exception_in_one_rank_stops_all_with_its_traceback() -> None:
    proc = run(launcher_argv(4, scenario("hold.py", "raise", "1")), timeout=120)
    assert proc.returncode == 1, explain(proc, proc.stdout, proc.stderr)
    assert "[rank 1] RuntimeError: injected failure on rank 1" in proc.stderr
    assert "rank 1 exited with code 1" in proc.stderr


def _start_held(n: int, *extra: str, launcher: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], dict[int, int]]:
    proc = subprocess.Popen(
        launcher_argv(n, scenario("hold.py", *extra), extra=launcher), env=child_env(), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids: dict[int, int] = {}
    while len(pids) < n:
        line = wait_for_line(proc, "ready pid=", timeout=120)[-1]
        rank, pid = re.match(r"\[rank (\d+)\] ready pid=(\d+)", line).groups()  # type: ignore[union-attr]
        pids[int(rank)] = int(pid)
    return proc, pids


@pytest.mark.parametrize("victim", [0, 2])
def test_sigkill_of_one_rank_stops_the_job(victim: int) -> None:
    proc, pids = _start_held(4, "hold")
    killed = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - killed
    print(f"SIGKILL of rank {victim}: launcher exited {proc.returncode} after {elapsed:.2f} s")
    assert proc.returncode == 128 + signal.SIGKILL, explain(proc, out, err)
    assert f"rank {victim} was killed by SIGKILL (code 137)" in err
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_is_forwarded_to_every_rank_and_their_code_returned(tmp_path: Path) -> None:
    proc, pids = _start_held(4, "term", "-1", str(tmp_path))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 42, explain(proc, out, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"term{r}" for r in range(4)]
    assert all((tmp_path / f"term{r}").read_text() == str(int(signal.SIGTERM)) for r in range(4))


def test_coordinator_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = run(launcher_argv(2, scenario("hold.py", "hold"), extra=("--port", str(port))), timeout=120)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)  # a ConfigError: bad input, exit 2
    assert f"coordinator port: expected port {port} free on this host (process 0), found 'in use" in proc.stderr
    assert "rank 0 exited with code 2" in proc.stderr


def _listening(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.append(getattr(ip, "ipv4_mapped", None) or ip)
    return found


def test_the_coordinator_listens_on_loopback_only() -> None:
    proc, pids = _start_held(2, "hold")
    try:
        # the environment the launcher gave rank 0's process (a warm child's own /proc file shows its parent's)
        environ = Path(f"/proc/{rank_pids(proc.pid)[0]}/environ").read_bytes().split(b"\0")
        address = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"JOB_LAUNCH_COORDINATOR="))
        port = int(address.rsplit(":", 1)[1])
        # every interface would show as 0.0.0.0 or ::
        assert _listening(port) == [ipaddress.ip_address("127.0.0.1")], (address, _listening(port))
    finally:
        _terminate_twice(proc)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _terminate_twice(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, then a second one: the launcher kills every rank at once (a SIGKILL would orphan them)."""
    proc.terminate()  # jax catches it as a preemption notice: hold.py runs on
    wait_for_line(proc, "forwarding SIGTERM", timeout=30, stderr=True)
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    return err


def test_a_second_sigterm_kills_every_rank_at_once() -> None:
    proc, pids = _start_held(2, "hold")
    err = _terminate_twice(proc)
    assert "second SIGTERM: killing every process now" in err, err
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_signal_the_program_ignores_is_followed_by_its_stacks_sigkill_and_a_hint() -> None:
    proc, pids = _start_held(2, "hold", launcher=("--stop-timeout", "3"))
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert "rank(s) 0, 1 still running 3 s after the signal; their stacks follow, then they are killed" in err, err
    assert "preemption notice" in err and "a second SIGTERM or SIGINT kills at once" in err
    for rank in (0, 1):  # where each one was, from the process itself (job.initialize set up STACKS_SIGNAL)
        assert re.search(rf"\[rank {rank}\]\s+File \".*hold\.py\", line \d+", err), err
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
