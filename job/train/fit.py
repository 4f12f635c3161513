"""Whether a run's train step fits devices this machine does not have: compiled ahead of time for them.

    target = Target("v5litepod-1", "1 chip", devices)      # compile-only devices (deploy/tpu/fit.py makes them)
    found = fit.step_fits(cfg, task, target, larger=[Target("v5litepod-4", "4 chips", more)])
    found.fits, found.need.needed, found.need.available    # bytes per device
    raise found.error()                                      # job/train/memory.py's error, each flag checked

The step is the loop's own (`plan.train_step_of` over `plan.plan_run`'s state, on `plan.run_mesh` of the
target's devices, compiled inside the run's mesh and rules), for the state's abstract shapes and shardings
and a batch of the run's shapes: nothing is allocated. Where it does not fit, each kind of flag of
`memory.Remedy` is compiled too (the first that fits of each kind is kept): --model.remat, --accum-steps,
--data.global-batch, and --rule fsdp on the larger targets. Under an fsdp rule, `scaling` compiles the step for
two device counts and says whether its bytes per device fall with the rows (they do not for a model whose
activations XLA lays out as its parameters: the doctor names the call that fixes it); given `step_fits`'s need
for the smaller, it compiles only the larger.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from job.core import renamed
from job.core.errors import ConfigError
from job.parallel import sharding
from job.runtime import device_memory
from job.runtime.device_memory import Need, gib
from job.train import memory, plan, remat_auto
from job.train.config import TrainConfig
from job.train.memory import Remedy
from job.train.task import Task

log = logging.getLogger("job.train")

REMEDY_KINDS = ("remat", "accum_steps", "global_batch", "more_devices")  # the kinds of flag `step_fits` tries, in order


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile for: a TPU slice's, made by libtpu without a TPU (`deploy/tpu/fit.py`)."""

    name: str  # as a flag names it: 'v5litepod-4' (ACCELERATOR)
    detail: str  # what it holds: '4 chips (TPU v5 lite)'
    devices: tuple[Any, ...]  # jax devices, compile-only ones included

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class Fit:
    """What compiling the run's train step for a target found."""

    target: Target
    need: Need  # the run's own step
    remedies: tuple[Remedy, ...]  # where it does not fit: every flag compiled, each kind's first fit last of its kind
    seconds: float  # compiling, every try together

    @property
    def fits(self) -> bool:
        return self.need.fits

    def error(self) -> ConfigError:
        """The one error of a step that does not fit (job/train/memory.py's, as the loop raises it)."""
        return memory.error(self.need, self.remedies, str(self.target), "compiled ahead of time", checked=True)


def first_row(cfg: TrainConfig, task: Task) -> Mapping[str, Any]:
    """Row 0 of the first train batch, asked of the task's source (it may read a token file: an error where
    that file is not on this machine)."""
    return task.source(cfg.data, cfg.model).rows("train", 0, 0, 1)


def abstract_batch(row: Mapping[str, Any], size: int, batch_sharding: jax.sharding.Sharding
                   ) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch of `size` rows like `row` (`first_row`), laid out as the loop lays one out: what the step
    is compiled for, with no batch made."""
    return {name: jax.ShapeDtypeStruct((size, *np.shape(value)[1:]),
                                       jax.dtypes.canonicalize_dtype(np.asarray(value).dtype), sharding=batch_sharding)
            for name, value in row.items()}


def measure(cfg: TrainConfig, task: Task, devices: Sequence[Any], hbm: int | None,
            row: Mapping[str, Any] | None = None) -> Need:
    """Compile the run's train step for `devices`, as the loop compiles it: bytes per device against `hbm`.
    A ConfigError where the run cannot be laid out on them (a batch that does not split, a model axis)."""
    row = first_row(cfg, task) if row is None else row
    mesh = plan.run_mesh(cfg.model_axis, cfg.mesh, devices=devices)
    sharding.check_global_batch(cfg.data.global_batch, cfg.accum_steps, mesh)
    batch = abstract_batch(row, cfg.data.global_batch, sharding.batch_sharding(mesh))
    planned = plan.plan_run(cfg, task, mesh).planned  # outside the mesh's context, as the loop builds it
    compile_under = remat_auto.compiling(lambda: plan.train_step_of(cfg, task, planned, mesh),
                                         (planned.abstract, batch), hbm)
    with sharding.mesh_context(mesh, plan.run_rules(cfg, task)):  # the model picks its kernels by the mesh's platform
        choice = remat_auto.choose(compile_under, limit=hbm)  # remat auto, as the loop chooses it
    need = choice.need
    return need if choice.fits or not need.fits else dataclasses.replace(need, fits=False)


# under fsdp, more devices mean fewer rows each: the step's bytes per device should fall with them (the state is
# split too). Where twice the devices or more leave more than this share, the activations are not split by rows
FALLS = 0.75
SPLIT_RULES = ("fsdp", "fsdp_tensor")  # the rules that split the state over the data axis


@dataclasses.dataclass(frozen=True)
class Scaling:
    """The run's step compiled for two device counts under its rule: whether its bytes per device fall."""

    small: Target
    large: Target
    small_need: Need
    large_need: Need

    @property
    def falls(self) -> bool:
        small, large = self.small_need.needed, self.large_need.needed
        return small is None or large is None or large <= FALLS * small

    def line(self) -> str:
        """What the two compiles found, and where the bytes do not fall, the call that fixes it."""
        small, large = self.small_need.needed or 0, self.large_need.needed or 0
        said = (f"{gib(large)} per chip on {self.large.name} against {gib(small)} on {self.small.name} "
                f"({len(self.large.devices) // len(self.small.devices)}x the chips, as many times fewer rows each)")
        if self.falls:
            return f"the step's bytes fall with the rows: {said}"
        return (f"a larger slice does not help this run: {said}; the activations are not split by rows (XLA splits "
                "them as the parameters are, along 'embed', and each chip keeps every row). Fix: wrap each block's "
                "call in job.kernels.remat(call, policy), which keeps a block's input split by rows, or constrain "
                "it with job.sharding.constrain(x, ('batch', 'length', 'embed')) (docs/sharding.md)")


def scaling(cfg: TrainConfig, task: Task, small: Target, large: Target,
            row: Mapping[str, Any] | None = None, small_need: Need | None = None) -> Scaling | None:
    """The run's step compiled for `small` and `large` (more devices) under its rule, where that rule splits the
    state (fsdp); None under another rule, or where it cannot be laid out on one of them. `small_need`: what the
    step needs on `small` where compiled already (`step_fits`'s `need`): `small` is then not compiled again."""
    if cfg.rule not in SPLIT_RULES:
        return None
    row = first_row(cfg, task) if row is None else row
    try:
        if small_need is None:
            small_need = measure(cfg, task, small.devices, device_memory.compiler_limit(small.devices[0]), row)
        large_need = measure(cfg, task, large.devices, device_memory.compiler_limit(large.devices[0]), row)
    except ConfigError:
        return None
    return Scaling(small, large, small_need, large_need)


def _tries(cfg: TrainConfig, task: Task, target: Target, larger: Sequence[Target],
           kinds: Iterable[str]) -> Iterator[tuple[str, Remedy, Target]]:
    """(kind, remedy, where to compile it) for each kind, in order."""
    mesh = plan.run_mesh(cfg.model_axis, cfg.mesh, devices=target.devices)
    data_parallel = sharding.data_parallel_size(mesh)
    makers: Mapping[str, Callable[[], Iterable[tuple[Remedy, Target]]]] = {
        "remat": lambda: ((r, target) for r in memory.remat_remedies(cfg, task)),
        "accum_steps": lambda: ((r, target) for r in memory.accum_steps_remedies(cfg, data_parallel, task)),
        "global_batch": lambda: ((r, target) for r in memory.global_batch_remedies(cfg, data_parallel, task)),
        "more_devices": lambda: ((memory.more_devices(cfg, len(target.devices), len(t.devices) // len(target.devices),
                                                      t.name), t) for t in larger),
    }
    for kind in kinds:
        for remedy, where in makers[kind]():
            yield kind, remedy, where


def step_fits(cfg: TrainConfig, task: Task, target: Target, larger: Sequence[Target] = (),
              kinds: Iterable[str] = REMEDY_KINDS, row: Mapping[str, Any] | None = None) -> Fit:
    """The run's train step compiled for `target`; where it does not fit, each of `kinds` of flags (REMEDY_KINDS) too,
    until one of that kind fits (`larger`: targets with more devices, for --rule fsdp over them). `row`: the
    task's `first_row`, when read already."""
    began = time.perf_counter()
    row = first_row(cfg, task) if row is None else row
    hbm = device_memory.compiler_limit(target.devices[0])
    need = measure(cfg, task, target.devices, hbm, row)
    remedies: list[Remedy] = []
    if not need.fits:
        done: set[str] = set()
        for kind, remedy, where in _tries(cfg, task, target, larger, kinds):
            if kind in done:
                continue
            try:
                limit = hbm if where is target else device_memory.compiler_limit(where.devices[0])
                found = measure(remedy.cfg, task, where.devices, limit, row)
            except ConfigError:  # it cannot be laid out there (a batch the devices do not split): not a fit
                continue
            remedies.append(remedy.checked(found))
            log.info("fit: %s on %s: %s", " ".join(remedy.flags) or "as it is", where,
                     "fits" if found.fits else "does not fit")
            if found.fits:
                done.add(kind)
    return Fit(target, need, tuple(remedies), time.perf_counter() - began)


__getattr__ = renamed.answer(__name__, {"KINDS": "REMEDY_KINDS"})  # the old name warns

__all__ = ["FALLS", "REMEDY_KINDS", "SPLIT_RULES", "Fit", "Scaling", "Target", "abstract_batch", "first_row", "measure",
           "scaling", "step_fits"]
