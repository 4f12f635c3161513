"""The rules: a rule's table of logical axis -> mesh axes (`rule_table`), and the PartitionSpec it gives one
annotated array on a mesh (`spec_for`), which placing a model's variables and constraining an activation share.

    rule_table("tensor")["mlp"]                      # "model"
    spec_for(("embed", "mlp"), (64, 256), rule_table("tensor"), mesh)  # (PartitionSpec(None, "model"), "")
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from job.core.errors import ConfigError
from job.parallel.vocabulary import KNOWN_AXES, LAYERS_AXIS, TRAIN_RULES, AxisRules, MeshAxes


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


def spec_for(names: object, shape: tuple[int, ...], rule: Mapping[str, MeshAxes], mesh: Mesh | AbstractMesh,
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


__all__ = ["rule_table", "spec_for"]
