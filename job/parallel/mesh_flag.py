"""`--mesh`, read and checked in one place: the text's syntax, the axes' names, their sizes against the devices,
the model axis, and the fix for each (a typo's nearest name, a size that divides). The one module that
chooses between --mesh and --model-axis and words their errors. Standard library only, so `validate`, a sweep
and the doctors check a run's mesh without jax.

    axes = run_axes("data=-1,modle=2", model_axis=1)  # {"data": -1, "modle": 2}; --mesh, else --model-axis's
    check_names(axes, "data=-1,modle=2", None)         # ConfigError ... Fix: did you mean 'model'? --mesh ...
    mesh_shape({"data": -1, "model": 2}, 8)            # {"data": 4, "model": 2}, or the size that divides
    run_shape("", 3, 8)                                # ConfigError --model-axis ... Fix: pass --model-axis one of ...

`job.parallel.sharding.make_mesh` builds the mesh these checks pass (`check_model_axis` and `check_slices`
for the devices it is given); the run's mesh is `make_mesh(devices, axes=run_shape(...))`
(job/train/plan.py's `run_mesh`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping

from job.core.errors import ConfigError
from job.parallel.vocabulary import DATA_AXIS, KNOWN_AXES, MODEL_AXIS, AxisRules

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


def run_axes(mesh: str, model_axis: int) -> dict[str, int]:
    """The run's mesh axes and sizes, -1 for the devices the others leave: --mesh's text (`mesh`), else
    ("data", "model") of --model-axis. A ConfigError for a bad --mesh, or for --mesh and --model-axis both given."""
    if not mesh:
        return {DATA_AXIS: -1, MODEL_AXIS: model_axis}
    axes = parse_mesh(mesh)
    if model_axis != 1:
        raise ConfigError("--model-axis", expected="no --model-axis with --mesh (the mesh names every axis)",
                          found=f"--model-axis {model_axis} --mesh {mesh}",
                          fix=f"drop --model-axis and name the axis in the mesh: --mesh {mesh},model="
                              f"{model_axis}" if MODEL_AXIS not in axes else "drop --model-axis")
    return axes


def run_shape(mesh: str, model_axis: int, per_slice: int, slices: int = 1) -> dict[str, int]:
    """The run's mesh axes and sizes on the devices at hand (`slices` slices of `per_slice` devices each):
    `run_axes` with its -1 filled in. Each error names the flag the user gave, with its fix: --model-axis
    a divisor of one slice's devices (`check_model_axis`), --mesh sizes that multiply to the devices and an
    axis other than the first inside one slice (`check_slices`)."""
    axes = run_axes(mesh, model_axis)
    if not mesh:
        check_model_axis(model_axis, per_slice, slices, "--model-axis")
    shape = mesh_shape(axes, per_slice * slices)
    if slices > 1:
        check_slices(shape, per_slice, slices)
    return shape


def counted_shape(mesh: str, model_axis: int, devices: int) -> dict[str, int]:
    """The run's mesh axes and sizes on a job known by its device count alone (a sweep's --devices, before
    any device exists): `run_axes` with its -1 filled in, --model-axis a divisor of the count, each error
    naming the flag the user gave."""
    axes = run_axes(mesh, model_axis)
    if not mesh and (model_axis < 1 or devices % model_axis):
        divisors = [d for d in range(1, devices + 1) if devices % d == 0]
        raise ConfigError("--model-axis", expected=f"a divisor of the job's {_count(devices)}", found=model_axis,
                          fix=f"pass --model-axis one of {divisors}")
    return mesh_shape(axes, devices)


def flag_text(mesh: str, model_axis: int) -> str:
    """The flag that set the run's mesh, as the user typed it: `--mesh TEXT`, else `--model-axis N`."""
    return f"--mesh {mesh}" if mesh else f"--model-axis {model_axis}"


def check_names(axes: Mapping[str, int], mesh: str, logical_axes: AxisRules | None) -> None:
    """Every axis of `axes` (from `run_axes`; `mesh` its text) is one a rule maps a logical name to: a preset's
    (data, model, expert, sequence) or one the task declares in `logical_axes` (Task.logical_axes). Any other
    name splits nothing (a typo, `modle`, would silently turn tensor parallelism off): a ConfigError naming the
    nearest known axis."""
    known = list(dict.fromkeys((*KNOWN_AXES, *_declared(logical_axes or {}))))
    for name in axes:
        if name in known:
            continue
        close = difflib.get_close_matches(name, [k for k in known if k not in axes], n=1)  # never one it has
        declare = f"declare it in the task, e.g. logical_axes={{'mlp': {{'tensor': {name!r}}}}}"
        if close:  # a typo: the name it meant; declaring the typo is no fix
            fixed = ",".join(f"{close[0] if n == name else n}={size}" for n, size in axes.items())
            fix = f"did you mean {close[0]!r}? --mesh {fixed}"
        elif any(k in axes for k in difflib.get_close_matches(name, known, n=1)):  # a second of an axis it has
            fix = f"drop {name}={axes[name]} (the mesh already has the axis it is close to), or {declare}"
        else:
            fix = declare
        raise ConfigError("--mesh", expected=f"axes that a rule maps a logical axis to: {', '.join(known)} (or one "
                          "the task declares in Task.logical_axes)", found=f"axis {name!r} in {mesh!r}", fix=fix)


def _declared(logical_axes: AxisRules) -> Iterable[str]:
    """The mesh axes a task's logical axes map to, under any rule."""
    for by_rule in logical_axes.values():
        for target in by_rule.values():
            yield from (target,) if isinstance(target, str) else tuple(target or ())


def model_size(axes: Mapping[str, int]) -> int:
    """The size of the "model" axis of `axes` (from `run_axes`), as a task's validate checks its dimensions
    against it: 1 when the mesh has none; the devices left when it is -1, checked once the devices are known."""
    size = axes.get(MODEL_AXIS, 1)
    return 1 if size == -1 else size


def check_model_axis(model_axis: object, per_slice: int, slices: int, what: str) -> None:
    """ConfigError naming `what` unless `model_axis` is a positive divisor of the devices of one slice
    (`per_slice`; all of them when `slices` is 1): a model group never crosses slices. Where `what` is a flag
    (--model-axis) the fix passes it one of the divisors."""
    if (per_slice and not isinstance(model_axis, bool) and isinstance(model_axis, int) and model_axis >= 1
            and per_slice % model_axis == 0):
        return
    divisors = [d for d in range(1, per_slice + 1) if per_slice % d == 0]
    devices = (f"the device count {per_slice}" if slices == 1 else f"the {per_slice} devices per slice "
               f"({slices} slices of {per_slice} devices; a model group must stay inside one slice)")
    raise ConfigError(what, expected=f"a positive divisor of {devices}", found=model_axis,
                      fix=f"pass {what} one of {divisors}" if what.startswith("--") else f"use one of {divisors}")


def check_slices(shape: Mapping[str, int], per_slice: int, slices: int) -> None:
    """A --mesh of `shape` (from `mesh_shape`) over `slices` slices of `per_slice` devices: its first axis
    spans the slices and the others stay inside one (an axis other than the first never crosses the slower
    network), or one ConfigError that says which axis would cross."""
    names, sizes = tuple(shape), tuple(shape.values())
    if sizes[0] % slices == 0 and per_slice % math.prod(sizes[1:]) == 0:
        return
    raise ConfigError("--mesh", expected=f"a first axis ({names[0]!r}, across the {slices} slices or nodes) "
                      f"that is a multiple of {slices}, and the other axes within one slice's {per_slice} "
                      "devices (an axis other than the first never crosses the slower network)",
                      found=",".join(f"{n}={s}" for n, s in shape.items()),
                      fix=f"put the axis that spans nodes first and keep the product of the others a "
                          f"divisor of {per_slice}, e.g. --mesh {names[0]}=-1,{names[-1]}=..."
                          if len(names) > 1 else f"make {names[0]} a multiple of {slices}")


__all__ = ["check_model_axis", "check_names", "check_slices", "counted_shape", "flag_text", "mesh_shape", "model_size",
           "parse_mesh", "run_axes", "run_shape"]
