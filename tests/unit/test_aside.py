"""Programs compiled on threads of their own while the loop compiles its train step (job/train/aside.py): a fresh
state's init, and the eval step for the state's abstract shapes under the policy remat auto tries first, taken
by the evaluator only where it is the chosen policy's program; each compile's failure raised where its program
is asked for, and a run stopping early waiting for what is still compiling."""

from __future__ import annotations

import concurrent.futures
import threading
import types
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from job import sharding
from job.kernels.rematerialize import choosing, resolve
from job.train import aside
from job.train.evaluation import Evaluator
from job.train.steps import jit_eval_step


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The name of the thread of every program XLA compiles from here on."""
    threads: list[str] = []
    compile_lowered = jax.stages.Lowered.compile

    def compile_noted(self: jax.stages.Lowered, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return compile_lowered(self, *args, **kwargs)

    def backend_compile(event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            threads.append(f"backend: {threading.current_thread().name}")

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_noted)
    jax.monitoring.register_event_duration_secs_listener(backend_compile)
    try:
        yield threads
    finally:
        jax.monitoring.unregister_event_duration_listener(backend_compile)


def _init(fail: bool = False) -> jax.stages.Wrapped:
    def create() -> dict[str, jax.Array]:
        if fail:
            raise ValueError("the model's constructor failed")
        return {"w": jax.random.normal(jax.random.key(3), (64, 32)), "step": jnp.zeros((), jnp.int32)}
    return jax.jit(create)


def test_the_init_compiled_aside_creates_the_state_of_the_init_called_on_a_thread_of_its_own(
        compiles: list[str]) -> None:
    init = aside.InitAside(_init())
    made = init()
    init.settle()  # done: returns at once
    assert compiles == ["job-init-compile", "backend: job-init-compile"]
    expected = _init()()
    assert jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)) and a.dtype == b.dtype, made, expected) == {
        "w": True, "step": True}


def test_an_init_that_fails_raises_where_it_is_called_and_settles_quietly() -> None:
    with pytest.raises(ValueError, match="constructor failed"):  # traced on the caller's thread: raised there
        aside.InitAside(_init(fail=True))
    init = aside.InitAside(jax.jit(lambda: jnp.zeros((4, 4))))
    init.settle()
    init._aside._compiled = concurrent.futures.Future()  # a compile that failed on its thread
    init._aside._compiled.set_exception(RuntimeError("XLA could not compile it"))
    init.settle()  # the run's own error is the one raised, not this
    with pytest.raises(RuntimeError, match="could not compile"):
        init()


def test_a_fresh_start_compiles_its_init_aside_and_a_resumed_one_only_if_it_is_called() -> None:
    assert isinstance(aside.init_aside(_init(), 0), aside.InitAside)
    called = aside.init_aside(_init(), 12)  # restored: compiled only if it is called
    assert isinstance(called, aside.InitCalled) and called()["step"] == 0
    called.settle()


class Table:
    """A finite split of 37 rows: the full pass's batches take three shapes on 4 data shards."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(37, 6)).astype(np.float32)
        self.y = rng.integers(0, 3, 37).astype(np.int32)

    def split_size(self, split: str) -> int:
        return 37

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        return {"x": self.x[start:stop], "y": self.y[start:stop]}


def plain_loss(model: nnx.Module, batch: dict) -> tuple:
    logits = model(batch["x"])
    value = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1))
    return value, {"loss": value}


def policy_reading_loss(model: nnx.Module, batch: dict) -> tuple:
    """A model that reads remat auto's policy itself: its forward pass differs under `dots`."""
    value, metrics = plain_loss(model, batch)
    scale = 2.0 if resolve("auto") == "dots" else 1.0
    return value * scale, {"loss": metrics["loss"] * scale}


MESH = sharding.make_mesh(model_axis=2)  # data 4 x model 2


def _evaluator(loss: Any) -> tuple[Evaluator, Any, Any, Any]:
    """An evaluator of `loss` on MESH, the state placed on it, its abstract shapes, and the graphdef."""
    mesh = MESH
    graphdef, state = nnx.split({"model": nnx.Linear(6, 3, rngs=nnx.Rngs(0))})
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    evaluator = Evaluator(jit_eval_step(loss, graphdef), Table(), mesh, splits=("test",), global_batch=16,
                          batches=1, full=True, weight=None)
    return evaluator, state, abstract, graphdef


def _aside(loss: Any, evaluator: Evaluator, abstract: Any, graphdef: Any) -> aside.EvalAside:
    step = jit_eval_step(loss, graphdef)
    with sharding.mesh_context(MESH), choosing("none"):
        return aside.EvalAside(step, "none", evaluator.lower(abstract, step))


def test_the_eval_step_compiled_aside_for_the_abstract_state_is_taken_and_its_evaluation_compiles_nothing(
        compiles: list[str]) -> None:
    evaluator, state, abstract, graphdef = _evaluator(plain_loss)
    reference = Evaluator(jit_eval_step(plain_loss, graphdef), Table(), MESH, splits=("test",),
                          global_batch=16, batches=1, full=True, weight=None)
    with sharding.mesh_context(MESH):
        expected = reference.run(state)
        compiles.clear()
        evals = _aside(plain_loss, evaluator, abstract, graphdef)
        assert evals.take(evaluator, state, "none")
        shapes = len({(p.rows, p.whole) for p in evaluator.plan["test"]})
        assert shapes == 3 and compiles == ["job-eval-compile", "backend: job-eval-compile"] * shapes
        got = evaluator.run(state)
        evals.settle()
    assert compiles == ["job-eval-compile", "backend: job-eval-compile"] * shapes  # the calls found each compiled
    assert got == expected


def test_another_policy_chosen_takes_the_aside_only_where_its_program_is_the_same(compiles: list[str]) -> None:
    # a model that does not read the policy: one forward program under every policy, the aside's is taken
    evaluator, state, abstract, graphdef = _evaluator(plain_loss)
    with sharding.mesh_context(MESH):
        evals = _aside(plain_loss, evaluator, abstract, graphdef)
        assert evals.take(evaluator, state, "dots")
        compiles.clear()
        evaluator.run(state)
    assert compiles == []

    # one that reads it: the evaluator keeps its own step, compiled under the chosen policy, giving its numbers
    evaluator, state, abstract, graphdef = _evaluator(policy_reading_loss)
    with sharding.mesh_context(MESH):
        evals = _aside(policy_reading_loss, evaluator, abstract, graphdef)
        assert not evals.take(evaluator, state, "dots")
        with choosing("dots"):
            evaluator.compile(state)
        compiles.clear()
        got = evaluator.run(state)
    assert compiles == []
    with sharding.mesh_context(MESH), choosing("none"):
        plain = Evaluator(jit_eval_step(policy_reading_loss, graphdef), Table(), MESH,
                          splits=("test",), global_batch=16, batches=1, full=True, weight=None).run(state)
    assert got["test"]["loss"] == pytest.approx(2 * plain["test"]["loss"], rel=1e-6)


def test_an_aside_compile_that_failed_raises_under_its_own_policy_and_is_passed_over_under_another() -> None:
    evaluator, state, abstract, graphdef = _evaluator(plain_loss)
    with sharding.mesh_context(MESH):
        evals = _aside(plain_loss, evaluator, abstract, graphdef)
        evals.settle()
        evals._aside._compiled = concurrent.futures.Future()  # a compile that failed on its thread
        evals._aside._compiled.set_exception(RuntimeError("XLA could not compile it"))
        evals.settle()  # a run stopping early raises its own error, not this
        with pytest.raises(RuntimeError, match="could not compile"):
            evals.take(evaluator, state, "none")
        own = evaluator._step
        assert not evals.take(evaluator, state, "dots") and evaluator._step is own


def test_a_run_without_evaluation_compiles_no_eval_step_aside() -> None:
    evaluator = types.SimpleNamespace(plan={})
    evals = aside.eval_aside(types.SimpleNamespace(), evaluator, None, "none")  # type: ignore[arg-type]
    assert isinstance(evals, aside.NoEvalAside) and evals.take(None, None, "none")  # type: ignore[arg-type]
    evals.settle()
