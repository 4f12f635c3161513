"""The names sharding speaks: the mesh axes, GenSBI's logical axes and rules, and the training loop's.

Standard library only, so a config check (job/parallel/mesh_flag.py, `python -m job train --help`) reads
them without importing jax. A rule maps each logical axis (a dimension's name in a model's annotation) to a
mesh axis, several, or None (the dimension stays whole); `job.parallel.rules.rule_table` merges a rule with
a task's own names, and `job.parallel.placement` lays a model's variables out by it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

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
AxisRules = Mapping[str, Mapping[str, MeshAxes]]  # {logical name: {rule: mesh axis, axes or None}}: a task's own

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

__all__ = ["DATA_AXIS", "EXPERT_AXIS", "KNOWN_AXES", "LAYERS_AXIS", "LOGICAL_AXES", "MODEL_AXIS", "RULES",
           "SEQUENCE_AXIS", "TRAIN_LOGICAL_AXES", "TRAIN_RULES", "AxisRules", "MeshAxes"]
