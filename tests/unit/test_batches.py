"""job.batches: a global batch from a task's rows, laid out by any sharding; and the task registry."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from job import batches, task
from job.errors import ConfigError
from job.tasks.classify.data import DataConfig, Spirals
from job.tasks.lm.data import ReverseTask


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
