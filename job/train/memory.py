"""An out-of-memory of the train step as one error: the bytes it needs per device against the device's, and
the flags that would make it fit.

    with memory.one_error(cfg, task, mesh, "compiling the train step"):
        train_step.lower(state, batch).compile()

    ConfigError: the train step's memory on 1 device (TPU v5 lite): expected at most 15.75 GiB per device, found
    '29.26 GiB per device (compiling the train step: RESOURCE_EXHAUSTED: ... HLO temporaries (29.26G) exceeds
    available HBM (15.75G) ...)'. Fix: flags that may fit (not checked here; ...): --model.remat full (...); ...

What XLA says of a program's memory, and what a device has, are read by job/runtime/device_memory.py (its
`Need`). `Remedy` is one change of flags: `suggested` names them from the figures (the loop:
compiling again there would hold the devices), job/train/fit.py compiles each for devices it does not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from job.core.errors import ConfigError
from job.parallel.sharding import data_parallel_size
from job.runtime import preflight
from job.runtime.device_memory import Need, from_message, gib, is_out_of_memory, limit
from job.train import config
from job.train.config import MAX_ACCUM, TrainConfig
from job.train.task import Task

log = logging.getLogger("job.train")

REMAT_FIELD = "remat"  # a model config's field that says what each layer keeps for the backward pass
# the state does not shrink with the rows: a suggestion cuts them by MARGIN x what is over (GPT-2 small at 1.8x
# a v5e chip: half the rows still needed 16.01 GiB of 15.75, a quarter 9.45)
MARGIN = 1.25


@dataclasses.dataclass(frozen=True)
class Remedy:
    """One change of the run's flags that may make the train step fit."""

    flags: tuple[str, ...]  # as typed after `python -m job train ...`: ("--accum-steps", "4")
    cfg: TrainConfig  # the run's config with them
    why: str  # what it changes, in a few words
    shrink: int = 1  # how many times fewer rows each device works on at once
    devices: int = 0  # > 0: it needs this many devices (fsdp over more of them)
    where: str = ""  # those devices, named (an accelerator type), where they are known
    need: Need | None = None  # what compiling it said; None: not checked

    def line(self) -> str:
        """'--accum-steps 4 (9.10 GiB per device)' once checked; '--accum-steps 4 (the same batch of ...)' before."""
        said = " ".join([*self.flags, *(("on", self.where) if self.where else ())])
        if self.need is None:
            return f"{said} ({self.why})"
        if self.need.needed is None:
            return f"{said} ({'fits' if self.need.fits else 'does not fit'})"
        return f"{said} ({gib(self.need.needed)} per device)"

    def checked(self, need: Need) -> Remedy:
        return dataclasses.replace(self, need=need)


def offered(cfg: TrainConfig, task: Task, flags: Sequence[str]) -> TrainConfig | None:
    """The run's config with `flags`, read by the command line's own parser for `task` and passing the run's
    checks; None where either refuses them (a fix is offered only where it parses for the model at hand)."""
    changed = config.parse_onto(cfg, task, flags)
    if changed is None or changed == cfg:
        return None
    try:
        config.validate(changed, task)
    except ConfigError:
        return None
    return changed


# the flags that make a model's blocks keep less, each tried as the command line reads it: a policy name where
# the task's remat field is a string (the example's, job.kernels), the on flag where it is a boolean
REMAT_FLAGS = ((f"--model.{REMAT_FIELD}", "dots"), (f"--model.{REMAT_FIELD}", "full"), (f"--model.{REMAT_FIELD}",))


def remat_remedies(cfg: TrainConfig, task: Task) -> Iterator[Remedy]:
    """--model.remat dots, then full (or --model.remat, for a boolean), where the task's model config has that
    field and its parser and validation take the value (the example LM's; a user's model may name it otherwise,
    or not have it)."""
    model: Any = cfg.model  # the task's own config class
    if REMAT_FIELD not in {f.name for f in dataclasses.fields(model)}:
        return
    for flags in REMAT_FLAGS:
        changed = offered(cfg, task, flags)
        if changed is None:
            continue
        value = getattr(changed.model, REMAT_FIELD)
        why = ("each layer keeps its matmuls' outputs, recomputes the rest" if value == "dots" else
               "each layer keeps only its input, recomputes the rest")
        yield Remedy(flags, changed, why)


def accum_steps_remedies(cfg: TrainConfig, data_parallel: int, task: Task) -> Iterator[Remedy]:
    """--accum-steps 2x, 4x, 8x, 16x the run's: the same global batch in smaller micro-batches, where they split."""
    for factor in (2, 4, 8, 16):
        k = cfg.accum_steps * factor
        if k <= MAX_ACCUM and cfg.data.global_batch % (k * data_parallel) == 0:
            rows = cfg.data.global_batch // k
            flags = ("--accum-steps", str(k))
            changed = offered(cfg, task, flags)
            if changed is not None:
                yield Remedy(flags, changed, f"the same batch of {cfg.data.global_batch} as {k} micro-batches of "
                             f"{rows}", shrink=factor)


def global_batch_remedies(cfg: TrainConfig, data_parallel: int, task: Task) -> Iterator[Remedy]:
    """--data.global-batch a half, a quarter, ... of the run's, where it still splits over the devices."""
    for factor in (2, 4, 8, 16):
        size = cfg.data.global_batch // factor
        if size >= 1 and cfg.data.global_batch % factor == 0 and size % (data_parallel * cfg.accum_steps) == 0:
            flags = ("--data.global-batch", str(size))
            changed = offered(cfg, task, flags)
            if changed is not None:
                yield Remedy(flags, changed, "fewer rows a step: a change of the training itself", shrink=factor)


def fsdp_rule(cfg: TrainConfig) -> str:
    """The rule that also splits the state over the data axis: fsdp (fsdp_tensor from tensor); the run's own
    where it does already."""
    return {"replicated": "fsdp", "tensor": "fsdp_tensor"}.get(cfg.rule, cfg.rule)


def more_devices(cfg: TrainConfig, devices: int, factor: int, where: str = "") -> Remedy:
    """--rule fsdp over `factor` times the devices: the state and the batch split over more of them."""
    rule = fsdp_rule(cfg)
    flags = ("--rule", rule) if rule != cfg.rule else ()
    return Remedy(flags, dataclasses.replace(cfg, rule=rule), f"the state and the batch over {devices * factor} "
                  "devices", shrink=factor, devices=devices * factor, where=where or f"{factor}x the devices")


def suggested(cfg: TrainConfig, task: Task, devices: int, data_parallel: int, need: Need) -> list[Remedy]:
    """One change of each kind, chosen from the figures (a device's memory taken as proportional to the rows it
    works on at once): named, not checked."""
    over = MARGIN * need.needed / need.available if need.needed and need.available else 2.0
    factor = 2 ** max(1, math.ceil(math.log2(max(over, 1.0))))  # how many times fewer rows a device must hold
    found = []
    for kind in (list(remat_remedies(cfg, task)), list(accum_steps_remedies(cfg, data_parallel, task)),
                 list(global_batch_remedies(cfg, data_parallel, task))):
        if kind:  # the first of its kind that shrinks enough, else the one that shrinks most (remat: the least memory)
            found.append(next((r for r in kind if r.shrink >= factor), kind[-1]))
    return [*found, more_devices(cfg, devices, factor)]


def error(need: Need, remedies: Sequence[Remedy], where: str, when: str, checked: bool, unchecked: str = "") -> ConfigError:
    """The one error of a train step that does not fit on `where` (its devices, named): the bytes needed
    against the available, and `remedies`: compiled for it (`checked`), else named (`unchecked`: how to
    check them)."""
    fits = [r for r in remedies if r.need is not None and r.need.fits]
    if checked and fits:
        fix = "these fit, each compiled for it: " + "; ".join(r.line() for r in fits)
    elif checked:
        tried = "; ".join(r.line() for r in remedies) or "none could be tried"
        fix = f"none of the flags tried fits ({tried}): a larger slice, or a smaller model or batch"
    else:
        fix = (f"flags that may fit (not checked here{'; ' + unchecked if unchecked else ''}): "
               + "; ".join(r.line() for r in remedies))
    expected = (f"at most {gib(need.available)} per device (what it has)" if need.available is not None
                else "no more memory than each device has")
    return ConfigError(f"the train step's memory on {where}", expected=expected, found=need.found(when), fix=fix)


def describe(devices: Sequence[Any]) -> str:
    """'1 device (TPU v5 lite)', '8 devices (cpu)'."""
    n, kind = len(devices), getattr(devices[0], "device_kind", devices[0].platform) if devices else "none"
    return f"{n} device{'' if n == 1 else 's'} ({kind})"


@contextlib.contextmanager
def one_error(cfg: TrainConfig, task: Task, mesh: jax.sharding.Mesh, when: str,
              before: Callable[[], None] | None = None) -> Iterator[None]:
    """XLA's out-of-memory raised inside (compiling the train step, or running it) leaves as one ConfigError,
    which every process prints before any exits (the same program runs out on each): the bytes, and the flags
    that may fit, named (compiling each would hold the devices again); on TPU, how to check them without one.
    `before` runs first (the loop's: a checkpoint save under way is let finish); what it raises is logged."""
    try:
        yield
    except (jax.errors.JaxRuntimeError, ValueError) as exc:
        if not is_out_of_memory(exc):
            raise
        if before is not None:
            try:
                before()
            except Exception as failed:  # noqa: BLE001 - the out-of-memory is the error to say; this one is logged
                log.warning("while stopping for the out-of-memory: %s", failed)
        raise_out_of_memory(cfg, task, mesh, from_message(str(exc), limit(mesh.devices.flat[0])), when)


def raise_out_of_memory(cfg: TrainConfig, task: Task, mesh: jax.sharding.Mesh, need: Need, when: str) -> None:
    """The one ConfigError of a train step that needs `need` on `mesh`'s devices, raised on every process
    together: the bytes, and the flags that may fit."""
    devices = list(mesh.devices.flat)
    remedies = suggested(cfg, task, len(devices), data_parallel_size(mesh), need)
    hint = ("make tpu-doctor ACCELERATOR=... ARGS='train ...' compiles each for a TPU slice, with no TPU"
            if devices[0].platform == "tpu" else "")
    found = error(need, remedies, describe(devices), when, checked=False, unchecked=hint)
    found.__suppress_context__ = True  # as `raise ... from None`: XLA's traceback is not shown under it
    preflight.raise_together(found, "out_of_memory")


__all__ = ["Remedy", "accum_steps_remedies", "describe", "error", "fsdp_rule", "global_batch_remedies", "more_devices",
           "offered", "one_error", "raise_out_of_memory", "remat_remedies", "suggested"]
