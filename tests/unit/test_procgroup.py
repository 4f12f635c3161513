"""The launcher's output filter and exit-code mapping (no processes started)."""

from __future__ import annotations

import signal

from job.procgroup import GlooFilter, exit_code


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
