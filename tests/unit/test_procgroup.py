"""The launcher's output filter, exit-code mapping, and stopping of a group (plain child processes)."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

from job.runtime.procgroup import GlooFilter, ProcessGroup, describe_exit, exit_code


def test_gloo_lines_and_their_interleaved_fragments_are_dropped() -> None:
    stream = [
        "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        "\n",
        " is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        "7\n",
        "step 1 loss 2.5\n",
    ]
    noise = GlooFilter()
    assert [line for line in stream if noise.keep(line)] == ["step 1 loss 2.5\n"]


def test_user_lines_far_from_gloo_output_are_kept_even_if_numeric() -> None:
    noise = GlooFilter()
    kept = [line for line in ["7\n", "\n", "hello\n", "42\n"] if noise.keep(line)]
    assert kept == ["7\n", "\n", "hello\n", "42\n"]
    assert noise.keep("[Gloo] Rank 0 is connected to 1 peer ranks.\n") is False
    for filler in ["a\n", "b\n", "c\n", "d\n"]:
        assert noise.keep(filler)
    assert noise.keep("7\n") is True  # the window after the gloo line has passed


def test_exit_codes_follow_the_shell_convention() -> None:
    assert exit_code(0) == 0
    assert exit_code(3) == 3
    assert exit_code(-signal.SIGKILL) == 137
    assert exit_code(-signal.SIGTERM) == 143


def test_exits_are_described_with_the_signal_name() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(86) == "exited with code 86 (no step within the watchdog's timeout)"  # the job's own codes
    assert describe_exit(75) == "exited with code 75 (saved and stopped: preempted)"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL (code 137)"


def test_a_frozen_process_is_continued_so_it_stops_on_sigterm_not_sigkill(tmp_path: Path) -> None:
    # rank 0 freezes itself (a SIGSTOPped host); rank 1 fails once /proc shows rank 0 stopped.
    script = (
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    open(os.environ['PIDFILE'], 'w').write(str(os.getpid()))\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    time.sleep(60)\n"
        "def frozen():\n"
        "    try:\n"
        "        pid = open(os.environ['PIDFILE']).read()\n"
        "        return pid and open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] == 'T'\n"
        "    except OSError:\n"
        "        return False\n"
        "while not frozen():\n"
        "    time.sleep(0.05)\n"
        "sys.exit(4)\n"
    )
    envs = [{**os.environ, "RANK": str(rank), "PIDFILE": str(tmp_path / "pid")} for rank in range(2)]
    group = ProcessGroup([sys.executable, "-c", script], envs, kill_after_s=60)
    assert group.run() == 4
    assert group.procs[0].returncode == -signal.SIGTERM  # without SIGCONT: SIGKILL, 60 s later


# Rank 1 fails first; rank 0 ignores the launcher's SIGTERM and then ends in the way ACTION says, before the
# launcher's SIGKILL: the order a crashed host and its peer's reaction can be reaped in.
LATE = (
    "import os, signal, sys, time\n"
    "if os.environ['RANK'] == '1':\n"
    "    while not os.path.exists(os.environ['READY']):\n"
    "        time.sleep(0.01)\n"
    "    sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, lambda *_: None)\n"
    "open(os.environ['READY'], 'w').close()\n"
    "time.sleep(0.5)\n"
    "{action}\n"
    "time.sleep(60)\n"
)


def late_group(tmp_path: Path, action: str) -> ProcessGroup:
    envs = [{**os.environ, "RANK": str(rank), "READY": str(tmp_path / "ready")} for rank in range(2)]
    return ProcessGroup([sys.executable, "-c", LATE.format(action=action)], envs, kill_after_s=30)


def test_a_crash_reaped_after_its_peers_reaction_is_the_cause(tmp_path: Path, caplog) -> None:
    group = late_group(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    with caplog.at_level("ERROR", logger="job.launch"):
        assert group.run() == 137
    assert [p.returncode for p in group.procs] == [-signal.SIGKILL, 1]
    assert "rank 1 exited with code 1; stopping the other 1 process(es)" in caplog.text
    assert "rank 0 was killed by SIGKILL (code 137): that is the cause" in caplog.text


def test_an_abort_after_the_first_failure_is_a_reaction_not_the_cause(tmp_path: Path, caplog) -> None:
    # jax's fatal log aborts a rank that lost its peer: that SIGABRT must not hide rank 1's own exit code
    group = late_group(tmp_path, "os.abort()")
    with caplog.at_level("ERROR", logger="job.launch"):
        assert group.run() == 1
    assert [p.returncode for p in group.procs] == [-signal.SIGABRT, 1]
    assert "that is the cause" not in caplog.text


def test_the_launchers_own_sigkill_is_not_taken_for_a_crash(tmp_path: Path) -> None:
    group = late_group(tmp_path, "pass")  # rank 0 ignores SIGTERM and lives on until the launcher kills it
    group.kill_after_s = 1
    assert group.run() == 1
    assert [p.returncode for p in group.procs] == [-signal.SIGKILL, 1]


# Both ranks raise (job.initialize's exit hook records each exception): rank 1 first, but it is slow to end (a
# long traceback on a loaded machine), so rank 0, raising after it as a peer that lost it would, is reaped first.
BOTH_RAISE = (
    "import os, signal, sys, time\n"
    "from job.runtime.distributed import _exit_on_uncaught\n"
    "mine = os.environ['JOB_ERROR_FILE']\n"
    "signal.signal(signal.SIGTERM, lambda *_: None)  # python -m job takes it as a notice\n"
    "if os.environ['RANK'] == '1':\n"
    "    sys.excepthook = _exit_on_uncaught(lambda *_: time.sleep(3))\n"
    "    raise RuntimeError('the first fault')\n"
    "sys.excepthook = _exit_on_uncaught(sys.excepthook)\n"
    "while not os.path.exists(os.path.join(os.path.dirname(mine), 'rank-1')):\n"
    "    time.sleep(0.01)\n"
    "raise OSError('Connection reset by peer')\n"
)


def test_the_exception_recorded_first_is_the_cause_whichever_rank_is_reaped_first(caplog) -> None:
    envs = [{**os.environ, "RANK": str(rank)} for rank in range(2)]
    group = ProcessGroup([sys.executable, "-c", BOTH_RAISE], envs, kill_after_s=30)
    with caplog.at_level("ERROR", logger="job.launch"):
        assert group.run() == 1
    assert "rank 0 exited with code 1; stopping the other 1 process(es)" in caplog.text
    assert re.search(r"rank 1 raised first \(RuntimeError: the first fault\), \d+\.\d\d s before rank 0, and "
                     r"exited with code 1: that is the cause, rank 0's exit was its reaction; exiting 1",
                     caplog.text), caplog.text


def test_a_rank_that_records_nothing_is_not_blamed_on_one_that_did(tmp_path: Path, caplog) -> None:
    # rank 1's plain exit 1 (no exception to record) is reaped first: it stays the cause, though rank 0 then raises
    group = late_group(tmp_path, "from job.runtime.distributed import _exit_on_uncaught\n"
                                 "sys.excepthook = _exit_on_uncaught(sys.excepthook)\n"
                                 "raise OSError('Connection reset by peer')")
    with caplog.at_level("ERROR", logger="job.launch"):
        assert group.run() == 1
    assert [p.returncode for p in group.procs] == [1, 1]
    assert "rank 1 exited with code 1; stopping the other 1 process(es)" in caplog.text
    assert "that is the cause" not in caplog.text
