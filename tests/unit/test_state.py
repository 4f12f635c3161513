"""job.train.state and job.train.steps on 8 CPU devices: the train state planned before it exists and created as
its shards, train and eval modes, a task's own logical axes, and gradient accumulation."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any

_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from job import sharding as sh  # noqa: E402
from job.errors import ConfigError  # noqa: E402
from job.observe.process_log import FILE_ONLY  # noqa: E402
from job.train import state, steps  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Cfg:
    rule: str = "fsdp_tensor"
    seed: int = 0
    model: object = None
    ema: object = None
    run_dir: str = "runs/x"


class Net(nnx.Module):
    """The flax MNIST tutorial's ingredients: a layer, batch norm, dropout; one kernel in the task's own
    "gates" axis name, written with nnx.with_partitioning (flax's eager sharding would need a mesh)."""

    def __init__(self, rngs: nnx.Rngs, deterministic: bool = False) -> None:
        self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                       ("embed", "gates")), rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, deterministic=deterministic, rngs=rngs)
        self.down = nnx.Linear(32, 4, kernel_metadata=sh.axes("gates", None), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.dropout(self.bn(self.up(x))))


@dataclasses.dataclass(frozen=True)
class FakeTask:
    deterministic: bool = False
    logical_axes: dict = dataclasses.field(default_factory=lambda: {"gates": {"tensor": "model",
                                                                                "fsdp_tensor": "model"}})

    def build(self, cfg: object, rngs: nnx.Rngs) -> Net:
        return Net(rngs, self.deterministic)


def test_the_state_is_planned_without_arrays_and_created_as_its_shards(mesh42: Mesh) -> None:
    planned = state.plan(FakeTask(), Cfg(), mesh42, optax.adam(1e-3))
    leaves = dict(nnx.to_flat_state(planned.abstract))
    kernel = leaves[("model", "up", "kernel")].get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.sharding.spec == P("data", "model")
    assert leaves[("model", "down", "kernel")].get_value().sharding.spec == P("model")
    assert leaves[("model", "dropout", "rngs", "key")].get_value().sharding.spec == P()
    assert planned.params == 16 * 32 + 32 + 2 * 32 + 32 * 4 + 4
    created = planned.init()
    for path, var in nnx.to_flat_state(created):
        want = leaves[path].get_value()
        value = var.get_value()
        assert value.sharding == want.sharding and value.shape == want.shape and value.dtype == want.dtype, path
    up = dict(nnx.to_flat_state(created))[("model", "up", "kernel")].get_value()
    assert {shard.data.shape for shard in up.addressable_shards} == {(4, 16)}
    mu = [v.get_value() for p, v in nnx.to_flat_state(created) if p[-2:] == ("up", "kernel") and "mu" in p]
    assert len(mu) == 1 and mu[0].sharding.spec == P("data", "model")  # the moments follow their parameter


def test_the_init_gives_the_values_of_an_eager_build(mesh42: Mesh) -> None:
    planned = state.plan(FakeTask(), Cfg(rule="replicated"), mesh42, optax.adam(1e-3))
    created = nnx.merge(planned.graphdef, planned.init())["model"]
    with nnx.use_eager_sharding(False):
        eager = Net(nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(created.up.kernel.get_value()), np.asarray(eager.up.kernel.get_value()),
                               rtol=1e-6)


def test_an_evaluation_reads_no_optimizer_state_and_warns_in_one_line_with_the_list_in_the_log_file(
        mesh42: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    """Without the task's "gates" axis the two kernels (and their Adam moments) replicate: the run's warning
    names all of them; an evaluation (python -m job eval) plans no optimizer and counts the model's in one line,
    their list going to the process's log file (the console outside job.observe.process_log.teed)."""
    caplog.set_level(logging.INFO, logger=FILE_ONLY)
    task = FakeTask(logical_axes={})
    said, planned = {}, {}
    for evaluating in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            planned[evaluating] = state.plan(task, Cfg(), mesh42, optax.adam(1e-3), evaluating=evaluating)
        said[evaluating] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said[False]) == 1 and "optimizer/" in said[False][0]
    assert "optimizer" in planned[False].abstract and "optimizer" not in planned[True].abstract
    assert sorted(planned[True].abstract) == ["model"]
    [line] = said[True]
    assert "\n" not in line and "optimizer/" not in line
    assert line == ("6 variable(s) the evaluation reads fell back to replicated under --rule fsdp_tensor on the mesh "
                    "{'data': 4, 'model': 2} (it reads no optimizer state); the list in runs/x/logs/process-0.log")
    [listed] = [r.getMessage() for r in caplog.records if r.name == FILE_ONLY]
    assert listed.startswith("--rule fsdp_tensor: fell back to replicated on the mesh {'data': 4, 'model': 2}:\n")
    entries = listed.splitlines()[1:]
    assert len(entries) == 6 and all(entry.startswith("  model/") for entry in entries), listed
    assert "  model/up/kernel: unknown logical axis 'gates'" in listed
    assert f"  model/bn/scale: {sh.UNANNOTATED}" in listed


@pytest.mark.parametrize("deterministic", [False, True])
def test_steps_run_in_train_mode_and_evaluations_in_eval_mode(deterministic: bool, mesh42: Mesh) -> None:
    planned = state.plan(FakeTask(deterministic=deterministic), Cfg(), mesh42, optax.adam(1e-3))
    created = planned.init()
    trained, evaluated = nnx.merge(planned.graphdef, created)["model"], nnx.merge(planned.eval_graphdef, created)["model"]
    assert (trained.dropout.deterministic, trained.bn.use_running_average) == (False, False)
    assert (evaluated.dropout.deterministic, evaluated.bn.use_running_average) == (True, True)


def test_a_tasks_own_axis_names_join_the_table_and_an_unknown_one_falls_back_with_one_warning(mesh42: Mesh) -> None:
    assert sh.rule_table("tensor", {"gates": {"tensor": "model"}})["gates"] == "model"
    assert sh.rule_table("fsdp", {"gates": {"tensor": "model"}})["gates"] is None  # not mentioned: whole
    task = FakeTask(logical_axes={"gates": {"fsdp": None}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.plan(dataclasses.replace(task, logical_axes={}), Cfg(), mesh42, optax.adam(1e-3))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "model/up/kernel: unknown logical axis 'gates'" in messages[0], messages
    assert "Task.logical_axes" in messages[0]


@pytest.mark.parametrize(("axes", "problem"), [
    ({"gates": {"tensr": "model"}}, "unknown rule 'tensr'"),
    ({"gates": {"tensor": "mo del"}}, "mesh axis 'mo del' is not a name"),
    ({"gates": {"tensor": ("model", 3)}}, "is not a name, a tuple of names or None"),
    ({"gates": "model"}, "not a mapping"),
])
def test_a_bad_axis_declaration_is_one_clear_error(axes: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        sh.rule_table("tensor", axes)


def test_an_unknown_rule_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="--rule: expected one of replicated, fsdp, tensor, fsdp_tensor"):
        sh.rule_table("zero3")


def test_micro_batch_k_holds_rows_k_k_plus_K_and_so_on() -> None:
    rows = jnp.arange(12)[:, None] * jnp.ones((1, 3), jnp.int32)
    micro = steps.micro_batches({"x": rows}, 4)["x"]
    assert micro.shape == (4, 3, 3)
    assert [int(r) for r in micro[1, :, 0]] == [1, 5, 9]


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(3, 8, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(jnp.tanh(self.a(x)))[:, 0]


def weighted_loss(model: Mlp, batch: dict) -> tuple[jax.Array, dict]:
    """A mean over the rows the mask keeps: micro-batches hold different numbers of them."""
    error = (model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]
    count = batch["mask"].sum()
    value = error.sum() / jnp.maximum(count, 1.0)
    return value, {"loss": value, "rows": count}


@pytest.mark.parametrize("k", [2, 4, 8])
def test_accumulated_micro_batches_give_the_whole_batchs_gradient_and_metrics(k: int) -> None:
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32), "y": jnp.asarray(rng.normal(size=16), jnp.float32),
             "mask": jnp.asarray(rng.integers(0, 2, 16), jnp.float32)}
    model = Mlp(nnx.Rngs(0))
    graphdef, start = nnx.split({"model": model, "optimizer": nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)})
    whole = jax.jit(lambda s, b: steps.train_step_fn(weighted_loss, graphdef, s, b, weight="rows"))
    split = jax.jit(lambda s, b: steps.train_step_fn(weighted_loss, graphdef, s, b, accum_steps=k, weight="rows"))
    (a, ma), (b, mb) = whole(start, batch), split(start, batch)
    assert float(mb["rows"]) == float(ma["rows"]) == float(batch["mask"].sum())
    assert float(mb["loss"]) == pytest.approx(float(ma["loss"]), rel=1e-6)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_a_typed_rng_key_is_compared_as_the_key_data_a_checkpoint_holds() -> None:
    from job.parallel.trees import leaf_specs

    assert leaf_specs({"key": jax.random.key(0)}) == {"key": ((2,), "uint32")}
    assert leaf_specs({"key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}) == {"key": ((2,), "uint32")}


@dataclasses.dataclass(frozen=True)
class Decay:
    decay: float


def test_an_ema_is_placed_like_the_model_and_follows_it_after_each_update(mesh42: Mesh) -> None:
    planned = state.plan(FakeTask(), Cfg(ema=Decay(0.5)), mesh42, optax.sgd(0.1))
    leaves = dict(nnx.to_flat_state(planned.abstract))
    assert (leaves[("ema", "model", "up", "kernel")].get_value().sharding
            == leaves[("model", "up", "kernel")].get_value().sharding)
    before = planned.init()
    x = jnp.ones((8, 16), jnp.float32)

    def loss(model: Net, batch: dict) -> tuple[jax.Array, dict]:
        value = jnp.mean(model(batch["x"]) ** 2)
        return value, {"loss": value}

    step = jax.jit(lambda s, b: steps.train_step_fn(loss, planned.graphdef, s, b))
    old = nnx.merge(planned.graphdef, before)["model"].up.kernel.get_value()
    after, _ = step(jax.tree.map(lambda a: a.copy(), before), {"x": x})
    nodes = nnx.merge(planned.graphdef, after)
    new = nodes["model"].up.kernel.get_value()
    np.testing.assert_allclose(np.asarray(nodes["ema"].model.up.kernel.get_value()),
                               0.5 * np.asarray(old) + 0.5 * np.asarray(new), rtol=1e-6)
    metrics = jax.jit(lambda s, b: steps.eval_step_fn(loss, planned.eval_graphdef, s, b))(after, {"x": x})
    assert sorted(metrics) == ["ema_loss", "loss"] and float(metrics["ema_loss"]) != float(metrics["loss"])


class ClosureBlocks(nnx.Module):
    """A block held by a closure, as one public tutorial writes its blocks: its layer is no attribute, so it is
    outside the state, and its arrays are the tracers of the abstract build that made it."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(3, 8, rngs=rngs)
        dense = nnx.Linear(8, 8, rngs=rngs)

        def block(x: jax.Array) -> jax.Array:
            return nnx.relu(dense(x))

        self.block = block
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.block(self.inp(x)))[:, 0]


@dataclasses.dataclass(frozen=True)
class ClosureTask:
    logical_axes: dict = dataclasses.field(default_factory=dict)

    def build(self, cfg: object, rngs: nnx.Rngs) -> ClosureBlocks:
        return ClosureBlocks(rngs)


def mse(model: ClosureBlocks, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    value = ((model(batch["x"]) - batch["y"]) ** 2).mean()
    return value, {"loss": value}


def test_a_tracer_leaked_by_a_closure_built_layer_is_told_its_likely_cause_at_the_first_step(mesh42: Mesh) -> None:
    planned = state.plan(ClosureTask(), Cfg(rule="replicated"), mesh42, optax.sgd(0.1))
    train_step: Any = steps.jit_train_step(mse, planned.graphdef, planned.shardings)  # a jax.jit: it has .lower
    batch = {"x": jnp.ones((8, 3), jnp.float32), "y": jnp.zeros((8,), jnp.float32)}
    with sh.mesh_context(mesh42), pytest.raises(jax.errors.UnexpectedTracerError) as err, steps.leaked_tracer_note():
        train_step.lower(planned.init(), batch).compile()  # as the loop compiles ahead (this passes), then calls it
        train_step(planned.init(), batch)
    assert err.value.__notes__[-1] == steps.LEAKED_TRACER_NOTE  # after jax's own note
    assert "create every sub-layer in __init__ as an attribute" in steps.LEAKED_TRACER_NOTE
    with pytest.raises(ValueError) as other, steps.leaked_tracer_note():  # any other error passes untouched
        raise ValueError("not a tracer")
    assert steps.LEAKED_TRACER_NOTE not in getattr(other.value, "__notes__", [])
