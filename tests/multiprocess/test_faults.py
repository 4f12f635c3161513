"""The fault-injection matrix: real processes, real training, one fault each.

Every case asserts that the whole job ends non-zero (a job that hangs runs
into the launch's timeout, and its killed launcher's code fails the case),
that the output names the cause and the rank, and that the next run resumes
from the newest complete checkpoint (so no checkpointed step is lost) and
takes its first step exactly as a run that never failed does (the loss it
logs, to the last bit; that a resumed run then ends bitwise equal is proven
once, in test_train). Each case records its time to exit; the session summary
prints the table (README: Reliability).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launching import ROOT, child_env, launcher_argv, rank_pids, scenario, train
from tests.records import train_losses

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

FAULT_STEP = 7  # the fault strikes when step 7 starts: steps 1-6 are done, 2, 4 (and maybe 6) saved
FLAGS = ("--steps", "12", "--ckpt.every", "2", "--ckpt.keep", "10", "--log-every", "1", "--eval-every", "12",
         "--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")
JOB = [sys.executable, "-m", "job", "train"]


@dataclass
class Launched:
    code: int
    lines: list[tuple[float, str]]  # (arrival time, line) of every rank's output and the launcher's
    ended: float

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, needle: str) -> float:
        """When the first line containing `needle` arrived (or the FAULT line's own clock)."""
        for arrived, line in self.lines:
            if needle in line:
                marker = re.search(r"FAULT (\d+\.\d+)", line)
                return float(marker.group(1)) if marker else arrived
        raise AssertionError(f"no line with {needle!r}:\n{self.text}")


def launch(command: list[str], *, extra: tuple[str, ...] = (), timeout: float = 240, **env: str) -> Launched:
    proc = subprocess.Popen(launcher_argv(2, command, devices=1, extra=extra), env=child_env(**env), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:  # stuck: stop the ranks too (each runs in its own session)
            for pid in rank_pids(proc.pid).values():
                os.killpg(pid, signal.SIGKILL)
            proc.kill()
    ended = time.time()
    reader.join(timeout=10)
    return Launched(proc.returncode, lines, ended)


def faulty(run_dir: Path, rank: int, fault: str, *flags: str, **env: str) -> Launched:
    return launch(scenario("faulty.py", str(rank), fault, "--", "train", "--run-dir", str(run_dir), *FLAGS, *flags),
                  **env)


def complete_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run with no fault: every checkpoint 2..12 kept, and the final parameters."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(2, 1, run_dir, *FLAGS)
    assert complete_steps(run_dir) == [2, 4, 6, 8, 10, 12]
    return run_dir


def seed(run_dir: Path, straight: Path, steps: tuple[int, ...] = (2, 4)) -> None:
    """A run dir as a run stopped after the last of `steps` leaves it."""
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in steps:
        shutil.copytree(straight / "checkpoints" / str(step), run_dir / "checkpoints" / str(step))


def check(
    outcome: Launched, *, since: float, code: int, says: tuple[str | tuple[str, ...], ...], name: str,
    record: pytest.RecordProperty,
) -> float:
    elapsed = outcome.ended - since
    print(f"{name}: the job exited {outcome.code} {elapsed:.1f} s after the fault")
    record("fault", name)
    record("exit_s", round(elapsed, 1))
    record("code", outcome.code)
    assert outcome.code == code, outcome.text
    for needle in says:  # a tuple: any one of these will do
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(option in outcome.text for option in options), f"{needle!r} not in the output:\n{outcome.text}"
    return elapsed


def check_resume(run_dir: Path, straight: Path, saved: list[int], record: pytest.RecordProperty) -> None:
    """The next run starts from the newest complete checkpoint and takes its first step as a clean run does."""
    assert saved, "no complete checkpoint survived the fault"
    first = saved[-1] + 1
    proc = train(2, 1, run_dir, *FLAGS, "--steps", str(first))
    assert f"resumed from step {saved[-1]}" in proc.stderr, proc.stderr
    assert train_losses(run_dir)[first] == train_losses(straight)[first]
    record("resumed_from", saved[-1])


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """mount(size) -> a fresh tmpfs of that size (root only); unmounted afterwards."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("needs root and mount(8) for a tmpfs (CI runs as root)")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], check=True)
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


# ---------------------------------------------------------------- faults during training

MID_TRAINING = {
    # name: (rank, fault, extra job flags, launcher exit code, what the output must say)
    "SIGKILL of rank 0": (0, f"kill@{FAULT_STEP}", (), 137, ("rank 0 was killed by SIGKILL",)),
    "SIGKILL of rank 1": (1, f"kill@{FAULT_STEP}", (), 137, ("rank 1 was killed by SIGKILL",)),
    "exception in rank 1": (1, f"raise@{FAULT_STEP}", (), 1,
                            # rank 0 fails a moment later in its collective, and may be reaped first
                            ("[rank 1] RuntimeError: injected fault in rank 1",
                             ("rank 1 exited with code 1",
                              "rank 1 raised first (RuntimeError: injected fault in rank 1)"))),
    "SIGSTOP of rank 1 (frozen host)": (1, f"stop@{FAULT_STEP}", (), 134,
                                        # jax names the task in one of two ways, depending on which
                                        # of its checks notices first
                                        ("stopped sending heartbeats",
                                         ("Task 1 heartbeat timeout", "(stopped sending heartbeats):\n[rank 0] 1\n"))),
    "rank 1 hangs in Python (--watchdog-s 5)": (1, f"sleep@{FAULT_STEP}", ("--watchdog-s", "5"), 86,
                                          ("watchdog: no training step completed for",
                                           "watchdog: roll call of 2 processes: process 1 on ",
                                           f"is in its own code of step {FAULT_STEP}, before the step's collectives",
                                           "[rank 0] watchdog: roll call", "is the one stuck")),
    "rank 1 stuck in its data source (--watchdog-s 5)": (
        1, f"rows-hang@{FAULT_STEP}", ("--watchdog-s", "5"), 86,
        ("watchdog: no training step completed for", "[rank 0] watchdog: roll call of 2 processes: process 1 on ",
         f"is waiting for its batch of step {FAULT_STEP} (its data source) while the others are", "is the one stuck")),
}
# what the failing process's own log file (RUN_DIR/logs/process-RANK.log) holds besides the console
LOGGED = {
    "exception in rank 1": ("RuntimeError: injected fault in rank 1", "Traceback (most recent call last)"),
    "rank 1 hangs in Python (--watchdog-s 5)": ("watchdog: no training step completed for", "Thread 0x"),
}
SMOKE_FAULT = "SIGKILL of rank 1"  # the one fault case of the second Python's smoke (make test-smoke)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.smoke) if name == SMOKE_FAULT else name
                                  for name in MID_TRAINING])
def test_fault_during_training(name: str, tmp_path: Path, straight: Path, record_property) -> None:
    rank, fault, flags, code, says = MID_TRAINING[name]
    outcome = faulty(tmp_path, rank, fault, *flags)
    check(outcome, since=outcome.first("FAULT"), code=code, says=says, name=name, record=record_property)
    logs = {p: (tmp_path / "logs" / f"process-{p}.log").read_text() for p in (0, 1)}
    for process, text in logs.items():  # each process's own output, in its own file
        assert f"process {process} of 2 (local) on " in text and f"process {1 - process} of 2" not in text, text
    assert all(line in logs[rank] for line in LOGGED.get(name, ())), logs[rank]
    saved = complete_steps(tmp_path)
    assert 4 in saved and max(saved) < FAULT_STEP, saved  # step 4's save had finished before step 6's began
    record_property("steps_redone", FAULT_STEP - 1 - max(saved))
    check_resume(tmp_path, straight, saved, record_property)


# ---------------------------------------------------------------- faults before training


def test_a_process_that_exits_before_joining(tmp_path: Path, straight: Path, record_property) -> None:
    seed(tmp_path, straight)
    outcome = faulty(tmp_path, 1, "exit-early")
    check(outcome, since=outcome.first("FAULT"), code=3, says=("rank 1 exited with code 3",),
          name="a process exits before joining", record=record_property)
    check_resume(tmp_path, straight, complete_steps(tmp_path), record_property)


def test_a_process_that_never_joins(tmp_path: Path, straight: Path, record_property) -> None:
    seed(tmp_path, straight)
    # the default init timeout (120 s) leaves room for slow starts at scale; the case uses 8 s
    outcome = faulty(tmp_path, 1, "hang-early", JOB_INIT_TIMEOUT="8")
    check(outcome, since=outcome.first("FAULT"), code=134, name="a process never joins (JOB_INIT_TIMEOUT=8)",
          says=("[rank 0] job.initialize: process 0: expected all 2 processes to join",
                "RPC: /xla.coordination.CoordinationService/RegisterTask",
                "joining: process 0 of 2"), record=record_property)
    assert "joining: process 1 of 2" not in outcome.text  # what tells the missing process apart
    check_resume(tmp_path, straight, complete_steps(tmp_path), record_property)


def test_coordinator_port_in_use(tmp_path: Path, straight: Path, record_property) -> None:
    seed(tmp_path, straight)
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.time()
        outcome = launch([*JOB, "--run-dir", str(tmp_path), *FLAGS], extra=("--port", str(port)))
    check(outcome, since=started, code=2, name="coordinator port in use (from launch)", record=record_property,
          says=(f"[rank 0] ConfigError: coordinator port: expected port {port} free", "rank 0 exited with code 2"))
    check_resume(tmp_path, straight, complete_steps(tmp_path), record_property)


def test_checkpoint_dir_not_writable(mount, straight: Path, record_property) -> None:
    run_dir = mount("16m") / "run"
    seed(run_dir, straight)
    subprocess.run(["mount", "-o", "remount,ro", str(run_dir.parent)], check=True)
    started = time.time()
    outcome = launch([*JOB, "--run-dir", str(run_dir), *FLAGS])
    check(outcome, since=started, code=1, name="checkpoint dir read-only (from launch)", record=record_property,
          says=("[rank 0] PreflightError: preflight: stopping before training", "Read-only file system",
                f"Fix: make {run_dir}/checkpoints one folder every host can write"))
    assert "step 1/" not in outcome.text  # stopped before training
    subprocess.run(["mount", "-o", "remount,rw", str(run_dir.parent)], check=True)
    check_resume(run_dir, straight, complete_steps(run_dir), record_property)


def test_disk_full_while_saving(mount, straight: Path, record_property) -> None:
    point = mount("16m")
    run_dir = point / "run"
    seed(run_dir, straight)
    fs = os.statvfs(point)
    used_kib = (fs.f_blocks - fs.f_bfree) * fs.f_frsize // 1024
    # room for the config and metrics, not for another checkpoint (each is about half of `used_kib`)
    subprocess.run(["mount", "-o", f"remount,size={used_kib + 96}k", str(point)], check=True)
    outcome = launch([*JOB, "--run-dir", str(run_dir), *FLAGS])
    check(outcome, since=outcome.first("No space left on device"), code=1, name="disk full while saving",
          says=("CheckpointError: checkpoint: expected to write step 6", "found No space left on device",
                "Complete checkpoints on disk: [2, 4] (a rerun resumes from step 4)"), record=record_property)
    assert complete_steps(run_dir) == [2, 4]
    subprocess.run(["mount", "-o", "remount,size=16m", str(point)], check=True)
    check_resume(run_dir, straight, [2, 4], record_property)
