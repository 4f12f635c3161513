"""The preemption guard's hold on the signals: restored when the run ends, kept once the processes agreed to
stop (a process leaving with 75 is not killed by a later signal)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from job.core.errors import ConfigError
from job.runtime.preemption import REQUEUE_EXIT_CODE, SYNC_POINT_ENV, sync_point_wanted

# One process: a USR2 (or none), the guard's exit, then SIGTERM, as srun sends it to a task still ending
# once a peer has left with 75 (srun --kill-on-bad-exit=1).
LEAVING = """
import os, signal, sys
from job.runtime.preemption import PreemptionGuard
with PreemptionGuard() as guard:
    if sys.argv[1] == "preempted":
        os.kill(os.getpid(), signal.SIGUSR2)
    stop = guard.should_stop()
os.kill(os.getpid(), signal.SIGTERM)
print("left", stop, flush=True)
sys.exit(75 if stop else 0)
"""


@pytest.mark.parametrize(("case", "code", "said"), [("preempted", REQUEUE_EXIT_CODE, "left True"),
                                                     ("finished", -signal.SIGTERM, "")])
def test_the_guard_holds_the_signals_to_the_end_only_once_the_processes_agreed_to_stop(
        case: str, code: int, said: str) -> None:
    proc = subprocess.run([sys.executable, "-c", LEAVING, case], capture_output=True, text=True, timeout=120,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.strip() == said
    if case == "preempted":
        assert "received SIGTERM while leaving with 75: the saved exit stands" in proc.stderr


# A notice before the loop's guard exists (imports, joining): remembered, then the guard stops the run.
EARLY = """
import os, signal
from job.runtime.preemption import PreemptionGuard, hear_notices_early
hear_notices_early()
os.kill(os.getpid(), signal.SIGUSR2)
hear_notices_early()  # a second call (a Slurm task, then python -m job's main) keeps what the first heard
with PreemptionGuard() as guard:
    print("stop", guard.should_stop(), flush=True)
with PreemptionGuard() as later:
    print("later", later.received, flush=True)
"""


def test_a_notice_during_start_up_is_kept_for_the_guard_instead_of_ending_the_process() -> None:
    proc = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True, timeout=120,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["stop", "True", "later", "None"]  # taken once
    assert "received SIGUSR2 during start-up: the run stops with 75 once it can" in proc.stderr
    assert proc.stderr.count("received SIGUSR2") == 1


# Ctrl-C while the main thread writes a line to the process's log file (job.observe.process_log holds its lock
# for the copy): the handler runs inside that write.
MID_WRITE = """
import logging, os, signal, sys
from job.core import storage
from job.observe.process_log import teed
from job.runtime.preemption import PreemptionGuard
logging.basicConfig(level=logging.INFO)
copy = storage.Appender.write
def write(self, text):
    if "step 6" in text:
        os.kill(os.getpid(), signal.SIGINT)  # os.kill runs this process's handler before it returns
    copy(self, text)
storage.Appender.write = write
with teed(sys.argv[1], 0), PreemptionGuard((signal.SIGINT,)) as guard:
    logging.getLogger("job.train").info("step 6/10")
    print("stop", guard.should_stop(), flush=True)
"""


def test_a_signal_in_the_middle_of_a_log_line_is_heard_and_the_step_goes_on(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", MID_WRITE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stop True"
    assert "WARNING job.runtime.preemption: received SIGINT: will save and stop at the next step boundary" \
        in proc.stderr
    assert "step 6/10" in (tmp_path / "logs" / "process-0.log").read_text()


@pytest.mark.parametrize(("value", "backend", "wanted"), [
    (None, "tpu", True), (None, "gpu", True), (None, "cpu", False), ("auto", "tpu", True), ("", "cpu", False),
    ("1", "cpu", True), ("0", "tpu", False), ("0", "gpu", False), (" AUTO ", "gpu", True),
])
def test_the_sync_point_is_the_default_on_tpu_and_gpu_and_either_way_can_be_forced(
        value: str | None, backend: str, wanted: bool) -> None:
    env = {} if value is None else {SYNC_POINT_ENV: value}
    assert sync_point_wanted(env, backend) is wanted


def test_a_sync_point_setting_that_is_none_of_the_three_is_one_error_naming_them() -> None:
    with pytest.raises(ConfigError) as error:
        sync_point_wanted({SYNC_POINT_ENV: "yes"}, "tpu")
    text = str(error.value)
    assert SYNC_POINT_ENV in text and "'yes'" in text and "auto" in text and "Fix:" in text
