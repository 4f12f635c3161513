"""An out-of-memory of the train step as one error: the bytes it needs per device against the device's, and
the flags that would make it fit.

    with memory.one_error(cfg, task, mesh, "compiling the train step"):
        train_step.lower(state, batch).compile()

    ConfigError: the train step's memory on 1 device (TPU v5 lite): expected at most 15.75 GiB per device, found
    '29.26 GiB per device (compiling the train step: RESOURCE_EXHAUSTED: ... HLO temporaries (29.26G) exceeds
    available HBM (15.75G) ...)'. Fix: flags that may fit (not checked here; ...): --model.remat full (...); ...

XLA says it two ways: as it compiles (on TPU `RESOURCE_EXHAUSTED: ... CompileTimeHbmOom: ... HLO temporaries
(29.26G) exceeds available HBM (15.75G)`) and when a buffer cannot be had (a first step: `RESOURCE_EXHAUSTED:
Out of memory while trying to allocate N bytes`). `Need` holds what it said, or what `memory_analysis()` says of
a program that compiled. `Remedy` is one change of flags: `suggested` names them from the figures (the loop:
compiling again there would hold the devices), job/train/fit.py compiles each for devices it does not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from job.core.errors import ConfigError
from job.parallel.sharding import train_batch_size_divisor
from job.runtime import preflight
from job.train import config
from job.train.config import MAX_ACCUM, TrainConfig
from job.train.task import Task

GIB = 1 << 30
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(?:i?B)?"
# (needed, available) as each of XLA's messages gives them; XLA writes sizes with 1024-based units ("15.75G")
_SAID = (
    re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)"),  # TPU, at compile time
    re.compile(rf"Attempting to allocate {_SIZE}\. That was not possible\. There are {_SIZE} free"),  # TPU runtime
)
# TPU, at compile time, the other form: "Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 6.69M." (the use capped
# at the capacity), then "Total hbm usage >= 16.01G:" and the largest allocations
_USED = re.compile(rf"Used {_SIZE} of {_SIZE} hbm")
_TOTAL = re.compile(rf"Total hbm usage >= {_SIZE}")
_EXCEEDED = re.compile(rf"Exceeded hbm capacity by {_SIZE}")
_ALLOCATE = re.compile(r"trying to allocate ([0-9]+) bytes")  # the allocator of a GPU (or a CPU): one buffer
REMAT_FIELD = "remat"  # a model config's field that says what each layer keeps for the backward pass
REMAT_VALUES = ("dots", "full")  # tried in this order: the faster first (keeps the matmuls' outputs), then the least
# the state does not shrink with the rows: a suggestion cuts them by MARGIN x what is over (GPT-2 small at 1.8x
# a v5e chip: half the rows still needed 16.01 GiB of 15.75, a quarter 9.45)
MARGIN = 1.25
SHOWN = 200  # characters of the compiler's message in an error: its first sentence, the figures in it


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Need:
    """The memory of one program per device, as far as it is known."""

    fits: bool  # False: the compiler or the allocator ran out
    needed: int | None  # bytes per device: memory_analysis()'s peak where it compiled, else the compiler's figure
    available: int | None  # bytes per device: the compiler's figure, or the device's memory limit; None: unknown
    said: str = ""  # where it did not fit: the compiler's (or the allocator's) words, shortened
    # bytes per device the program reserves beyond its arguments when it loads (temporaries, code, new outputs):
    # what must stay free between steps for it to run again; None: not known
    program: int | None = None

    def found(self, what: str = "") -> str:
        """'29.26 GiB per device (compiling the train step: RESOURCE_EXHAUSTED: ...)'."""
        figure = "an unknown amount of memory" if self.needed is None else f"{gib(self.needed)} per device"
        words = ": ".join(part for part in (what, self.said) if part)
        return f"{figure} ({words})" if words else figure


def is_out_of_memory(exc: BaseException) -> bool:
    """XLA's error for a program that does not fit (at compile time or at a run), not any other runtime error."""
    text = str(exc)
    return isinstance(exc, jax.errors.JaxRuntimeError) and (
        text.startswith("RESOURCE_EXHAUSTED") or "CompileTimeHbmOom" in text or "Out of memory" in text)


def from_message(text: str, available: int | None = None) -> Need:
    """What XLA's out-of-memory message says: the bytes needed and available where it names them (`available`,
    the device's own limit, where it does not)."""
    for pattern in _SAID:
        match = pattern.search(text)
        if match:
            return Need(False, _bytes(*match.group(1, 2)), _bytes(*match.group(3, 4)), _shortened(text))
    used, total, over = _USED.search(text), _TOTAL.search(text), _EXCEEDED.search(text)
    if used:
        capacity = _bytes(*used.group(3, 4))
        needed = (_bytes(*total.group(1, 2)) if total else capacity + _bytes(*over.group(1, 2)) if over
                  else _bytes(*used.group(1, 2)))
        return Need(False, needed, capacity, _shortened(text))
    one = _ALLOCATE.search(text)
    return Need(False, int(one.group(1)) if one else None, available, _shortened(text))


def _shortened(text: str) -> str:
    first = " ".join(text.split("\n", 1)[0].split())
    return first if len(first) <= SHOWN else first[:SHOWN - 3] + "..."


def from_compiled(compiled: jax.stages.Compiled, available: int | None) -> Need:
    """A program that compiled: its peak bytes per device (XLA's memory_analysis), against `available`."""
    stats = compiled.memory_analysis()
    if stats is None:
        return Need(True, None, available)
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    program = (stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
               + stats.generated_code_size_in_bytes)
    needed = peak or stats.argument_size_in_bytes + program
    return Need(available is None or needed <= available, needed, available, program=program)


def device_limit(devices: Sequence[Any]) -> int | None:
    """The memory one device may use, as its runtime says (`memory_stats()["bytes_limit"]`); None where it does
    not say (CPU, a device compiled for ahead of time)."""
    try:
        stats = devices[0].memory_stats()
    except Exception:  # noqa: BLE001 - a device without the call, or a compile-only one: not known
        return None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


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


def remat(cfg: TrainConfig, task: Task) -> Iterator[Remedy]:
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


def accum_steps(cfg: TrainConfig, data_parallel: int, task: Task) -> Iterator[Remedy]:
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


def global_batch(cfg: TrainConfig, data_parallel: int, task: Task) -> Iterator[Remedy]:
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
    for kind in (list(remat(cfg, task)), list(accum_steps(cfg, data_parallel, task)),
                 list(global_batch(cfg, data_parallel, task))):
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
def one_error(cfg: TrainConfig, task: Task, mesh: jax.sharding.Mesh, when: str) -> Iterator[None]:
    """XLA's out-of-memory raised inside (compiling the train step, or its first run) leaves as one ConfigError,
    which every process prints before any exits (the same program runs out on each): the bytes, and the flags
    that may fit, named (compiling each would hold the devices again); on TPU, how to check them without one."""
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        raise_out_of_memory(cfg, task, mesh, from_message(str(exc), device_limit(list(mesh.devices.flat))), when)


def raise_out_of_memory(cfg: TrainConfig, task: Task, mesh: jax.sharding.Mesh, need: Need, when: str) -> None:
    """The one ConfigError of a train step that needs `need` on `mesh`'s devices, raised on every process
    together: the bytes, and the flags that may fit."""
    devices = list(mesh.devices.flat)
    remedies = suggested(cfg, task, len(devices), train_batch_size_divisor(mesh), need)
    hint = ("make tpu-doctor ACCELERATOR=... ARGS='train ...' compiles each for a TPU slice, with no TPU"
            if devices[0].platform == "tpu" else "")
    found = error(need, remedies, describe(devices), when, checked=False, unchecked=hint)
    found.__suppress_context__ = True  # as `raise ... from None`: XLA's traceback is not shown under it
    preflight.raise_together(found, "out_of_memory")


__all__ = ["GIB", "Need", "Remedy", "accum_steps", "describe", "device_limit", "error", "from_compiled",
           "from_message", "fsdp_rule", "gib", "global_batch", "is_out_of_memory", "more_devices", "offered",
           "one_error", "raise_out_of_memory", "remat", "suggested"]
