"""Checkpointer across real processes: saves written in the background beside the loop's collectives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import explain, launcher_argv, run, scenario

pytestmark = pytest.mark.multiprocess


def test_saves_written_beside_the_steps_run_no_device_collective_and_read_back(tmp_path: Path) -> None:
    rounds = 4
    proc = run(launcher_argv(2, scenario("background_saves.py", str(rounds))), timeout=180,
               SCENARIO_OUT=str(tmp_path))
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # every round reads back as saved, although the steps after each save donated and changed it
        assert seen["restored"] == [[i, True, i] for i in range(1, rounds + 1)]
        # the steps beside the saves all-reduced what they should: sum(0..63) + 64000 i, plus 64 a step
        assert seen["sums"] == [2016.0 + 64000 * i + 64 * k for i in range(1, rounds + 1) for k in range(3)]
        # orbax's barriers and its write's threads went through the coordination service: a device
        # collective there could pair with the step's on another process and hang both
        assert seen["collectives"], "the scenario's own checks gather on the main thread"
        assert all(c.endswith(" on MainThread") for c in seen["collectives"]), seen["collectives"]
