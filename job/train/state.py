"""The train state, created where it lives: no process ever holds a whole copy of a sharded array.

Shapes come from an abstract evaluation of the task's build (`nnx.eval_shape`: no array is made),
shardings from the annotations and the rule (`job.sharding.placement`), and one jitted init with
those output shardings creates every array directly as its shards, the way MaxText and levanter
do. A restore fills the same abstract state, so a resumed run never builds the state it replaces.

    plan = state.plan(task, cfg, mesh, tx)
    train_state = plan.init()                    # or Checkpointer.restore_newest(plan.abstract)
    model = nnx.merge(plan.graphdef, train_state)["model"]
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from job.core import rundir, storage
from job.core.errors import ConfigError
from job.observe.process_log import FILE_ONLY
from job.parallel import sharding
from job.parallel.multihost import on_process_zero, warn_on_process_zero
from job.train.ema import EMA

log = logging.getLogger("job.train")


def count_params(model: nnx.Module) -> int:
    """Number of scalar entries over all `nnx.Param`s (of a model, or of its abstract shapes)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything known about the train state before any of its arrays exists."""

    graphdef: nnx.GraphDef  # {"model": ..., "optimizer": ..., extra state} with its modules in train mode
    eval_graphdef: nnx.GraphDef  # the same nodes in eval mode (dropout off, batch norm's running averages)
    abstract: nnx.State  # every leaf a jax.ShapeDtypeStruct carrying its NamedSharding: what restore fills
    shardings: nnx.State  # the NamedSharding of every leaf (the train step's out_shardings)
    params: int  # scalar entries over the model's nnx.Params
    init: jax.stages.Wrapped  # jitted: the initial state, each array created as its own shards


def nodes(task: Any, cfg: Any, tx: Any) -> dict[str, Any]:
    """The graph nodes a run trains: the task's model, its optimizer over the model's Params, an EMA of
    them with --ema.decay, and the task's extra state.

    Annotations stay metadata while they are built (flax's eager sharding off): a model written
    with `nnx.with_partitioning(init, ("embed", "mlp"))`, as the flax guides write it, names
    logical axes that `job.sharding` maps, not mesh axes."""
    with nnx.use_eager_sharding(False):
        model = task.build(cfg.model, nnx.Rngs(cfg.seed))
        built = {"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)}
        decay = getattr(getattr(cfg, "ema", None), "decay", 0.0)
        if decay:
            built["ema"] = EMA(model, decay)
        extra = dict(task.extra_state(cfg, model)) if getattr(task, "extra_state", None) else {}
    taken = sorted(set(extra) & set(built))
    if taken:
        raise ConfigError(f"Task.extra_state of {task.name}", expected=f"names other than {sorted(built)}",
                          found=taken, fix="rename that state")
    return {**built, **extra}


def modules(nodes: dict[str, Any]) -> list[nnx.Module]:
    """The nnx.Modules among the nodes (the model, an EMA, a task's extra models): what train() and
    eval() switch."""
    return [node for node in nodes.values() if isinstance(node, nnx.Module)]


def placed(abstract_state: nnx.State, shardings: Any) -> nnx.State:
    """Every leaf of an abstract state as a jax.ShapeDtypeStruct carrying its sharding: a restore target."""
    return jax.tree.map(lambda var, where: var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=where)),
                        abstract_state, shardings, is_leaf=_is_variable)


def plan(task: Any, cfg: Any, mesh: Mesh, tx: Any, *, evaluating: bool = False) -> Plan:
    """The placement of `task`'s train state on `mesh` under cfg.rule, and the init that creates it.

    Variables the rule cannot split as annotated replicate, all named in one UserWarning. `evaluating`
    (`python -m job eval`): the state without the optimizer (an evaluation reads every node but it), and its
    variables that replicate counted in one line, named in process 0's log file."""
    make = functools.partial(nodes, task, cfg, tx)
    if evaluating:
        make = functools.partial(_without_optimizer, make)
    abstract_nodes = nnx.eval_shape(make)
    for module in modules(abstract_nodes):
        module.eval()
    eval_graphdef, _ = nnx.split(abstract_nodes)
    for module in modules(abstract_nodes):
        module.train()
    graphdef, abstract_state = nnx.split(abstract_nodes)
    logical_axes = getattr(task, "logical_axes", None)
    notes: list[str] = []
    shardings, fallbacks = sharding.placement(abstract_state, mesh, cfg.rule, logical_axes, notes=notes)
    for note in notes:  # a dimension kept whole because an earlier one of the variable took its mesh axis
        on_process_zero(log.info, "--rule %s: %s", cfg.rule, note)
    if fallbacks and evaluating:
        _warn_evaluation_fallbacks(cfg, mesh, fallbacks)
    elif fallbacks:  # one warning for the run, from process 0
        message = sharding.fallback_warning(f"--rule {cfg.rule}", fallbacks, mesh,
                                            sharding.rule_table(cfg.rule, logical_axes))
        warn_on_process_zero(message, where=__name__)
    abstract = placed(abstract_state, shardings)

    def create() -> nnx.State:
        built = make()
        for module in modules(built):
            module.train()
        return nnx.state(built)

    params = count_params(abstract_nodes["model"])
    return Plan(graphdef=graphdef, eval_graphdef=eval_graphdef, abstract=abstract, shardings=shardings,
                params=params, init=jax.jit(create, out_shardings=shardings))


def _without_optimizer(make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The nodes `make` builds but the optimizer: what an evaluation of a checkpoint restores."""
    return {name: node for name, node in make().items() if name != "optimizer"}


def _warn_evaluation_fallbacks(cfg: Any, mesh: Mesh, fallbacks: list[str]) -> None:
    """An evaluation's one line about the variables it reads that replicate on its mesh, with their count; the
    list in process 0's log file (the training run's own warning showed each with the annotation that fits)."""
    where = rundir.process_log(storage.run_path(cfg.run_dir), 0)
    warn_on_process_zero(f"{len(fallbacks)} variable(s) the evaluation reads fell back to replicated under --rule "
                         f"{cfg.rule} on the mesh {dict(mesh.shape)} (it reads no optimizer state); the list in "
                         f"{where}", where=__name__)
    on_process_zero(logging.getLogger(FILE_ONLY).info, "--rule %s: fell back to replicated on the mesh %s:\n  %s",
                    cfg.rule, dict(mesh.shape), "\n  ".join(fallbacks))


__all__ = ["Plan", "count_params", "modules", "nodes", "placed", "plan"]
