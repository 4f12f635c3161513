"""The optimizer and the jitted train and eval steps, for any task.

The model and optimizer are split once into a graph definition and a state
pytree; the train step is a plain `jax.jit` over that state with its buffers
donated, so a call costs what a hand-written jax step costs (no NNX graph
traversal per call: `nnx.merge` runs once, while tracing).

    tx, schedule = make_optimizer(cfg.optim, cfg.steps)
    graphdef, state = nnx.split({"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)})
    train_step = jit_train_step(task.loss, graphdef, state)
    state, metrics = train_step(state, batch)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from job.optimizers import make_optimizer

Loss = Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def train_step_fn(loss: Loss, graphdef: nnx.GraphDef, state: nnx.State,
                  batch: Mapping[str, jax.Array]) -> tuple[nnx.State, dict[str, jax.Array]]:
    """One optimizer step over the global batch: (new state, the batch's metrics)."""
    nodes = nnx.merge(graphdef, state)
    (_, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(nodes["model"], batch)
    nodes["optimizer"].update(nodes["model"], grads)
    return nnx.state(nodes), metrics


def eval_step_fn(loss: Loss, graphdef: nnx.GraphDef, state: nnx.State,
                 batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    return loss(nnx.merge(graphdef, state)["model"], batch)[1]


def _shardings(state: nnx.State) -> Any:
    return jax.tree.map(lambda x: x.sharding, state)


def jit_train_step(loss: Loss, graphdef: nnx.GraphDef, state: nnx.State) -> Callable[..., Any]:
    """`train_step_fn` jitted for `state`'s layout: the state is donated and keeps its shardings."""
    return jax.jit(functools.partial(train_step_fn, loss, graphdef), donate_argnums=0,
                   out_shardings=(_shardings(state), None))


def jit_eval_step(loss: Loss, graphdef: nnx.GraphDef) -> Callable[..., Any]:
    return jax.jit(functools.partial(eval_step_fn, loss, graphdef))


__all__ = ["eval_step_fn", "jit_eval_step", "jit_train_step", "make_optimizer", "train_step_fn"]
