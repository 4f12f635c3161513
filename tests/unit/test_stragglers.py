"""job.observe.stragglers: who is named, from the numbers every process shares."""

from __future__ import annotations

import numpy as np
import pytest

from job.observe.stragglers import FLOOR, Straggler, StragglerWatch, named


def test_the_one_slow_host_is_named_with_its_ratio_to_the_median() -> None:
    assert named(np.array([2.0, 150.0, 2.5, 1.5]), step_ms=160.0, ratio=1.2) == [(1, 150.0, pytest.approx(150 / 2.25))]


def test_no_one_is_named_when_the_hosts_agree_or_a_ratio_is_large_on_a_negligible_share_of_the_step() -> None:
    assert named(np.array([10.0, 11.0, 10.5]), step_ms=100.0, ratio=1.2) == []
    # 10x the median, but under FLOOR of the step: it cannot slow the job much
    assert named(np.array([1.0, 10.0, 1.0]), step_ms=10.0 / FLOOR + 1, ratio=1.2) == []


def test_several_stragglers_come_slowest_first_and_the_ratio_is_configurable() -> None:
    times = np.array([100.0, 300.0, 200.0, 100.0, 100.0])
    assert [p for p, _, _ in named(times, step_ms=320.0, ratio=1.2)] == [1, 2]
    assert [p for p, _, _ in named(times, step_ms=320.0, ratio=2.5)] == [1]


def test_one_process_shares_nothing_and_names_no_one() -> None:
    watch = StragglerWatch(1.2)
    watch.add(0.5, 0.6)
    assert watch.share() == [] and watch.slowest() == []


def test_a_straggler_line_names_process_host_time_and_ratio() -> None:
    assert Straggler(3, "node7", 212.34, 20.1).line() == "process 3 (node7) 212.3 ms/step host time, 20.1x the median"
