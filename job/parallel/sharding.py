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

The parts live in modules named for them, and this one hands their names on: the axis names and rule
tables (job/parallel/vocabulary.py), a rule's table and spec (rules.py), placing a model (placement.py),
`--mesh` read and checked (mesh_flag.py); here are the meshes, batches and activations.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from job.core.errors import ConfigError
from job.parallel.mesh import equal_slices, hybrid_mesh, spans_slices
from job.parallel.mesh_flag import check_model_axis, check_slices, mesh_shape, parse_mesh
from job.parallel.placement import UNANNOTATED, fallback_warning, placement, shard_model
from job.parallel.rules import rule_table, spec_for
from job.parallel.trees import is_array, path_str
from job.parallel.vocabulary import (DATA_AXIS, EXPERT_AXIS, KNOWN_AXES, LAYERS_AXIS, LOGICAL_AXES, MODEL_AXIS, RULES,
                                     SEQUENCE_AXIS, TRAIN_LOGICAL_AXES, TRAIN_RULES, AxisRules, MeshAxes)

T = TypeVar("T")


def axes(*names: str | None) -> dict[str, Any]:
    """Metadata for an `nnx.Variable` or a layer's `*_metadata` argument."""
    return {"out_sharding": names, "eager_sharding": False}


def partitioned(init: Callable[..., Any], names: Sequence[str | None]) -> Callable[..., Any]:
    """Wrap an initializer so its Variable carries the logical axis `names`."""
    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


def make_mesh(devices: Sequence[jax.Device] | None = None, model_axis: int = 1, *,
              axes: Mapping[str, int] | None = None) -> Mesh:
    """A ("data", "model") mesh with Auto axes; data = len(devices) // model_axis. With `axes` (e.g.
    {"data": -1, "expert": 2}, as `parse_mesh` reads --mesh), a mesh of those axes in that order (-1: the
    devices the others leave), and `model_axis` is not read.

    Devices of several slices (GPU nodes, TPU slices) give a hybrid mesh: the first axis ("data")
    runs across slices, every other axis (each "model" group) stays inside one slice.
    """
    devices = list(jax.devices() if devices is None else devices)
    if axes is not None:
        return _named_mesh(devices, axes)
    if spans_slices(devices):
        return _multi_slice_mesh(devices, model_axis)
    n = len(devices)
    check_model_axis(model_axis, n, 1, "make_mesh(model_axis=...)")
    return jax.make_mesh((n // model_axis, model_axis), (DATA_AXIS, MODEL_AXIS),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def _multi_slice_mesh(devices: list[jax.Device], model_axis: int) -> Mesh:
    """The hybrid ("data", "model") mesh of devices that span several slices."""
    what = "make_mesh(devices=...)"
    per_slice, slices = equal_slices(devices, what)
    check_model_axis(model_axis, per_slice, slices, "make_mesh(model_axis=...)")
    return hybrid_mesh(devices, (len(devices) // model_axis, model_axis), (DATA_AXIS, MODEL_AXIS), what)


def _named_mesh(devices: list[jax.Device], axes: Mapping[str, int]) -> Mesh:
    """The mesh of `axes` over `devices`; across slices, the first axis spans them and the rest stay inside
    one (the fast network), as `check_slices` checks."""
    shape = mesh_shape(axes, len(devices))
    names, sizes = tuple(shape), tuple(shape.values())
    if spans_slices(devices):
        check_slices(shape, *equal_slices(devices, "--mesh"))
        return hybrid_mesh(devices, sizes, names, "--mesh")
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)




def batch_axes(mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """Every mesh axis but "model": the axes a batch's leading dimension spans (GenSBI's; `shard_batch`)."""
    return tuple(name for name in mesh.axis_names if name != MODEL_AXIS)


def batch_size_divisor(mesh: Mesh | AbstractMesh) -> int:
    """How many data-parallel shards a batch is split into."""
    return math.prod(mesh.shape[name] for name in batch_axes(mesh))


def data_parallel_axes(mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """The axes the training loop splits a global batch's rows over: every mesh axis but "model" and "sequence"
    ("data", and "expert": the layers other than the experts are data-parallel over it; a row's positions go
    over "sequence" inside the model, by the rules' "length"). GenSBI's `batch_axes` keeps "sequence"."""
    return tuple(name for name in mesh.axis_names if name not in (MODEL_AXIS, SEQUENCE_AXIS))


def data_parallel_size(mesh: Mesh | AbstractMesh) -> int:
    """How many data-parallel shards the training loop splits a global batch into (over `data_parallel_axes`)."""
    return math.prod(mesh.shape[name] for name in data_parallel_axes(mesh))


def train_batch_axes(mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """The old name of `data_parallel_axes`, kept for a fork that calls it (with a DeprecationWarning)."""
    warnings.warn("job.sharding.train_batch_axes is now job.sharding.data_parallel_axes", DeprecationWarning,
                  stacklevel=2)
    return data_parallel_axes(mesh)


def train_batch_size_divisor(mesh: Mesh | AbstractMesh) -> int:
    """The old name of `data_parallel_size`, kept for a fork that calls it (with a DeprecationWarning)."""
    warnings.warn("job.sharding.train_batch_size_divisor is now job.sharding.data_parallel_size",
                  DeprecationWarning, stacklevel=2)
    return data_parallel_size(mesh)


def batch_sharding(mesh: Mesh, whole: int = 0) -> NamedSharding:
    """How the training loop lays a global batch out: after `whole` leading axes kept whole (a stack of
    micro-batches has one), the next axis is split over the `data_parallel_axes` of `mesh`; the rest stay whole."""
    return NamedSharding(mesh, PartitionSpec(*(None,) * whole, data_parallel_axes(mesh)))


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


def _splitting_size(size: int, divisor: int) -> int:
    """The batch size nearest above `size` that splits over `divisor` shards (at least one row each)."""
    return max(divisor, -(-size // divisor) * divisor)


def _size_fix(size: int, divisor: int) -> str:
    return f"use a batch size that is a multiple of {divisor}, e.g. {_splitting_size(size, divisor)}"


def check_global_batch(global_batch: int, accum_steps: int, mesh: Mesh | AbstractMesh) -> None:
    """--data.global-batch splits over the data-parallel devices of `mesh` (a Mesh or an AbstractMesh: the
    sweep check knows only the device count), every one of --accum-steps micro-batches too: the loop's rule,
    checked at its start and before a sweep or a doctor queues anything."""
    divisor = data_parallel_size(mesh) * accum_steps
    if global_batch % divisor:
        per = f" x --accum-steps {accum_steps}" if accum_steps > 1 else ""
        raise ConfigError(
            "--data.global-batch", expected=f"a multiple of the data-parallel size "
            f"{data_parallel_size(mesh)}{per} = {divisor}", found=global_batch,
            fix=f"use --data.global-batch {_splitting_size(global_batch, divisor)}")


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


# the rule table `constrain` reads while a model is traced: set by mesh_context(mesh, rules=...) for the
# calls inside it (a context variable: each thread and task sees its own, none outside the context)
_RULES: contextvars.ContextVar[Mapping[str, MeshAxes] | None] = contextvars.ContextVar("job_sharding_rules",
                                                                                      default=None)


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None, rules: Mapping[str, MeshAxes] | None = None) -> Iterator[Mesh | None]:
    """`with mesh_context(mesh):` enters `jax.set_mesh(mesh)`; a no-op for None. With `rules` (a
    `rule_table`), `constrain` inside lays activations out by them."""
    if mesh is None:
        yield None
        return
    token = _RULES.set(dict(rules)) if rules is not None else None
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        if token is not None:
            _RULES.reset(token)


def activation_spec(names: Sequence[str | None], shape: tuple[int, ...]) -> PartitionSpec | None:
    """How `constrain` would lay out an activation of `shape` with logical `names` under the run's rule
    table: its PartitionSpec over the mesh in context, or None outside a mesh_context with rules, or for
    a shape the mesh does not divide. A kernel that XLA cannot split (a Pallas call) runs under
    `jax.shard_map` with these specs, on each device's own block."""
    table = _RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if table is None or mesh.empty:
        return None
    return spec_for(tuple(names), tuple(shape), table, mesh)[0]


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` (an activation inside a model) laid out by the logical axis `names`, one per dimension, under the
    run's rule table: `jax.lax.with_sharding_constraint` by logical name, as flax's
    `with_logical_constraint` does. `("batch", "length", "embed")` splits a [B, L, D] activation's batch over
    the batch axes and its length over "sequence" where the mesh has them. Outside a mesh_context with rules
    (a model called on its own), and for a shape the mesh does not divide (a last partial batch), `x`
    as it is. The rules are read while a function is traced and are not part of jit's cache key: jit the
    function again (as the loop does for each run) to trace it under other rules."""
    spec = activation_spec(names, tuple(x.shape))
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


__all__ = [
    "DATA_AXIS", "EXPERT_AXIS", "KNOWN_AXES", "LAYERS_AXIS", "LOGICAL_AXES", "MODEL_AXIS", "RULES", "SEQUENCE_AXIS",
    "TRAIN_LOGICAL_AXES", "TRAIN_RULES", "UNANNOTATED", "AxisRules", "MeshAxes", "activation_spec", "axes",
    "batch_axes", "batch_sharding", "batch_size_divisor", "check_batch_divisible", "check_global_batch", "constrain",
    "data_parallel_axes", "data_parallel_size", "fallback_warning", "make_mesh", "mesh_context", "mesh_shape",
    "pad_for_mesh", "parse_mesh", "partitioned", "placement", "replicate", "resolve_mesh", "rule_table",
    "shard_batch", "shard_model", "shard_sample_init", "sharding_of", "train_batch_axes", "train_batch_size_divisor",
]
