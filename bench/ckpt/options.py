"""Where a checkpoint's time goes on a chip: the disk, orbax's options, the restore.

    python -m bench.ckpt.options OUT_DIR [--small]      # on a TPU VM; --small: a CPU-sized dry run

One process. The machine and the disk's own rates (bench.ckpt.disk: written synced and unsynced, read warm and
cold); a one-number state saved by the template's Checkpointer and by orbax with the template's handler, synced,
unsynced and without OCDBT, with orbax's log traced (OUT_DIR/orbax-trace.log, for where the fixed cost goes); a
1.9 GB state shaped like gpt2-small's train state (f32 parameters and two moments, 375 arrays) written whole by the
template and by each orbax option (OCDBT off, file sync off, bounded and pinned device-to-host copies, 256 MB data
files, zarr3) against numpy (bench.ckpt.baseline, synced and not); restore warm and cold (the files evicted from
the page cache) against np.load + device_put. The steps beside a save are bench.ckpt.beside's, which saves fresh
arrays each time. Figures go to OUT_DIR/options.json and the console (bench/RESULTS-tpu.md section 6).
Arrays read to the host once keep a host copy in jax: the whole-write figures after the first therefore leave the
device-to-host copy out (bench.ckpt.beside saves fresh arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from bench.ckpt import disk
from bench.ckpt.baseline import drop_page_cache, read_numpy, write_numpy
from bench.ckpt.chip_state import Record, arguments, handler, manager, scratch, train_state
from bench.report import machine
from job.core import internals
from job.runs.checkpoint import Checkpointer, abstract
from job.runs.config import CheckpointConfig

# (name, the handler's options, tensorstore's file sync, OCDBT's target data file size): the whole writes
OPTIONS: tuple[tuple[str, dict[str, Any], bool, int | None], ...] = (
    ("orbax", {}, True, None),
    ("orbax-nosync", {}, False, None),
    ("orbax-noocdbt", {"use_ocdbt": False}, True, None),
    ("orbax-d2h-256M", {"save_device_host_concurrent_gb": 0.25}, True, None),
    ("orbax-pinned", {"enable_pinned_host_transfer": True}, True, None),
    ("orbax-files-256M", {}, True, 256 * 2**20),
    ("orbax-zarr3", {"use_zarr3": True}, True, None),
)
BUDGET_S = 240.0  # the options not started by then are skipped (and said so)


class Events:
    """orbax's jax.monitoring durations, summed per event while `listening`."""

    def __init__(self) -> None:
        self.on = False
        self.seen: dict[str, float] = {}

    def record(self, event: str, duration_secs: float, **_: str | int) -> None:
        if self.on:
            self.seen[event] = self.seen.get(event, 0.0) + duration_secs

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        self.seen, self.on = {}, True
        try:
            yield
        finally:
            self.on = False


@contextlib.contextmanager
def traced(path: Path) -> Iterator[logging.Logger]:
    """orbax's (absl's) and the template's log at DEBUG into `path`, with times and threads; yields absl's logger
    (for a line between the runs)."""
    from absl import logging as absl_logging  # orbax's dependency: its verbosity gates orbax's debug lines

    trace = logging.FileHandler(path)
    trace.setFormatter(logging.Formatter("%(relativeCreated)10.1f %(threadName)s %(name)s %(message)s"))
    trace.setLevel(logging.DEBUG)
    loggers = (logging.getLogger("absl"), logging.getLogger("job"))
    kept = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(trace)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # into the file only, not onto the console
    absl_logging.set_verbosity(1)
    try:
        yield loggers[0]
    finally:
        absl_logging.set_verbosity(0)
        for logger, (level, propagate) in zip(loggers, kept, strict=True):
            logger.removeHandler(trace)
            logger.setLevel(level)
            logger.propagate = propagate
        trace.close()


def file_sync(on: bool) -> None:
    """Tensorstore's file sync on (its default) or off, in every context orbax writes through."""
    for ctx in internals.orbax_ts_contexts():
        if on:
            ctx.pop("file_io_sync", None)
        else:
            ctx["file_io_sync"] = False


def du(path: Path) -> str:
    files = [f for f in path.rglob("*") if f.is_file()]
    return f"{sum(f.stat().st_size for f in files)} bytes in {len(files)} files"


class Writers:
    """Times each writer's whole saves of one state into OUT_DIR/folders, putting each into the record."""

    def __init__(self, record: Record, folders: Path, events: Events) -> None:
        self.record, self.folders, self.events = record, folders, events

    def _saves(self, save: Callable[[int], None], wait: Callable[[], None], saves: int) -> dict[str, Any]:
        """The loop's blocked time and the whole write (save + wait) of steps 1..`saves`; orbax's events of the last."""
        out: dict[str, Any] = {"block": [], "whole": []}
        for step in range(1, saves + 1):
            with self.events.listening():
                began = time.perf_counter()
                save(step)
                out["block"].append(time.perf_counter() - began)
                wait()
                out["whole"].append(time.perf_counter() - began)
        out["events"] = dict(sorted(self.events.seen.items()))
        return out

    def _put(self, key: str, out: dict[str, Any]) -> None:
        self.record.put(key, out, shown={k: [round(x, 3) for x in v] if isinstance(v, list) else v
                                         for k, v in out.items() if k != "events"})

    def template(self, name: str, item: Any, saves: int) -> None:
        """The template's `Checkpointer.save` + `wait`."""
        c = Checkpointer(self.folders / name, CheckpointConfig(every=1, keep=1))
        try:
            self._put(f"template {name}", self._saves(lambda step: c.save(step, item), c.wait, saves))
        finally:
            c.close()

    def orbax(self, name: str, item: Any, saves: int, options: dict[str, Any] | None = None, sync: bool = True,
              file_size: int | None = None) -> None:
        """orbax's manager with the template's handler and `options`, tensorstore's file sync `sync`."""
        file_sync(sync)
        m = None
        try:
            m = manager(self.folders / name, **(options or {}))
            args = ocp.args.PyTreeSave(item, ocdbt_target_data_file_size=file_size) if file_size else \
                ocp.args.PyTreeSave(item)
            out = self._saves(lambda step: m.save(step, args=args, force=True), m.wait_until_finished, saves)
            out["du"] = du(self.folders / name / str(saves))
        except Exception as exc:  # noqa: BLE001 - an option this orbax refuses is a finding, not the end
            out = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        finally:
            with contextlib.suppress(Exception):
                if m is not None:
                    m.close()
            file_sync(True)
        self._put(f"orbax {name}", out)

    def numpy(self, name: str, leaves: list[jax.Array], sync: bool) -> float:
        path = self.folders / name
        shutil.rmtree(path, ignore_errors=True)
        began = time.perf_counter()
        write_numpy(path, leaves, sync=sync)
        return time.perf_counter() - began


def restores(record: Record, folders: Path, state: Any) -> None:
    """The orbax option's newest step and numpy's synced files restored, warm and cold, twice each."""
    like = abstract(state)
    leaves = jax.tree.leaves(state)
    path = folders / "orbax"
    step = max((int(p.name) for p in path.iterdir() if p.name.isdigit()), default=None) if path.exists() else None

    def orbax(cold: bool) -> float:
        if cold:
            drop_page_cache(path)
        m = ocp.CheckpointManager(path, item_handlers=handler())
        began = time.perf_counter()
        jax.block_until_ready(m.restore(step, args=ocp.args.PyTreeRestore(
            item=like, restore_args=ocp.checkpoint_utils.construct_restore_args(like))))
        seconds = time.perf_counter() - began
        m.close()
        return seconds

    def numpy(cold: bool) -> float:
        if cold:
            drop_page_cache(folders / "np-sync")
        began = time.perf_counter()
        jax.block_until_ready(read_numpy(folders / "np-sync", leaves))
        return time.perf_counter() - began

    times: dict[str, list[float]] = {}
    for cold in (False, True, False, True):
        key = "cold" if cold else "warm"
        if step is not None:
            times.setdefault(f"orbax {key}", []).append(orbax(cold))
        times.setdefault(f"numpy {key}", []).append(numpy(cold))
    record.put("restore", times)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv, "python -m bench.ckpt.options", __doc__)
    out, small = args.out, args.small
    folders = scratch(out)
    record = Record(out, "options")
    rates = dataclasses.asdict(disk.probe(folders, 2**27 if small else 2**30))
    record.put("machine", {"host": machine(), "disk": rates},
               shown={"host": machine(), "disk MiB/s": {k: v if isinstance(v, str) else round(v / 2**20)
                                                        for k, v in rates.items()}})
    record.put("versions", {"jax": jax.__version__, "orbax": ocp.__version__, "device": str(jax.devices()[0].device_kind)})
    events = Events()
    jax.monitoring.register_event_duration_secs_listener(events.record)
    state = train_state(small)  # gpt2-small's train state's shapes (param, mu, nu), f32
    leaves = jax.tree.leaves(state)
    record.put("state", {"arrays": len(leaves), "bytes": sum(x.nbytes for x in leaves)})
    writers = Writers(record, folders, events)

    # 1. the fixed cost: a one-number state, with orbax's log traced
    tiny = {"x": jnp.zeros((), jnp.float32)}
    with traced(out / "orbax-trace.log") as absl:
        for line, run in (("template, one number", lambda: writers.template("tiny-template", tiny, 2)),
                          ("orbax (our handler), one number", lambda: writers.orbax("tiny-orbax", tiny, 2)),
                          ("orbax, one number, no file sync", lambda: writers.orbax("tiny-orbax-nosync", tiny, 2,
                                                                                  sync=False)),
                          ("orbax, one number, no ocdbt", lambda: writers.orbax("tiny-orbax-noocdbt", tiny, 2,
                                                                              {"use_ocdbt": False})),
                          ("template, the state", lambda: writers.template("state-template", state, 2))):
            absl.info("=== %s", line)
            run()

    # 2. the whole write of the state: numpy synced and not, then each orbax option
    timed: dict[str, list[float]] = {"sync": [], "nosync": []}
    for _ in range(2):
        timed["sync"].append(writers.numpy("np-sync", leaves, sync=True))
        timed["nosync"].append(writers.numpy("np-nosync", leaves, sync=False))
    record.put("numpy", timed)
    ends = time.monotonic() + BUDGET_S
    for name, options, sync, file_size in OPTIONS:
        if time.monotonic() > ends:
            record.put(f"orbax {name}", "skipped: past the time budget")
            continue
        writers.orbax(name, state, 2, options, sync, file_size)

    # 3. restore, warm and cold
    restores(record, folders, state)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
