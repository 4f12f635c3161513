"""The launcher's output filter, exit-code mapping, and stopping of a group (plain child processes)."""

from __future__ import annotations

import os
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
