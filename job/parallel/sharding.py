"""Sharding helpers for Flax NNX models: a drop-in for GenSBI's, name for name.

Annotations are inert metadata, so building a model never needs a mesh; the
placement happens once, in `shard_model`, against a ("data", "model") mesh:

    from flax import nnx
    from job import sharding as sh

    layer = nnx.Linear(64, 256, kernel_metadata=sh.axes("embed", "mlp"),
                       rngs=nnx.Rngs(0))
    mesh = sh.make_mesh(model_axis=1)              # all devices on "data"
    sh.shard_model(layer, mesh, rule="replicated")  # or "fsdp", "tensor"
    batch = sh.shard_batch({"x": x}, mesh)          # leading axis over "data"
    with sh.mesh_context(mesh):
        ...
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from job.core.errors import ConfigError
from job.parallel.mesh import check_model_axis, equal_slices, hybrid_mesh, spans_slices
from job.parallel.trees import is_array, path_str

log = logging.getLogger(__name__)

T = TypeVar("T")

DATA_AXIS = "data"
MODEL_AXIS = "model"
LOGICAL_AXES: tuple[str, ...] = ("embed", "mlp", "heads", "vocab", "in", "out")
# the leading dimension of a stack of layers made by nnx.vmap and run by nnx.scan (transform_metadata
# {nnx.PARTITION_NAME: "layers"}, as flax's and MaxText's scanned models name it): every rule keeps it whole
LAYERS_AXIS = "layers"

_FSDP = {"embed": DATA_AXIS}
_TENSOR = {"mlp": MODEL_AXIS, "heads": MODEL_AXIS, "vocab": MODEL_AXIS}
RULES: Mapping[str, tuple[tuple[str, str | None], ...]] = types.MappingProxyType({
    "replicated": tuple((name, None) for name in LOGICAL_AXES),
    "fsdp": tuple((name, _FSDP.get(name)) for name in LOGICAL_AXES),
    "tensor": tuple((name, _TENSOR.get(name)) for name in LOGICAL_AXES),
})
# what --rule accepts: RULES (the seed-parity table) and both at once on a 2-D mesh, "embed" over
# "data" and the tensor-parallel axes over "model"
TRAIN_RULES: Mapping[str, tuple[tuple[str, str | None], ...]] = types.MappingProxyType({
    **RULES, "fsdp_tensor": tuple((name, _FSDP.get(name, _TENSOR.get(name))) for name in LOGICAL_AXES)})
del _FSDP, _TENSOR
UNANNOTATED = "an nnx.Param without a sharding annotation"


def axes(*names: str | None) -> dict[str, Any]:
    """Metadata for an `nnx.Variable` or a layer's `*_metadata` argument."""
    return {"out_sharding": names, "eager_sharding": False}


def partitioned(init: Callable[..., Any], names: Sequence[str | None]) -> Callable[..., Any]:
    """Wrap an initializer so its Variable carries the logical axis `names`."""
    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


def make_mesh(devices: Sequence[jax.Device] | None = None, model_axis: int = 1) -> Mesh:
    """A ("data", "model") mesh with Auto axes; data = len(devices) // model_axis.

    Devices of several slices (GPU nodes, TPU slices) give a hybrid mesh: "data"
    runs across slices, each "model" group stays inside one slice.
    """
    devices = list(jax.devices() if devices is None else devices)
    if spans_slices(devices):
        return _multi_slice_mesh(devices, model_axis)
    n = len(devices)
    if (n == 0 or isinstance(model_axis, bool) or not isinstance(model_axis, int)
            or model_axis < 1 or n % model_axis):
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigError(
            "make_mesh(model_axis=...)", expected=f"a positive divisor of the device count {n}",
            found=model_axis, fix=f"use one of {divisors}")
    return jax.make_mesh((n // model_axis, model_axis), (DATA_AXIS, MODEL_AXIS),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def _multi_slice_mesh(devices: list[Any], model_axis: int) -> Mesh:
    """The hybrid ("data", "model") mesh of devices that span several slices."""
    what = "make_mesh(devices=...)"
    per_slice, slices = equal_slices(devices, what)
    check_model_axis(model_axis, per_slice, slices, "make_mesh(model_axis=...)")
    return hybrid_mesh(devices, (len(devices) // model_axis, model_axis), (DATA_AXIS, MODEL_AXIS), what)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """Every mesh axis but "model": the axes a batch's leading dimension spans."""
    return tuple(name for name in mesh.axis_names if name != MODEL_AXIS)


def batch_size_divisor(mesh: Mesh) -> int:
    """How many data-parallel shards a batch is split into."""
    return math.prod(mesh.shape[name] for name in batch_axes(mesh))


def batch_sharding(mesh: Mesh, whole: int = 0) -> NamedSharding:
    """How a global batch is laid out: after `whole` leading axes kept whole (a stack of micro-batches has
    one), the next axis is split over the batch axes of `mesh`; the rest stay whole."""
    return NamedSharding(mesh, PartitionSpec(*(None,) * whole, batch_axes(mesh)))


AxisRules = Mapping[str, Mapping[str, str | None]]  # {logical name: {rule: mesh axis or None}}


def rule_table(rule: str, logical_axes: AxisRules | None = None) -> dict[str, str | None]:
    """{logical axis name: mesh axis or None} of `rule`: the built-in table merged with a task's own
    names (`Task.logical_axes`, e.g. {"experts": {"tensor": "model"}}); a rule a name does not mention
    keeps that dimension whole. Every rule knows LAYERS_AXIS, a scanned stack's layer dimension, and keeps
    it whole unless the task maps it."""
    if rule not in TRAIN_RULES:
        raise ConfigError("--rule", expected=f"one of {', '.join(TRAIN_RULES)}", found=rule,
                          fix="pass --rule replicated (every array whole on every device), fsdp, tensor "
                          "or fsdp_tensor")
    table = {**dict(TRAIN_RULES[rule]), LAYERS_AXIS: None}
    for name, by_rule in (logical_axes or {}).items():
        problem = _axis_rule_problem(name, by_rule)
        if problem:
            raise ConfigError(f"logical axis {name!r}", expected="{rule: 'data', 'model' or None} with rules "
                              f"from {', '.join(TRAIN_RULES)}", found=f"{by_rule!r} ({problem})",
                              fix=f"declare it like logical_axes={{{name!r}: {{'tensor': 'model'}}}}")
        table[name] = by_rule.get(rule)
    return table


def _axis_rule_problem(name: Any, by_rule: Any) -> str:
    if not isinstance(name, str) or not name:
        return "the name is not a non-empty string"
    if not isinstance(by_rule, Mapping):
        return "not a mapping of rule names"
    for rule, axis in by_rule.items():
        if rule not in TRAIN_RULES:
            return f"unknown rule {rule!r}"
        if axis not in (DATA_AXIS, MODEL_AXIS, None):
            return f"mesh axis {axis!r} is neither {DATA_AXIS!r}, {MODEL_AXIS!r} nor None"
    return ""


def _spec_for(names: Any, shape: tuple[int, ...], rule: Mapping[str, str | None],
              mesh: Mesh) -> tuple[PartitionSpec | None, str]:
    """The spec for one annotated variable, or (None, why it cannot be used)."""
    if not isinstance(names, (tuple, list, PartitionSpec)):
        return None, f"annotation {names!r} is not a tuple of logical axis names"
    names = tuple(names)
    if len(names) != len(shape):
        return None, f"{len(names)} names {names} for an array of rank {len(shape)} {shape}"
    spec: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for dim, entry in zip(shape, names):
        group = entry if isinstance(entry, tuple) else (entry,)
        mesh_axes: list[str] = []
        for name in group:
            if name is None:
                continue
            if name not in rule:
                return None, f"unknown logical axis {name!r} (known: {', '.join(rule)})"
            axis = rule[name]
            if axis is None:
                continue
            if axis not in mesh.shape:
                return None, f"{name!r} maps to mesh axis {axis!r}, absent from mesh axes {mesh.axis_names}"
            if axis in used:
                return None, f"mesh axis {axis!r} used by two dimensions"
            used.add(axis)
            mesh_axes.append(axis)
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if dim % size:
            return None, f"dimension {dim} ({entry!r}) not divisible by mesh size {size} of {tuple(mesh_axes)}"
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    while spec and spec[-1] is None:  # canonical form: fully replicated is P()
        spec.pop()
    return PartitionSpec(*spec), ""


def placement(state: Any, mesh: Mesh, rule: str = "replicated",
              logical_axes: AxisRules | None = None) -> tuple[Any, list[str]]:
    """(the NamedSharding of every array of an NNX state, the variables that fell back to replicated).

    `state` may be abstract (`nnx.eval_shape`): only each variable's shape and annotation are read,
    so the placement is known before any array exists. Annotated variables follow `rule_table`;
    unannotated ones replicate, and so does one whose annotation cannot be used. The fallbacks name
    those annotations and, under every rule but "replicated", each `nnx.Param` without one (other
    variables, such as rng state and optimizer moments without a source annotation, replicate
    silently)."""
    table = rule_table(rule, logical_axes)  # the rule's names and a task's own, LAYERS_AXIS among them
    fallbacks: list[str] = []

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
            found, why = _spec_for(names, tuple(value.shape), table, mesh)
            if found is None:
                fallbacks.append(f"{path_str(path)}: {why}")
            else:
                spec = found
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return shardings, fallbacks


def fallback_warning(what: str, fallbacks: Sequence[str], mesh: Mesh,
                     table: Mapping[str, str | None]) -> str:
    """The one warning that lists every variable placed replicated against its annotation."""
    return (f"{what}: {len(fallbacks)} variable(s) fell back to replicated:\n  " + "\n  ".join(fallbacks)
            + "\nFix: annotate with job.sharding.axes(...) using one name per dimension from "
            f"{tuple(table)} (None for a dimension kept whole; a task declares more in Task.logical_axes), "
            f"and sizes divisible by the mesh axes {dict(mesh.shape)}")


def shard_model(node: Any, mesh: Mesh, rule: str = "replicated") -> Any:
    """Place every variable of an NNX graph node (model, Optimizer, EMA) on `mesh`, in place.

    Annotated variables follow `RULES[rule]`; unannotated ones replicate, and so
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
        warnings.warn(f"sharding rule {rule!r} is experimental; 'replicated' is the tested default",
                      UserWarning, stacklevel=2)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        warnings.warn(f"mesh has Explicit axes {mesh.axis_types}; these helpers expect Auto axes. "
                      "Fix: build the mesh with job.sharding.make_mesh", UserWarning, stacklevel=2)
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
        warnings.warn(fallback_warning(f"shard_model(rule={rule!r})", fallbacks, mesh, rule_table(rule)),
                      UserWarning, stacklevel=2)
    return node


def _batch_spec(mesh: Mesh) -> PartitionSpec:
    names = batch_axes(mesh)
    if not names:
        return PartitionSpec()
    return PartitionSpec(names[0] if len(names) == 1 else names)


def shard_batch(batch: T, mesh: Mesh) -> T:
    """Split the leading axis of every array leaf over the batch axes of `mesh`.

    Single-process semantics (`jax.device_put` of a global array). With several
    processes, each holding its own slice, use
    `jax.make_array_from_process_local_data` instead. Non-array leaves and
    0-d arrays pass through / replicate.
    """
    divisor = batch_size_divisor(mesh)
    sharded = NamedSharding(mesh, _batch_spec(mesh))
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(path: Any, x: Any) -> Any:
        if not is_array(x):
            return x
        if x.ndim == 0:
            return jax.device_put(x, replicated)
        if x.shape[0] % divisor:
            raise ConfigError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'}",
                expected=f"a leading size that is a multiple of {divisor} (data-parallel shards)",
                found=x.shape[0], fix=_size_fix(x.shape[0], divisor))
        return jax.device_put(x, sharded)

    return jax.tree_util.tree_map_with_path(place, batch)


def shard_sample_init(x: T, mesh: Mesh) -> T:
    """Shard the sample used to initialise a model: same as `shard_batch`."""
    return shard_batch(x, mesh)


def replicate(tree: T, mesh: Mesh) -> T:
    """Put every array leaf of `tree` fully replicated on `mesh`."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if is_array(x) else x, tree)


def _size_fix(size: int, divisor: int) -> str:
    return (f"use a batch size that is a multiple of {divisor}, "
            f"e.g. {max(divisor, -(-size // divisor) * divisor)}")


def check_batch_divisible(batch: Any, mesh: Mesh, what: str = "batch") -> int:
    """Raise ConfigError unless all array leaves share a leading size divisible by the DP count.

    Returns that leading size (0 when the batch has no array leaves with a leading axis).
    """
    sizes = {int(x.shape[0]) for x in jax.tree.leaves(batch) if is_array(x) and x.ndim > 0}
    if len(sizes) > 1:
        raise ConfigError(what, expected="array leaves with one common leading size",
                          found=sorted(sizes), fix="give every array in the batch the same first dimension")
    if not sizes:
        return 0
    size = sizes.pop()
    divisor = batch_size_divisor(mesh)
    if size % divisor:
        raise ConfigError(
            what, expected=f"a leading size that is a multiple of {divisor} (data-parallel shards "
            f"over {batch_axes(mesh)})", found=size, fix=_size_fix(size, divisor))
    return size


def sharding_of(node: Any) -> dict[str, Any]:
    """{"a/b/c": sharding} for every state leaf of an NNX node (None for non-arrays)."""
    return {path_str(path): getattr(var.get_value(), "sharding", None)
            for path, var in nnx.to_flat_state(nnx.state(node))}


def resolve_mesh(spec: Mesh | str | Mapping[str, Any] | None) -> Mesh | None:
    """None -> None; Mesh -> itself; "auto" -> make_mesh(); dict -> make_mesh(**spec)."""
    if spec is None or isinstance(spec, Mesh):
        return spec
    if isinstance(spec, str) and spec == "auto":
        return make_mesh()
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"devices", "model_axis"})
        if unknown:
            raise ConfigError("mesh spec keys", expected="a subset of ['devices', 'model_axis']",
                              found=unknown, fix="remove the unknown keys")
        return make_mesh(**spec)
    raise ConfigError("mesh", expected="None, a jax.sharding.Mesh, 'auto' or a dict of make_mesh arguments",
                      found=spec, fix="pass mesh='auto' or e.g. {'model_axis': 1}")


def pad_for_mesh(n: int, mesh: Mesh) -> tuple[int, int]:
    """(n rounded up to a multiple of the data-parallel count, n)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError("pad_for_mesh(n)", expected="a non-negative int", found=n,
                          fix="pass the number of samples")
    divisor = batch_size_divisor(mesh)
    return -(-int(n) // divisor) * divisor, int(n)


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """`with mesh_context(mesh):` enters `jax.set_mesh(mesh)`; a no-op for None."""
    if mesh is None:
        yield None
        return
    with jax.set_mesh(mesh):
        yield mesh


__all__ = [
    "DATA_AXIS", "LAYERS_AXIS", "LOGICAL_AXES", "MODEL_AXIS", "RULES", "TRAIN_RULES", "AxisRules", "axes", "batch_axes",
    "batch_size_divisor", "check_batch_divisible", "fallback_warning", "make_mesh", "mesh_context",
    "pad_for_mesh", "partitioned", "placement", "replicate", "resolve_mesh", "rule_table",
    "shard_batch", "shard_model", "shard_sample_init", "sharding_of",
]
