"""Run programs under `python -m job.launch` from tests (the training job among them), with readable failures."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tests" / "scenarios"
TRAIN = [sys.executable, "-m", "job", "train"]


def launcher_argv(n: int, command: list[str], *, devices: int | None = 2, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "job.launch", "-n", str(n), *extra]
    if devices is not None:
        argv += ["--devices-per-process", str(devices)]
    return [*argv, "--", *command]


def scenario(name: str, *args: str) -> list[str]:
    return [sys.executable, str(SCENARIOS / name), *args]


# jax's persistent compilation cache, shared by every launched test process: the same small
# programs are compiled again and again otherwise (most of a short run's time on 2 cores).
COMPILATION_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"jax-job-tests-{os.getuid()}", "jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    # a size (far above the suite's ~20 MB) turns on jax's file lock around each entry's read and write: jax
    # writes an entry in place, and a process of another test reading it half-written warned "Error reading
    # persistent compilation cache entry ... truncated stream" (a failure of a test that reads its output whole)
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30),
}


def compilation_cache_env() -> dict[str, str]:
    """COMPILATION_CACHE's variables, each as this process's environment sets it where it does."""
    return {k: os.environ.get(k, v) for k, v in COMPILATION_CACHE.items()}


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank stopped with SIGABRT prints its Python stack (stop_with_stacks)
    env.update(compilation_cache_env())
    env.update(extra)
    return env


def explain(proc: subprocess.CompletedProcess[str] | subprocess.Popen[str], out: str | None = None,
            err: str | None = None) -> str:
    """A failure message: the exit code and all output (a finished run's own when out and err are not given)."""
    out = proc.stdout if out is None else out
    err = proc.stderr if err is None else err
    return f"exit code {proc.returncode}\n--- stdout (every rank) ---\n{out}\n--- stderr (every rank) ---\n{err}"


def run(argv: list[str], *, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
    """Run to completion; past `timeout`, fail with every rank's Python stack and all output so far."""
    proc = subprocess.Popen(
        argv, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_with_stacks(proc)
        raise AssertionError(
            f"{argv} did not finish within {timeout:g} s; its processes were stopped with SIGABRT, "
            f"so each prints its Python stack below\n{explain(proc, out, err)}"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def train(n: int, devices: int, run_dir: Path | str, *flags: str, expect: int | None = 0,
          **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m job train --run-dir RUN_DIR FLAGS` on n processes x devices; fails unless it exits `expect`
    (None: any non-zero code)."""
    proc = run(launcher_argv(n, [*TRAIN, "--run-dir", str(run_dir), *flags], devices=devices), timeout=300, **env)
    assert (proc.returncode != 0) if expect is None else (proc.returncode == expect), explain(proc)
    return proc


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stop_with_stacks(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Stop a stuck launcher's ranks with SIGABRT (faulthandler prints each one's stack); return its output.

    The ranks are stopped, not the launcher: the launcher relays their last words and exits, and
    no rank is orphaned (killing the launcher alone would leave its ranks running).
    """
    for pid in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        return proc.communicate()


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float, *, stderr: bool = False) -> list[str]:
    """Read proc's stdout (or stderr) until a line contains `needle`; return the lines read."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    stream = proc.stderr if stderr else proc.stdout
    assert stream is not None
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    out, err = stop_with_stacks(proc)
    got = "".join(lines) + out
    raise AssertionError(f"no line with {needle!r} within {timeout} s; got:\n{got}\n--- stderr ---\n{err}")


def wait_for(path: Path, text: str = "", *, timeout_s: float = 30, proc: subprocess.Popen[str] | None = None) -> str:
    """Wait until `path` exists (a file: holding `text`) while `proc`, if given, still runs; return the file's text."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = path.read_text() if path.is_file() else ""
        if path.exists() and text in held:
            return held
        assert proc is None or proc.poll() is None, f"the process ended ({proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} never held {text!r}: {held if path.exists() else 'missing'}"
        time.sleep(0.05)


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """The launcher's children by rank (read from /proc: their JOB_LAUNCH_PROCESS_ID)."""
    pids = {}
    for pid in _children(launcher_pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"JOB_LAUNCH_PROCESS_ID="))
        pids[rank] = pid
    return pids
