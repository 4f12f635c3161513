"""Placement: where every variable of a Flax NNX model goes on a mesh, by its annotation and the run's rule.

`placement(state, mesh, rule)` is the answer for an abstract state (`nnx.eval_shape`), so the training loop
creates its state already placed; `shard_model` applies it to a model that exists (GenSBI's migration API).
A variable whose annotation cannot apply replicates, and every such case is said in one warning
(`fallback_warning`) with the fix.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from job.core.errors import ConfigError
from job.parallel.annotations import grouped
from job.parallel.rules import rule_table, spec_for
from job.parallel.trees import is_array, path_str
from job.parallel.vocabulary import KNOWN_AXES, RULES, AxisRules, MeshAxes

log = logging.getLogger(__name__)

UNANNOTATED = "an nnx.Param without a sharding annotation"

def placement(state: Any, mesh: Mesh, rule: str = "replicated",
              logical_axes: AxisRules | None = None, *, notes: list[str] | None = None) -> tuple[Any, list[str]]:
    """(the NamedSharding of every array of an NNX state, the variables that fell back to replicated).

    `state` may be abstract (`nnx.eval_shape`): only each variable's shape and annotation are read,
    so the placement is known before any array exists. Annotated variables follow `rule_table`;
    unannotated ones replicate, and so does one whose annotation cannot be used. The fallbacks name
    those annotations and, under every rule but "replicated", each `nnx.Param` without one (other
    variables, such as rng state and optimizer moments without a source annotation, replicate
    silently). Where two dimensions of one variable map to one mesh axis, the first takes it: `notes`,
    when given, gets one line per kind of variable (annotation) that kept a dimension whole so."""
    table = rule_table(rule, logical_axes)  # the rule's names and a task's own, LAYERS_AXIS among them
    fallbacks: list[str] = []
    noted: list[str] = []

    def place(path: tuple[Any, ...], var: Any) -> Any:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if getattr(value, "shape", None) is None:
            return None
        spec = PartitionSpec()
        names = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        if names is None:
            if rule != "replicated" and isinstance(var, nnx.Param):
                fallbacks.append(f"{path_str(path)}: {UNANNOTATED}")
        else:
            found, why = spec_for(names, tuple(value.shape), table, mesh, noted)
            if found is None:
                fallbacks.append(f"{path_str(path)}: {why}")
            else:
                spec = found
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if notes is not None:
        notes.extend(dict.fromkeys(noted))  # once per kind: an expert kernel and its Adam moments say it once
    return shardings, fallbacks


def fallback_warning(what: str, fallbacks: Sequence[str], mesh: Mesh | AbstractMesh,
                     table: Mapping[str, MeshAxes]) -> str:
    """The one warning about every variable placed replicated: those without an annotation grouped by kind of
    layer, each kind with the argument that annotates it where the layer is built (job/parallel/annotations.py),
    then those whose annotation cannot apply on this mesh, each with why."""
    bare = [entry.rpartition(": ")[0] for entry in fallbacks if entry.endswith(f": {UNANNOTATED}")]
    unusable = [entry for entry in fallbacks if not entry.endswith(f": {UNANNOTATED}")]
    lines = [f"{what}: {len(fallbacks)} variable(s) fell back to replicated on the mesh {dict(mesh.shape)}:",
             *grouped(bare)]
    if unusable:
        lines += [f"- {len(unusable)} annotated, but the annotation cannot apply here:",
                  *(f"    {entry}" for entry in unusable)]
    return "\n".join(lines) + (
        "\nFix: annotate where the layer is built, as shown, with job.sharding.axes(...): one name per dimension "
        f"from {tuple(table)} (None for a dimension kept whole; a task declares more in Task.logical_axes), and "
        f"sizes divisible by the mesh axes {dict(mesh.shape)}. Two dimensions may map to one mesh axis (the first "
        f"takes it, the later stays whole); a name must map to an axis of the mesh (--mesh) or one of {KNOWN_AXES}")


def shard_model(node: Any, mesh: Mesh, rule: str = "replicated") -> Any:
    """Place every variable of an NNX graph node (model, Optimizer, EMA) on `mesh`, in place.

    Annotated variables follow `TRAIN_RULES[rule]` (GenSBI's `RULES[rule]`, and the training names
    experts, batch and length); unannotated ones replicate, and so
    does a variable whose annotation cannot be used. One UserWarning lists
    those annotations and, under every rule but "replicated", each `nnx.Param`
    that has no annotation (other variables, such as RNG state and optimizer
    moments, replicate silently). Idempotent. Returns `node`.

    A migration API: it places arrays that already exist in full on each
    process. The training loop builds its state already placed instead
    (`job.train.state`, from the same annotations).
    """
    if rule not in RULES:
        raise ConfigError("sharding rule", expected=f"one of {sorted(RULES)}", found=rule,
                          fix="pass rule='replicated' (safe), 'fsdp' or 'tensor'")
    if rule != "replicated":
        _warn(f"sharding rule {rule!r} is experimental; 'replicated' is the tested default")
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        _warn(f"mesh has Explicit axes {mesh.axis_types}; these helpers expect Auto axes. "
              "Fix: build the mesh with job.sharding.make_mesh")
    placed = 0
    state = nnx.state(node)
    shardings, fallbacks = placement(state, mesh, rule)
    for (_, var), (_, where) in zip(nnx.to_flat_state(state), nnx.to_flat_state(shardings)):
        value = var.get_value()
        if not is_array(value):
            continue
        var.set_value(jax.device_put(value, where))
        placed += 1
    log.debug("shard_model: placed %s variables with rule %s", placed, rule)
    if fallbacks:
        _warn(fallback_warning(f"shard_model(rule={rule!r})", fallbacks, mesh, rule_table(rule)))
    return node


def _warn(message: str) -> None:
    """A UserWarning of shard_model on this process, headed `job.sharding:0: UserWarning:` without a Python source
    line under it: the message names the call and the fix."""
    warnings.warn_explicit(message, UserWarning, "job.sharding", 0)  # the public face's name


__all__ = ["UNANNOTATED", "fallback_warning", "placement", "shard_model"]
