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
import contextvars
import logging
import math
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from job.core.errors import ConfigError
from job.parallel.annotations import grouped
from job.parallel.mesh import check_model_axis, equal_slices, hybrid_mesh, spans_slices
from job.parallel.trees import is_array, path_str

log = logging.getLogger(__name__)

T = TypeVar("T")

DATA_AXIS = "data"
MODEL_AXIS = "model"
EXPERT_AXIS = "expert"  # a mixture of experts' experts (and, for every other layer, more data parallelism)
SEQUENCE_AXIS = "sequence"  # activations split along the sequence (a model's constraints name it "length")
# the mesh axes the presets name; a mesh without one of them keeps what maps to it whole
KNOWN_AXES: tuple[str, ...] = (DATA_AXIS, MODEL_AXIS, EXPERT_AXIS, SEQUENCE_AXIS)
# GenSBI's vocabulary, exactly (DESIGN.md §3): a program that checks the shared names against this
# package finds them unchanged
LOGICAL_AXES: tuple[str, ...] = ("embed", "mlp", "heads", "vocab", "in", "out")
# the leading dimension of a stack of layers made by nnx.vmap and run by nnx.scan (transform_metadata
# {nnx.PARTITION_NAME: "layers"}, as flax's and MaxText's scanned models name it): every rule keeps it whole
LAYERS_AXIS = "layers"

MeshAxes = str | tuple[str, ...] | None  # what a logical axis maps to: a mesh axis, several, or none (whole)

_FSDP: dict[str, MeshAxes] = {"embed": DATA_AXIS}
_TENSOR: dict[str, MeshAxes] = {"mlp": MODEL_AXIS, "heads": MODEL_AXIS, "vocab": MODEL_AXIS}
# GenSBI's rules, exactly: "replicated" keeps every name whole, "fsdp" splits embed over "data", "tensor"
# mlp, heads and vocab over "model"
RULES: Mapping[str, tuple[tuple[str, str | None], ...]] = types.MappingProxyType({
    "replicated": tuple((name, None) for name in LOGICAL_AXES),
    "fsdp": tuple((name, DATA_AXIS if name in _FSDP else None) for name in LOGICAL_AXES),
    "tensor": tuple((name, MODEL_AXIS if name in _TENSOR else None) for name in LOGICAL_AXES),
})
# the names the training loop knows besides GenSBI's: experts (a mixture's expert dimension), an
# activation's batch and length (what `constrain` lays out)
TRAIN_LOGICAL_AXES: tuple[str, ...] = (*LOGICAL_AXES, "experts", "batch", "length")
# in every training rule: experts over "expert", an activation's batch over the batch axes, its length over
# "sequence"
_EVERY: dict[str, MeshAxes] = {"experts": EXPERT_AXIS, "batch": (DATA_AXIS, EXPERT_AXIS), "length": SEQUENCE_AXIS}
# what --rule accepts (the table `rule_table`, the loop, `constrain` and `shard_model` read): RULES over
# TRAIN_LOGICAL_AXES, and "fsdp_tensor", both at once on a 2-D mesh ("embed" over "data", the
# tensor-parallel names over "model")
TRAIN_RULES: Mapping[str, tuple[tuple[str, MeshAxes], ...]] = types.MappingProxyType({
    "replicated": tuple((name, _EVERY.get(name)) for name in TRAIN_LOGICAL_AXES),
    "fsdp": tuple((name, _FSDP.get(name, _EVERY.get(name))) for name in TRAIN_LOGICAL_AXES),
    "tensor": tuple((name, _TENSOR.get(name, _EVERY.get(name))) for name in TRAIN_LOGICAL_AXES),
    "fsdp_tensor": tuple((name, _FSDP.get(name, _TENSOR.get(name, _EVERY.get(name))))
                         for name in TRAIN_LOGICAL_AXES),
})
del _EVERY, _FSDP, _TENSOR
UNANNOTATED = "an nnx.Param without a sharding annotation"


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
    if (n == 0 or isinstance(model_axis, bool) or not isinstance(model_axis, int)
            or model_axis < 1 or n % model_axis):
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigError(
            "make_mesh(model_axis=...)", expected=f"a positive divisor of the device count {n}",
            found=model_axis, fix=f"use one of {divisors}")
    return jax.make_mesh((n // model_axis, model_axis), (DATA_AXIS, MODEL_AXIS),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def _multi_slice_mesh(devices: list[jax.Device], model_axis: int) -> Mesh:
    """The hybrid ("data", "model") mesh of devices that span several slices."""
    what = "make_mesh(devices=...)"
    per_slice, slices = equal_slices(devices, what)
    check_model_axis(model_axis, per_slice, slices, "make_mesh(model_axis=...)")
    return hybrid_mesh(devices, (len(devices) // model_axis, model_axis), (DATA_AXIS, MODEL_AXIS), what)


_MESH_FIX = "pass --mesh NAME=SIZE,... with sizes that multiply to the device count, e.g. --mesh data=-1,expert=2"


def parse_mesh(text: str) -> dict[str, int]:
    """--mesh "data=4,expert=2" -> {"data": 4, "expert": 2}: named axes in order, each a size >= 1 or -1 (the
    devices the others leave, for one axis at most). Needs no devices: `mesh_shape` fits it to a count."""
    found: dict[str, int] = {}
    for word in text.split(","):
        name, eq, size = (part.strip() for part in word.partition("="))
        if not eq or not name.isidentifier() or name in found:
            raise ConfigError("--mesh", expected="distinct NAME=SIZE words joined by commas (NAME an identifier)",
                              found=text, fix=_MESH_FIX)
        try:
            found[name] = int(size)
        except ValueError:
            found[name] = 0
        if found[name] < 1 and found[name] != -1:
            raise ConfigError("--mesh", expected=f"axis {name!r} of a size >= 1, or -1 (the devices left)",
                              found=text, fix=_MESH_FIX)
    if list(found.values()).count(-1) > 1:
        raise ConfigError("--mesh", expected="-1 for one axis at most", found=text, fix=_MESH_FIX)
    return found


def mesh_shape(axes: Mapping[str, int], devices: int, what: str = "--mesh") -> dict[str, int]:
    """`axes` (from `parse_mesh`) with its -1 filled in for `devices` devices; a ConfigError naming `what`
    unless the sizes multiply to exactly that count (the fix names a size that divides them)."""
    fixed = math.prod(size for size in axes.values() if size != -1)
    rest = devices // fixed if fixed and devices % fixed == 0 else 0
    shape = {name: rest if size == -1 else size for name, size in axes.items()}
    if math.prod(shape.values()) != devices or not all(shape.values()):
        spelled = ",".join(f"{name}={size}" for name, size in axes.items())
        raise ConfigError(what, expected=f"axis sizes whose product is the job's {_count(devices)}", found=spelled,
                          fix=_mesh_size_fix(axes, devices))
    return shape


def _mesh_size_fix(axes: Mapping[str, int], devices: int) -> str:
    """The fix for sizes that do not multiply to `devices`: the first axis whose size does not divide the devices
    the axes before it leave, with a divisor near it (`model=3 does not divide 4 devices; e.g. --mesh
    data=-1,model=2`); else one axis -1."""
    def spelled(shape: Mapping[str, int]) -> str:
        return ",".join(f"{name}={size}" for name, size in shape.items())

    first = next(iter(axes))
    whole = {name: -1 if name == first and -1 not in axes.values() else size for name, size in axes.items()}
    left = devices
    for name, size in axes.items():
        if size == -1 or left % size == 0:
            left //= max(size, 1)  # -1 takes what is left at the end
            continue
        others = math.prod(s for n, s in axes.items() if n != name and s != -1)
        if -1 not in axes.values() and devices % others == 0:
            suggestion = {**axes, name: -1}  # the others fit: this axis takes the devices they leave
        else:
            near = min((d for d in range(1, left + 1) if left % d == 0), key=lambda d: (abs(d - size), d))
            suggestion = {**(axes if name == first else whole), name: near}
        room = _count(left) if left == devices else f"the {_count(left)} the axes before it leave"
        return f"{name}={size} does not divide {room}; e.g. --mesh {spelled(suggestion)}"
    return f"give one axis -1 (the devices the others leave), e.g. --mesh {spelled(whole)}"


def _count(devices: int) -> str:
    return f"{devices} device{'s' if devices != 1 else ''}"


def _named_mesh(devices: list[jax.Device], axes: Mapping[str, int]) -> Mesh:
    """The mesh of `axes` over `devices`; across slices, the first axis spans them and the rest stay inside
    one (the fast network), or one ConfigError that says which axis would cross."""
    shape = mesh_shape(axes, len(devices))
    names, sizes = tuple(shape), tuple(shape.values())
    if spans_slices(devices):
        per_slice, slices = equal_slices(devices, "--mesh")
        inside = math.prod(sizes[1:])
        if sizes[0] % slices or per_slice % inside:
            raise ConfigError("--mesh", expected=f"a first axis ({names[0]!r}, across the {slices} slices or nodes) "
                              f"that is a multiple of {slices}, and the other axes within one slice's {per_slice} "
                              "devices (an axis other than the first never crosses the slower network)",
                              found=",".join(f"{n}={s}" for n, s in shape.items()),
                              fix=f"put the axis that spans nodes first and keep the product of the others a "
                                  f"divisor of {per_slice}, e.g. --mesh {names[0]}=-1,{names[-1]}=..."
                                  if len(names) > 1 else f"make {names[0]} a multiple of {slices}")
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


AxisRules = Mapping[str, Mapping[str, MeshAxes]]  # {logical name: {rule: mesh axis, axes or None}}


def rule_table(rule: str, logical_axes: AxisRules | None = None) -> dict[str, MeshAxes]:
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
            raise ConfigError(f"logical axis {name!r}", expected="{rule: a mesh axis ('data', 'model', "
                              "'expert', 'sequence' or a --mesh axis of your own), a tuple of them, or None} with "
                              f"rules from {', '.join(TRAIN_RULES)}", found=f"{by_rule!r} ({problem})",
                              fix=f"declare it like logical_axes={{{name!r}: {{'tensor': 'model'}}}}")
        table[name] = by_rule.get(rule)
    return table


def _axis_rule_problem(name: object, by_rule: object) -> str:
    if not isinstance(name, str) or not name:
        return "the name is not a non-empty string"
    if not isinstance(by_rule, Mapping):
        return "not a mapping of rule names"
    for rule, axis in by_rule.items():
        if rule not in TRAIN_RULES:
            return f"unknown rule {rule!r}"
        named = axis if isinstance(axis, tuple) else (axis,)
        if axis is not None and not all(isinstance(a, str) and a.isidentifier() for a in named):
            return f"mesh axis {axis!r} is not a name, a tuple of names or None"
    return ""


def _targets(axis: MeshAxes) -> tuple[str, ...]:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _spec_for(names: object, shape: tuple[int, ...], rule: Mapping[str, MeshAxes], mesh: Mesh | AbstractMesh,
              notes: list[str] | None = None) -> tuple[PartitionSpec | None, str]:
    """The spec for one annotated variable, or (None, why it cannot be used). A mesh axis the mesh lacks
    (one of KNOWN_AXES) leaves its dimension whole; where two dimensions map to one mesh axis, the first
    takes it and the later stays whole, as flax's logical axis rules resolve it (said in `notes`)."""
    if not isinstance(names, (tuple, list, PartitionSpec)):
        return None, f"annotation {names!r} is not a tuple of logical axis names"
    names = tuple(names)
    if len(names) != len(shape):
        return None, f"{len(names)} names {names} for an array of rank {len(shape)} {shape}"
    spec: list[str | tuple[str, ...] | None] = []
    used: dict[str, str] = {}  # mesh axis -> the logical name whose dimension took it
    for dim, entry in zip(shape, names):
        group = entry if isinstance(entry, tuple) else (entry,)
        mesh_axes: list[str] = []
        for name in group:
            if name is None:
                continue
            if name not in rule:
                return None, f"unknown logical axis {name!r} (known: {', '.join(rule)})"
            for axis in _targets(rule[name]):
                if axis not in mesh.shape:
                    if axis in KNOWN_AXES:
                        continue  # this mesh has no such axis: nothing to split over
                    return None, f"{name!r} maps to mesh axis {axis!r}, absent from mesh axes {mesh.axis_names}"
                if axis in used:
                    if notes is not None and mesh.shape[axis] > 1:
                        notes.append(f"{names}: {name!r} stays whole, mesh axis {axis!r} already splits its "
                                     f"{used[axis]!r} dimension")
                    continue
                used[axis] = entry
                mesh_axes.append(axis)
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if dim % size:
            return None, f"dimension {dim} ({entry!r}) not divisible by mesh size {size} of {tuple(mesh_axes)}"
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    while spec and spec[-1] is None:  # canonical form: fully replicated is P()
        spec.pop()
    return PartitionSpec(*spec), ""


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
            found, why = _spec_for(names, tuple(value.shape), table, mesh, noted)
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
    return _spec_for(tuple(names), tuple(shape), table, mesh)[0]


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
    "pad_for_mesh", "parse_mesh", "partitioned",
    "placement", "replicate", "resolve_mesh", "rule_table", "shard_batch", "shard_model", "shard_sample_init",
    "sharding_of", "train_batch_axes", "train_batch_size_divisor",
]
