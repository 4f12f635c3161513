"""The preemption check between steps: a notice to one process stops every process at the same step, through the
coordination service's preemption sync point (no collective per step), whichever signal it was; the check
without a step (before the first, during evaluation) also hears a SIGTERM that only jax's notifier caught."""

from __future__ import annotations

import re

import pytest

from tests.launching import explain, launcher_argv, run, scenario

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(("way", "sig", "interrupted"), [("step", "SIGTERM", False), ("step", "SIGUSR2", False),
                                                         ("step", "SIGINT", True), ("collective", "SIGTERM", False),
                                                         ("collective", "SIGINT", True)])
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(way: str, sig: str, interrupted: bool) -> None:
    done = run(launcher_argv(2, scenario("preempt_sync.py", way, sig), devices=1),
               timeout=240)
    assert done.returncode == 0, explain(done)
    said = {int(rank): (int(step), flag, sync) for rank, step, flag, sync in re.findall(
        r"\[rank (\d)\] stopped at (\d+) interrupted (True|False) sync point (True|False)", done.stdout)}
    assert sorted(said) == [0, 1], explain(done)
    assert said[0] == said[1], explain(done)  # the same step, the same verdict, on both
    step, flag, sync = said[0]
    assert step >= 5 and flag == str(interrupted) and sync == "True", explain(done)
