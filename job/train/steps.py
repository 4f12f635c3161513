"""The optimizer and the jitted train and eval steps, for any task.

The model and optimizer are split once into a graph definition and a state
pytree; the train step is a plain `jax.jit` over that state with its buffers
donated, so a call costs what a hand-written jax step costs (no NNX graph
traversal per call: `nnx.merge` runs once, while tracing).

    tx, schedule = make_optimizer(cfg.optim, cfg.steps)
    graphdef, state = nnx.split({"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)})
    train_step = jit_train_step(task.loss, graphdef, state)
    with leaked_tracer_note():                 # a model that leaks tracers is told the likely cause
        state, metrics = train_step(state, batch)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from job.train.ema import EMA
from job.train.optimizers import make_optimizer

Loss = Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]
# jax's UnexpectedTracerError names the leaked value but not why a model leaks one (seen with a block held
# by a closure, as one public tutorial writes its blocks: the first step's call fails, not its compilation)
LEAKED_TRACER_NOTE = (
    "Likely cause: the task's model keeps an nnx module or variable outside its state, created inside __call__ "
    "or held only by a closure (a function that captures a layer) rather than as an attribute; the state is built "
    "under jax transformations, so that layer's arrays are tracers that escaped them. Fix: create every sub-layer "
    "in __init__ as an attribute (self.block = nnx.Linear(...), or a list of them) and call it from __call__.")


@contextlib.contextmanager
def leaked_tracer_note() -> Iterator[None]:
    """A jax.errors.UnexpectedTracerError raised inside (tracing, compiling or calling a step) leaves with
    LEAKED_TRACER_NOTE added: its likely cause in a task's model, and the fix."""
    try:
        yield
    except jax.errors.UnexpectedTracerError as exc:
        exc.add_note(LEAKED_TRACER_NOTE)
        raise


def train_step_fn(loss: Loss, graphdef: nnx.GraphDef, state: nnx.State, batch: Mapping[str, jax.Array],
                  accum_steps: int = 1, weight: str | None = None,
                  micro_sharding: jax.sharding.Sharding | None = None,
                  custom: Callable[..., Mapping[str, jax.Array]] | None = None,
                  ) -> tuple[nnx.State, dict[str, jax.Array]]:
    """One optimizer step over the global batch: (new state, the batch's metrics).

    With `accum_steps` K > 1 the batch is K micro-batches, one `lax.scan` step each, and one update
    from their summed gradients. Micro-batch k holds rows k, K + k, 2K + k, ... so that each one is
    spread over every data shard (`micro_sharding`: their placement, [K, rows / K, ...]). A task
    whose loss is a mean over `weight` items (its weight metric, e.g. "tokens") gets each micro-batch
    weighed by its items, which gives the full batch's gradient and metrics; otherwise the
    micro-batches weigh the same. `custom(nodes, batch, default)` (`Task.train_step`) replaces the
    body; `default(nodes, batch)` is the gradient step above. Then every EMA among the nodes follows
    the model."""
    def default(nodes: Mapping[str, Any], rows: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        if accum_steps == 1:
            (_, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(nodes["model"], rows)
        else:
            grads, metrics = _accumulated(loss, nodes["model"], rows, accum_steps, weight, micro_sharding)
        nodes["optimizer"].update(nodes["model"], grads)
        return metrics

    nodes = nnx.merge(graphdef, state)
    metrics = dict(custom(nodes, batch, default) if custom is not None else default(nodes, batch))
    for node in nodes.values():
        if isinstance(node, EMA):
            node.update(nodes["model"])
    return nnx.state(nodes), metrics


def micro_batches(batch: Mapping[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """[rows, ...] -> [k, rows / k, ...] with micro-batch j = rows j, k + j, 2k + j, ... (a reshape
    that keeps each data shard's rows on that shard when its row count is a multiple of k)."""
    return {name: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1) for name, x in batch.items()}


def _accumulated(loss: Loss, model: Any, batch: Mapping[str, jax.Array], k: int, weight: str | None,
                 micro_sharding: jax.sharding.Sharding | None) -> tuple[Any, dict[str, jax.Array]]:
    """(the gradient of the whole batch, its metrics) from k micro-batches in a scan."""
    graphdef, params, *others = nnx.split(model, nnx.Param, ...)
    (rest,) = others  # the state of everything but the Params
    micro = micro_batches(batch, k)
    if micro_sharding is not None:
        micro = jax.lax.with_sharding_constraint(micro, micro_sharding)

    def pure(params: nnx.State, rest: nnx.State, rows: Mapping[str, jax.Array]) -> Any:
        model = nnx.merge(graphdef, params, rest)
        value, metrics = loss(model, rows)
        return value, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

    def one(params: nnx.State, rest: nnx.State, rows: Mapping[str, jax.Array]) -> Any:
        (_, (metrics, rest)), grads = jax.value_and_grad(pure, has_aux=True)(params, rest, rows)
        return grads, metrics, rest

    def body(carry: Any, rows: Mapping[str, jax.Array]) -> Any:
        grads_sum, sums, total, rest = carry
        grads, metrics, rest = one(params, rest, rows)
        w = jax.lax.stop_gradient(metrics[weight]).astype(jnp.float32) if weight else jnp.float32(1)
        grads_sum = jax.tree.map(lambda a, g: a + g * w.astype(g.dtype), grads_sum, grads)
        sums = {name: (sums[name] + (v if name == weight else v * w)).astype(sums[name].dtype)
                for name, v in metrics.items()}
        return (grads_sum, sums, total + w, rest), None

    first = jax.tree.map(lambda x: x[0], micro)
    grad_shapes, metric_shapes, _ = jax.eval_shape(one, params, rest, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grad_shapes, metric_shapes))
    (grads_sum, sums, total, rest), _ = jax.lax.scan(body, (*zeros, jnp.float32(0), rest), micro)
    nnx.update(model, rest)
    denom = jnp.maximum(total, 1e-30)
    grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads_sum)
    return grads, {name: v if name == weight else v / denom for name, v in sums.items()}


def eval_step_fn(loss: Loss, graphdef: nnx.GraphDef, state: nnx.State, batch: Mapping[str, jax.Array],
                 weight: str | None = None) -> dict[str, jax.Array]:
    """The loss's metrics of the model on one batch, and of each EMA's model as NAME_METRIC (the weight
    metric once: it counts the batch's items, the same for both)."""
    nodes = nnx.merge(graphdef, state)
    metrics = dict(loss(nodes["model"], batch)[1])
    for name, node in nodes.items():
        if isinstance(node, EMA):
            metrics.update({f"{name}_{k}": v for k, v in loss(node.model, batch)[1].items() if k != weight})
    return metrics


def _shardings(tree: Any) -> Any:
    """The sharding of every leaf: `tree` holds arrays, or shardings already (`job.train.state.Plan`)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.sharding.Sharding) else x.sharding, tree)


def jit_train_step(loss: Loss, graphdef: nnx.GraphDef, state: nnx.State, *, accum_steps: int = 1,
                   weight: str | None = None, micro_sharding: jax.sharding.Sharding | None = None,
                   custom: Callable[..., Mapping[str, jax.Array]] | None = None) -> jax.stages.Wrapped:
    """`train_step_fn` jitted for `state`'s layout (its arrays, or their shardings): the state is
    donated and keeps its shardings."""
    step = functools.partial(train_step_fn, loss, graphdef, accum_steps=accum_steps, weight=weight,
                             micro_sharding=micro_sharding, custom=custom)
    return jax.jit(step, donate_argnums=0, out_shardings=(_shardings(state), None))


def jit_eval_step(loss: Loss, graphdef: nnx.GraphDef, weight: str | None = None) -> jax.stages.Wrapped:
    """The metrics of one batch; pass the graphdef with the model in eval mode
    (`job.train.state.Plan.eval_graphdef`) for dropout off and batch norm's running averages."""
    return jax.jit(functools.partial(eval_step_fn, loss, graphdef, weight=weight))


__all__ = ["LEAKED_TRACER_NOTE", "eval_step_fn", "jit_eval_step", "jit_train_step", "leaked_tracer_note",
           "make_optimizer", "micro_batches", "train_step_fn"]
