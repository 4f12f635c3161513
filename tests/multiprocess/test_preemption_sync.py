"""The preemption check between steps: a notice to one process stops every process at the same step, whichever
signal it was: by a collective every step (the default on CPU: JOB_PREEMPTION_SYNC_POINT=0), or through the
coordination service's preemption sync point (the default on TPU and GPU: JOB_PREEMPTION_SYNC_POINT=1 here), where the check without a step (before the first, during
evaluation) also hears a SIGTERM that only jax's notifier caught."""

from __future__ import annotations

import re

import pytest

from tests.launching import explain, launcher_argv, run, scenario

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(("way", "sig", "interrupted", "sync"), [
    ("step", "SIGTERM", False, "1"), ("step", "SIGUSR2", False, "1"), ("step", "SIGINT", True, "1"),
    ("collective", "SIGTERM", False, "1"), ("collective", "SIGINT", True, "1"),
    ("step", "SIGTERM", False, "0"), ("step", "SIGINT", True, "0"),  # the CPU default: a collective every step
])
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(way: str, sig: str, interrupted: bool,
                                                                      sync: str) -> None:
    done = run(launcher_argv(2, scenario("preempt_sync.py", way, sig), devices=1),
               timeout=240, JOB_PREEMPTION_SYNC_POINT=sync)
    assert done.returncode == 0, explain(done)
    said = {int(rank): (int(step), flag, point) for rank, step, flag, point in re.findall(
        r"\[rank (\d)\] stopped at (\d+) interrupted (True|False) sync point (True|False)", done.stdout)}
    assert sorted(said) == [0, 1], explain(done)
    assert said[0] == said[1], explain(done)  # the same step, the same verdict, on both
    step, flag, _ = said[0]
    assert step >= 5 and flag == str(interrupted) and said[0][2] == str(sync == "1"), explain(done)
