"""--optim.name / --optim.schedule / --optim.clip-norm 0 / --optim.decay-steps, a task's own optimizer, tasks outside
job/, and what a resume that changes the schedule says."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

from job import task
from job.errors import ConfigError
from job.train import config
from job.train.config import OPTIMIZER_NAMES, SCHEDULE_NAMES, OptimConfig
from job.train.optimizers import (
    OPTIMIZERS,
    for_task,
    horizon,
    make_optimizer,
    make_schedule,
    saved_config,
    schedule_change,
)

PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
GRADS = {"w": jnp.full((4, 3), 0.5), "b": jnp.full((3,), -0.5)}


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_named_optimizer_builds_and_moves_the_parameters(name: str) -> None:
    tx, schedule = make_optimizer(dataclasses.replace(OptimConfig(), name=name, warmup_steps=0), 10)
    state = tx.init(PARAMS)
    updates, _ = tx.update(GRADS, state, PARAMS)
    moved = optax.apply_updates(PARAMS, updates)
    assert float(jnp.abs(moved["w"] - PARAMS["w"]).max()) > 0, name
    assert float(schedule(0)) == pytest.approx(OptimConfig().lr)


def test_the_config_lists_exactly_the_optimizers_there_are() -> None:
    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES


def test_the_default_is_the_template_s_adamw_with_clipping_and_warmup_cosine() -> None:
    o = OptimConfig()
    tx, schedule = make_optimizer(o, 100)
    reference = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                            optax.adamw(optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, 100,
                                                                           end_value=o.lr * o.min_lr_ratio),
                                        b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    mine, theirs = tx.init(PARAMS), reference.init(PARAMS)
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)  # checkpoints of earlier runs still resume
    for _ in range(3):
        (a, mine), (b, theirs) = tx.update(GRADS, mine, PARAMS), reference.update(GRADS, theirs, PARAMS)
        assert all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    assert [float(schedule(i)) for i in (0, 20, 100)] == pytest.approx([0.0, o.lr, o.lr * o.min_lr_ratio])


def test_clip_norm_0_means_no_clipping() -> None:
    big = jax.tree.map(lambda g: g * 1e6, GRADS)
    plain = optax.sgd(1.0)
    tx, _ = make_optimizer(dataclasses.replace(OptimConfig(), name="sgd", b1=0.0, clip_norm=0, warmup_steps=0,
                                               schedule="constant", lr=1.0), 10)
    a, _ = tx.update(big, tx.init(PARAMS), PARAMS)
    b, _ = plain.update(big, plain.init(PARAMS), PARAMS)
    assert jax.tree.leaves(a)[0].tolist() == jax.tree.leaves(b)[0].tolist()


@pytest.mark.parametrize(("schedule", "at"), [
    ("cosine", {0: 0.0, 20: 1.0, 100: 0.1}),
    ("linear", {0: 0.0, 20: 1.0, 60: 0.55, 100: 0.1}),
    ("constant", {0: 0.0, 20: 1.0, 99: 1.0}),
    ("warmup-stable-decay", {0: 0.0, 20: 1.0, 84: 1.0, 92: 0.55, 100: 0.1}),
])
def test_each_schedule_warms_up_then_follows_its_shape(schedule: str, at: dict[int, float]) -> None:
    s = make_schedule(dataclasses.replace(OptimConfig(), lr=1.0, schedule=schedule), 100)
    assert {step: float(s(step)) for step in at} == pytest.approx(at, abs=1e-6)


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("name", "rmsprop", "--optim.name"), ("schedule", "exp", "--optim.schedule"),
    ("decay_fraction", 0.0, "--optim.decay-fraction"), ("clip_norm", -1.0, "--optim.clip-norm"),
    ("decay_steps", -1, "--optim.decay-steps"),
])
def test_a_bad_optimizer_flag_is_one_error_listing_the_choices(field: str, value: object, flag: str) -> None:
    lm = task.load("lm")
    cfg = dataclasses.replace(config.defaults(lm), optim=dataclasses.replace(OptimConfig(), **{field: value}))
    with pytest.raises(ConfigError, match=flag) as err:
        config.validate(cfg, lm)
    assert "Fix:" in str(err.value)
    if field == "name":
        assert all(name in str(err.value) for name in OPTIMIZER_NAMES)
    if field == "schedule":
        assert all(name in str(err.value) for name in SCHEDULE_NAMES)


def test_a_task_outside_the_package_loads_by_module_and_attribute() -> None:
    loaded = task.load("tests.user_tasks.regression:TASK")
    assert loaded.name == "regression" and loaded.optimizer is not None
    cfg = config.parse(["--task", "tests.user_tasks.regression:TASK", "--model.lr", "0.2"], loaded)
    tx, schedule = loaded.optimizer(cfg, 10)  # the task's optimizer sees the task's own config
    assert float(schedule(0)) == pytest.approx(0.2) and float(schedule(11)) == pytest.approx(0.1)


@pytest.mark.parametrize(("spec", "says"), [
    ("tests.user_tasks.nowhere:TASK", "an importable module tests.user_tasks.nowhere"),
    ("tests.user_tasks.regression:MLP", "to be a job.task.Task"),
    ("tests.user_tasks.regression:", "NAME (a folder under job/tasks/) or MODULE:ATTR"),
    (":TASK", "NAME (a folder under job/tasks/) or MODULE:ATTR"),
])
def test_a_task_that_cannot_be_loaded_is_one_clear_error(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match="--task") as err:
        task.load(spec)
    assert says in str(err.value) and "Fix:" in str(err.value)


def test_a_task_s_own_command_is_reached_with_task_and_gets_its_arguments_without_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    from job import __main__ as entry

    assert entry.main(["echo", "--task", "tests.user_tasks.regression:TASK", "a", "b"]) == 0
    assert capsys.readouterr().out.strip() == "echo a b"
    assert entry.main(["echo", "--task=nowhere:TASK"]) == 2
    assert task.without_task(["--task", "x", "a", "--task=y", "b"]) == ["a", "b"]


def lm_config(steps: int, **optim: Any) -> config.TrainConfig:
    lm = task.load("lm")
    return dataclasses.replace(config.defaults(lm), steps=steps, optim=dataclasses.replace(OptimConfig(), **optim))


def test_a_resume_with_more_steps_says_the_schedule_changes_with_the_rate_before_and_after() -> None:
    # measured on the lm task (warmup 2): train 5 steps, resume with --steps 10; step 5 ran at 0.975e-3
    lm = task.load("lm")
    line = schedule_change(lm, lm_config(10, warmup_steps=2), [("steps", 5, 10)], 5)
    assert line == ("the learning-rate schedule changes: at step 5 the saved run's gives lr 9.750e-04, this run's "
                    "2.605e-03 (it spans --optim.decay-steps, else --steps: 5 -> 10; pass --optim.decay-steps 5 to "
                    "keep the saved one)")
    # with the saved horizon kept, nothing changes; a new peak rate changes it, with no word on the horizon
    kept = lm_config(10, warmup_steps=2, decay_steps=5)
    assert schedule_change(lm, kept, [("steps", 5, 10), ("optim.decay_steps", 0, 5)], 5) is None
    lr = schedule_change(lm, lm_config(5, warmup_steps=2, lr=1e-3), [("optim.lr", 3e-3, 1e-3)], 5)
    assert lr == "the learning-rate schedule changes: at step 5 the saved run's gives lr 9.750e-04, this run's 3.250e-04"
    assert schedule_change(lm, lm_config(10), [("log_every", 5, 1)], 5) is None


def test_decay_steps_keeps_the_schedule_of_a_shorter_run_when_a_run_is_extended() -> None:
    lm = task.load("lm")
    short, extended = lm_config(5, warmup_steps=2), lm_config(10, warmup_steps=2, decay_steps=5)
    assert horizon(short) == 5 and horizon(extended) == 5 and horizon(lm_config(10)) == 10
    before, after = for_task(lm, short)[1], for_task(lm, extended)[1]
    assert [float(after(i)) for i in range(10)] == [float(before(i)) for i in range(10)]
    assert float(after(9)) == pytest.approx(OptimConfig().lr * OptimConfig().min_lr_ratio)  # past it: the end rate
    cfg = config.parse(["--optim.decay-steps", "5", "--steps", "10"], lm)
    assert cfg.optim.decay_steps == 5 and horizon(cfg) == 5


def test_a_tasks_own_optimizer_gets_the_horizon_as_its_steps() -> None:
    regression = task.load("tests.user_tasks.regression:TASK")
    spans = dataclasses.replace(regression, optimizer=lambda cfg, steps: (optax.sgd(1.0), lambda i: steps))
    cfg = dataclasses.replace(config.defaults(regression), steps=10)
    assert for_task(spans, cfg)[1](0) == 10
    assert for_task(spans, dataclasses.replace(cfg, optim=dataclasses.replace(OptimConfig(), decay_steps=4)))[1](0) == 4


def test_the_saved_config_is_this_one_with_each_changed_field_given_back() -> None:
    lm = task.load("lm")
    cfg = lm_config(10, decay_steps=7)
    saved = saved_config(cfg, [("steps", 5, 10), ("optim.decay_steps", None, 7), ("model.gone", 3, None)], lm)
    assert saved.steps == 5 and saved.optim.decay_steps == 0  # a field the saved run lacked: its default
    assert saved.model == cfg.model and saved.optim.lr == cfg.optim.lr


def test_an_optim_flag_a_tasks_own_optimizer_does_not_read_is_refused_not_ignored() -> None:
    regression = task.load("tests.user_tasks.regression:TASK")
    own = dataclasses.replace(regression, optimizer=lambda cfg, steps: (optax.sgd(0.1), optax.constant_schedule(0.1)))
    cfg = config.parse(["--task", "tests.user_tasks.regression:TASK", "--optim.lr", "1e-5", "--optim.name", "sgd"],
                       own)
    with pytest.raises(ConfigError) as raised:
        for_task(own, cfg)
    assert raised.value.what == "--optim.name" and raised.value.found == "--optim.name sgd --optim.lr 1e-05"
    assert "reads no cfg.optim.name" in raised.value.expected and raised.value.fix.startswith("drop --optim.name")
    # a task's optimizer that reads the value takes it; with no --optim.* given, any task's optimizer builds
    reads = dataclasses.replace(regression, optimizer=lambda cfg, steps: (
        optax.sgd(cfg.optim.lr), optax.constant_schedule(cfg.optim.lr)))
    lr_only = config.parse(["--task", "tests.user_tasks.regression:TASK", "--optim.lr", "1e-5"], reads)
    assert float(for_task(reads, lr_only)[1](0)) == pytest.approx(1e-5)
    assert for_task(own, config.parse(["--task", "tests.user_tasks.regression:TASK"], own))[0] is not None
