"""job.random's row bits; job.train.batches: a global batch from a task's rows laid out by any sharding, prefetch; the task registry."""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from job import random, task
from job.errors import ConfigError
from job.tasks.classify.data import DataConfig, Spirals
from job.tasks.lm.data import ReverseTask
from job.train import batches


@pytest.mark.parametrize("source", [ReverseTask(16, 10, seed=4), Spirals(DataConfig(seed=3), features=3, classes=4)])
def test_a_global_batch_holds_the_task_rows_in_order_whatever_the_device_order(source: task.Rows) -> None:
    devices = jax.devices()[::-1]  # any device order works on one process
    mesh = jax.make_mesh((len(devices),), ("devices",), devices=devices)
    sharding = NamedSharding(mesh, PartitionSpec("devices"))
    arrays = batches.global_batch(source, sharding, split="eval", step=3, size=16)
    expected = source.rows("eval", 3, 0, 16)
    assert sorted(arrays) == sorted(expected)
    for key, value in expected.items():
        assert arrays[key].shape == (16, *value.shape[1:]) and arrays[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(arrays[key]), value)


@pytest.mark.parametrize("cuts", [(0, 16), (0, 5, 16), (0, 4, 8, 12, 16), (0, 1, 2, 15, 16)])
def test_the_lm_rows_are_the_same_however_the_hosts_cut_the_batch(cuts: tuple[int, ...]) -> None:
    # what makes every topology see the same global batch (trained alike on 1x4, 4x1 and 2x2 in test_train);
    # the classifier's rows: test_spiral_rows_do_not_depend_on_how_the_range_is_cut
    source = ReverseTask(16, 10, seed=4)
    whole = source.rows("train", 5, 0, 16)
    parts = [source.rows("train", 5, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    for key, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), value)


def test_rows_of_a_model_group_are_made_once_per_row() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert batches.row_span(NamedSharding(mesh, PartitionSpec("data")), 8) == (0, 8)


def test_every_task_folder_loads_and_names_itself() -> None:
    assert {"lm", "classify"} <= set(task.names())
    for name in task.names():
        loaded = task.load(name)
        assert loaded.name == name
        assert {"global_batch", "eval_batches"} <= {f.name for f in dataclasses.fields(loaded.data_config)}


def test_an_unknown_task_lists_the_folders() -> None:
    with pytest.raises(ConfigError, match=r"--task: expected one of .*classify.*lm.*found 'lmm'"):
        task.load("lmm")


@pytest.mark.parametrize(("args", "name"), [([], "lm"), (["--task", "classify"], "classify"),
                                            (["--steps", "3", "--task=classify"], "classify")])
def test_the_task_flag_is_read_before_the_rest(args: list[str], name: str) -> None:
    assert task.task_name(args) == name


# --------------------------------------------------------------------------- row bits


def test_row_bits_are_a_pure_function_of_seed_split_step_row_and_position() -> None:
    whole = random.row_bits(7, 1, 3, 0, 8, 5)
    assert whole.shape == (8, 5) and whole.dtype == np.uint64
    np.testing.assert_array_equal(np.concatenate([random.row_bits(7, 1, 3, 0, 3, 5),
                                                  random.row_bits(7, 1, 3, 3, 8, 5)]), whole)
    np.testing.assert_array_equal(random.row_bits(7, 1, 3, 0, 8, 2), whole[:, :2])  # wider rows extend
    others = [random.row_bits(*args) for args in [(8, 1, 3, 0, 8, 5), (7, 0, 3, 0, 8, 5), (7, 1, 4, 0, 8, 5)]]
    for other in others:  # another seed, split or step: other words everywhere
        assert not np.isin(other, whole).any()
    assert len(np.unique(whole)) == whole.size


def test_row_bits_look_uniform() -> None:
    bits = random.row_bits(0, 0, 0, 0, 4096, 16)
    u = random.uniform(bits)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01
    counts = np.bincount(random.below(bits, 10).ravel(), minlength=10)
    assert counts.min() > 0.9 * bits.size / 10 and counts.max() < 1.1 * bits.size / 10
    ones = np.unpackbits(bits.view(np.uint8)).mean()  # every bit is a fair coin
    assert abs(ones - 0.5) < 0.005


@pytest.mark.parametrize("split", task.SPLITS)
def test_spiral_rows_do_not_depend_on_how_the_range_is_cut(split: str) -> None:
    source = Spirals(DataConfig(seed=5), features=3, classes=4)
    for step in (0, 1, 9):
        whole = source.rows(split, step, 0, 8)
        for cut in (0, 3, 8):
            head, tail = source.rows(split, step, 0, cut), source.rows(split, step, cut, 8)
            for key in ("x", "label"):
                np.testing.assert_array_equal(np.concatenate([head[key], tail[key]]), whole[key])
    other = source.rows("train", 1, 0, 8)["x"]
    assert not np.array_equal(source.rows("train", 0, 0, 8)["x"], other)
    assert not np.array_equal(source.rows("eval", 1, 0, 8)["x"], other)


def test_spiral_points_lie_on_their_arm() -> None:
    cfg = DataConfig(seed=1, noise=0.0, turns=1.0)
    rows = Spirals(cfg, features=4, classes=3).rows("train", 0, 0, 3000)
    x, label = rows["x"], rows["label"]
    assert x.dtype == np.float32 and label.dtype == np.int32
    assert sorted(np.bincount(label).tolist())[0] > 900  # the arms are about equally likely
    np.testing.assert_array_equal(x[:, 2:], 0.0)  # no noise: the extra coordinates are 0
    t = np.hypot(x[:, 0], x[:, 1])
    assert 0.1 - 1e-6 <= t.min() and t.max() <= 1.0 + 1e-6
    angle = 2 * np.pi * (cfg.turns * t + label / 3)
    np.testing.assert_allclose(x[:, 0], t * np.cos(angle), atol=1e-5)
    noisy = Spirals(DataConfig(seed=1, noise=0.5), features=4, classes=3).rows("train", 0, 0, 4000)["x"]
    assert abs(noisy[:, 2:].std() - 0.5) < 0.02 and abs(noisy[:, 2:].mean()) < 0.03  # normal noise


# --------------------------------------------------------------------------- prefetch


def test_prefetch_hands_back_each_step_in_order_and_makes_none_beyond_the_last() -> None:
    made: list[int] = []
    with batches.Prefetch(lambda s: made.append(s) or s * s, range(3, 9), depth=2) as upcoming:
        assert [upcoming.get(s) for s in range(3, 9)] == [s * s for s in range(3, 9)]
    assert made == list(range(3, 9))


def test_prefetch_stays_at_most_depth_ahead_and_stops_when_left_early() -> None:
    made: list[int] = []
    with batches.Prefetch(lambda s: made.append(s) or s, range(1000), depth=2) as upcoming:
        assert upcoming.get(0) == 0
        deadline = time.monotonic() + 10
        while len(made) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert made == [0, 1, 2, 3]  # 1 and 2 wait in the queue, 3 waits for room
    assert not any(t.name == "job-prefetch" for t in threading.enumerate())
    assert len(made) <= 4


def test_prefetch_hands_the_error_to_the_step_that_needed_it() -> None:
    def make(step: int) -> int:
        if step == 2:
            raise ValueError("bad row 2")
        return step

    with batches.Prefetch(make, range(5)) as upcoming:
        assert upcoming.get(0) == 0 and upcoming.get(1) == 1
        with pytest.raises(ValueError, match="bad row 2"):
            upcoming.get(2)
        with pytest.raises(RuntimeError, match="prefetch thread has stopped"):
            upcoming.get(3)


def test_prefetch_refuses_steps_out_of_order() -> None:
    with batches.Prefetch(lambda s: s, range(4)) as upcoming, pytest.raises(RuntimeError, match="expected step 1"):
        upcoming.get(1)


def test_an_exception_in_the_loop_stops_the_prefetch_thread() -> None:
    with pytest.raises(KeyError), batches.Prefetch(lambda s: s, range(10**6), depth=1) as upcoming:
        upcoming.get(0)
        raise KeyError("step failed")
    assert not any(t.name == "job-prefetch" for t in threading.enumerate())


def test_the_prefetch_thread_runs_at_a_lower_priority_than_the_loop() -> None:
    import os

    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    with batches.Prefetch(lambda s: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
                          range(3)) as upcoming:
        for step in range(3):
            upcoming.get(step)
    assert seen == [max(loop, batches.PREFETCH_NICE)] * 3
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop


def test_the_batches_module_imports_without_jax() -> None:
    import subprocess
    import sys

    code = "import sys, job.train.batches; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
