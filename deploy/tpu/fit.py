"""The doctor's fit check: the run's train step compiled ahead of time for the slice ACCELERATOR names, on the
machine that runs the doctor (libtpu, no TPU), before the slice exists.

    make tpu-doctor ACCELERATOR=v5litepod-1 ARGS='train --preset gpt2-small --model.scan --model.remat none'
    ok    fit: the train step needs 5.49 GiB of HBM per chip, 15.75 GiB available (v5litepod-1: 1 chip, ...)
    FAIL  fit: the train step's memory on v5litepod-1: 1 chip (TPU v5 lite): expected at most 15.75 GiB per
          device (what it has), found '29.26 GiB per device (compiled ahead of time: RESOURCE_EXHAUSTED: ...)'.
          Fix: these fit, each compiled for it: --model.remat dots (...); --accum-steps 4 (...); ...

libtpu makes compile-only devices of a topology (`jax.experimental.topologies.get_topology_desc`): the
accelerator type's chips, hosts and slices; job/train/fit.py compiles the loop's own step for them, and where
it does not fit, each flag of the out-of-memory error too (--rule fsdp on the next two larger types of the
generation). libtpu is the optional extra `tpu-fit`; without it the line says how to install it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

from deploy.checks import Check, failed
from deploy.tpu.accelerators import Accelerator, parse_accelerator
from deploy.tpu.config import TpuConfig
from job.core.errors import ConfigError

NAME = "fit"
INSTALL = ".venv/bin/pip install -e '.[tpu-fit]' (libtpu: Linux x86_64, Python 3.12 or newer)"
LARGER = 2  # larger accelerator types of the generation tried for --rule fsdp over more chips
# generation -> (libtpu's name for it, chip configuration, dimensions of its topology)
GENERATIONS = {"v4": ("v4", "megacore", 3), "v5p": ("v5p", "megacore", 3), "v5litepod": ("v5e", "default", 2),
               "v6e": ("v6e", "default", 2)}
SIZES = {"v4": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), "v5p": (8, 16, 32, 64, 128, 256, 512, 1024, 2048),
         "v5litepod": (1, 4, 8, 16, 32, 64, 128, 256), "v6e": (1, 4, 8, 16, 32, 64, 128, 256)}
# libtpu reads these as it starts; unset, it asks a metadata server that is not there and prints warnings. A
# compile-only topology holds no chip: any number of processes may load it at once (no /tmp/libtpu_lockfile).
QUIET = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@dataclasses.dataclass(frozen=True)
class Topology:
    """What libtpu needs to make the devices of an accelerator type."""

    name: str  # libtpu's topology name: 'v5e:2x2', 'v4:2x2x2'
    chip_config: str  # 'megacore' (v4, v5p: a chip's two TensorCores are one device) or 'default'
    host_bounds: tuple[int, int, int]  # chips per host along each dimension
    slices: int  # slices of it (multislice)
    chips: int  # per slice


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _shape(chips: int, dims: int) -> tuple[int, ...]:
    """The chips' grid as Cloud TPU lays it out: 2-D (v5e, v6e) 1x1, 2x2, 2x4, 4x4, 4x8 ...; 3-D (v4, v5p) 2x2x1,
    2x2x2, 2x2x4, 2x4x4, 4x4x4 ...; sizes that are not a power of two: 4 x N, or 4x4xN."""
    if dims == 2:
        if _power_of_two(chips):
            k = chips.bit_length() - 1
            return (2 ** (k // 2), 2 ** (k - k // 2))
        return (4, chips // 4)
    if chips == 4:
        return (2, 2, 1)
    if _power_of_two(chips):
        k = chips.bit_length() - 1
        return (2 ** (k // 3), 2 ** ((k + 1) // 3), 2 ** ((k + 2) // 3))
    return (4, 4, chips // 16) if chips % 16 == 0 else (2, 2, chips // 4)


def topology(accel: Accelerator, slices: int = 1) -> Topology:
    """The libtpu topology of an accelerator type (times `slices`); a ConfigError for a generation libtpu does not
    compile for here (v2, v3)."""
    generation = accel.generation.name
    if generation not in GENERATIONS:
        raise ConfigError("ACCELERATOR (--accelerator)", expected=f"a generation the fit check compiles for "
                          f"({', '.join(GENERATIONS)})", found=accel.type,
                          fix="the fit is not checked for it; the other checks still run")
    prefix, chip_config, dims = GENERATIONS[generation]
    chips = accel.size // 2 if chip_config == "megacore" else accel.size
    shape = _shape(chips, dims)
    bounds = (1, 1, 1) if chips == 1 else (2, 4, 1) if chips == 8 and accel.hosts == 1 else (2, 2, 1)
    return Topology(f"{prefix}:{'x'.join(map(str, shape))}", chip_config, bounds, slices, chips)


def larger(accel: Accelerator) -> list[Accelerator]:
    """The next LARGER accelerator types of the same generation."""
    sizes = [size for size in SIZES.get(accel.generation.name, ()) if size > accel.size]
    return [parse_accelerator(f"{accel.generation.name}-{size}") for size in sizes[:LARGER]]


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def _quiet_libtpu(accelerator: str) -> Iterator[None]:
    """QUIET (and the accelerator type) in the environment while libtpu starts, where they are not set already."""
    wanted = {**QUIET, "TPU_ACCELERATOR_TYPE": accelerator}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def compile_only_devices(accel: Accelerator, slices: int = 1) -> tuple[Any, ...]:
    """Compile-only devices of the slice(s), made by libtpu on this machine; the CPU is the only platform jax
    starts here (a TPU of this machine, if any, stays free for the job it may be running)."""
    # jax and libtpu only for the fit check: the doctor's other checks start without them
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_platforms", "cpu")
    shape = topology(accel, slices)
    with _quiet_libtpu(accel.type):
        made = topologies.get_topology_desc(platform="tpu", topology_name=shape.name, chip_config_name=shape.chip_config,
                                            chips_per_host_bounds=shape.host_bounds, num_slices=slices)
    return tuple(made.devices)


def target(accel: Accelerator, slices: int = 1) -> Any:
    """job.train.fit's Target of the slice(s): named as the error names them."""
    from job.train.fit import Target  # jax and flax: only when the fit is checked

    found = compile_only_devices(accel, slices)
    chips = len(found) // slices
    unit = "chip" if chips == 1 else "chips"
    times = f" x {slices} slices" if slices > 1 else ""
    return Target(accel.type, f"{chips} {unit}{times} ({found[0].device_kind})", found)


def fit_line(cfg: TpuConfig, check_run: bool = True) -> Check:
    """The fit line of `python -m deploy.tpu doctor`: ARGS' train step compiled for the slice, HBM per chip needed
    against available; skipped, saying why and what runs it, where it cannot be checked here."""
    return prepare(cfg, check_run)()


def prepare(cfg: TpuConfig, check_run: bool = True) -> Callable[[], Check]:
    """`fit_line`, made ready in the calling thread: where the step will be compiled, what compiles it (jax, flax, the
    loop) is imported here. The doctor runs the returned check in a thread of its own alongside its other checks,
    and two threads importing at once may each find the other's modules half made (numpy's C extension refuses to
    load so)."""
    skipped = _not_compiled(cfg, check_run)
    if skipped is not None:
        return lambda: skipped
    from job.train import fit, memory, sweep_check, task  # noqa: F401 - imported here: see above

    version = libtpu_version() or ""
    return lambda: _compiled(cfg, version)


def _not_compiled(cfg: TpuConfig, check_run: bool) -> Check | None:
    """The fit line when the step is not compiled here, saying why; None when it is."""
    args = cfg.job_args
    if not check_run or not args:
        return Check.skip(NAME, "no ARGS given", to_run=f"ARGS='train ...' (the train step is compiled for "
                          f"{cfg.accelerator} here: HBM per chip needed against available)")
    if args[0] != "train":
        return Check.skip(NAME, f"ARGS runs `python -m job {args[0]}`, not train")
    if cfg.sweep is not None:
        return Check.skip(NAME, "not checked for a SWEEP", to_run="ARGS with one run's flags and no SWEEP (that "
                          "run's fit is checked)")
    if cfg.accel.generation.name not in GENERATIONS:
        return Check.skip(NAME, f"the fit is compiled for {', '.join(GENERATIONS)}, not {cfg.accelerator}")
    if libtpu_version() is None:
        return Check.skip(NAME, "libtpu is not installed here", to_run=f"{INSTALL} (the train step is then "
                          f"compiled for {cfg.accelerator} on this machine)")
    return None


def _compiled(cfg: TpuConfig, version: str) -> Check:
    # jax, flax and the task: only when the fit is checked (the doctor's other checks start without them)
    from job.train import fit, sweep_check
    from job.train import task as tasks
    from job.runtime.device_memory import gib

    shape = topology(cfg.accel, cfg.slices)
    try:
        run = sweep_check.check_args(cfg.job_args, shape.chips * shape.slices)
    except Exception:  # noqa: BLE001 - the run's own line says what is wrong with ARGS
        return Check.skip(NAME, "ARGS does not pass the run's check (its line says why)",
                          to_run="ARGS that pass the run's check")
    task = tasks.load(run.task)
    try:
        row = fit.first_row(run, task)
    except Exception as exc:  # noqa: BLE001 - a task's data may be anything, and may live only on the workers
        return Check.skip(NAME, f"the task's rows cannot be read here ({type(exc).__name__}: {exc}); the batch's "
                          "shapes come from them", to_run="the doctor on a machine that has the task's data")
    try:
        slice_ = target(cfg.accel, cfg.slices)
        more = [target(accel, cfg.slices) for accel in larger(cfg.accel)]
        found = fit.step_fits(run, task, slice_, more, row=row)
    except ConfigError as exc:
        return failed(NAME, exc)
    except Exception as exc:  # noqa: BLE001 - any other error compiling the step: the slice's job would meet it too
        said = " ".join(str(exc).split("\n", 1)[0].split())
        return Check(NAME, False, f"compiling the train step for {cfg.accelerator} ahead of time raised "
                     f"{type(exc).__name__}: {said}", fix="correct the model or flags: the job would fail the same "
                     "way as it compiles on the slice")
    if not found.fits:
        return failed(NAME, found.error())
    need = found.need
    per_chip = gib(need.needed) if need.needed is not None else "an unknown amount"
    of = f", {gib(need.available)} available" if need.available is not None else ""
    # the slice's step is compiled once: its need, found above, is the comparison's small side
    scaled = fit.scaling(run, task, slice_, more[0], row=row, small_need=need) if more else None
    note = f"; {scaled.line()}" if scaled is not None and not scaled.falls else ""
    return Check(NAME, True, f"the train step needs {per_chip} of HBM per chip{of} ({slice_}; compiled ahead of "
                 f"time by libtpu {version} in {math.ceil(found.seconds)} s){note}")


__all__ = ["GENERATIONS", "INSTALL", "NAME", "Topology", "compile_only_devices", "fit_line", "larger", "libtpu_version",
           "prepare", "target", "topology"]
