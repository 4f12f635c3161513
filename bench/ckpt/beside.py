"""Train steps beside a save of fresh device arrays (never read to the host), by save mechanism, against the
device-to-host link's own rate.

    python -m bench.ckpt.beside OUT_DIR [--small] [--only A,B]   # on a TPU VM; --small: a CPU-sized dry run

One process, a 1.9 GB state shaped like gpt2-small's train state, a ~60 ms matmul step. First the link: the
state's bytes over the time of `jax.device_get` of all its arrays (every copy started at once), fresh arrays each
of 3 times. Then two saves each of: the template's `Checkpointer.save` (orbax's async save: the loop waits for the
device-to-host copy, orbax's threads write), the same with the loop's garbage collector off while it writes, plain orbax's async save with its defaults (StandardSave), and orbax
with the template's handler: as the template's save calls it, and copying to the host asynchronously in batches of
1 GB and 0.25 GB (`save_device_host_concurrent_gb`). Every step taken until the write ends is timed, and the loop's blocked time
set against the device-to-host copy at the link's rate plus 0.2 s (the acceptance's bound); in the steps that stall,
where the loop's thread was, gc's part and the GIL's waits (bench.ckpt.stalls). Then the template's
restore (and a cProfile of one, OUT_DIR/restore-profile.txt) against orbax's with `restore_concurrent_gb` 8 and
device_put of the same host arrays. Figures go to OUT_DIR/beside.json and the console (bench/RESULTS-tpu.md
section 6).
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import io
import itertools
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from bench.ckpt.baseline import host_copy_seconds, normal_priority
from bench.ckpt.chip_state import Record, Stepper, arguments, handler, manager, scratch, train_state
from bench.ckpt.stalls import Stalls
from bench.ckpt.writer import ProcessWriter
from job.runs.checkpoint import Checkpointer, abstract
from job.runs.config import CheckpointConfig

SLACK_S = 0.2  # the acceptance: a save holds the loop at most the device-to-host copy at the link's rate + this
SAVES = 2  # per mechanism
MOST_STEPS, MOST_S = 300, 20.0  # the steps timed beside one save, at most


class Fresh:
    """The state, made anew at each call: new device buffers, never read to the host (jax keeps an array's host
    copy once read, and a save of it then copies nothing)."""

    def __init__(self, small: bool) -> None:
        self.state = train_state(small)
        self._bump = jax.jit(lambda tree: jax.tree.map(lambda x: x * 1.0001, tree))

    def __call__(self) -> Any:
        self.state = jax.block_until_ready(self._bump(self.state))
        return self.state


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """One way to save: start a save (the loop's blocked time), whether it is still writing, wait, close."""

    start: Callable[[int, Any], object]
    writing: Callable[[], bool]
    finish: Callable[[], object]
    close: Callable[[], object]


def template(folder: Path) -> Mechanism:
    c = Checkpointer(folder, CheckpointConfig(every=1, keep=1))
    return Mechanism(c.save, c.writing, c.wait, c.close)


def orbax(folder: Path, *, defaults: bool = False, **options: Any) -> Mechanism:
    """orbax's own async save: with its `defaults` (StandardSave), else the template's handler with `options`."""
    normal_priority()  # tensorstore's threads at nice 0, as in a process that never ran the template's save
    if not defaults:
        m = manager(folder, **options)
        args: Callable[[Any], Any] = ocp.args.PyTreeSave
    else:
        m = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
            max_to_keep=1, enable_async_checkpointing=True, create=True))
        args = ocp.args.StandardSave
    return Mechanism(lambda step, item: m.save(step, args=args(item), force=True), m.is_saving_in_progress,
                     m.wait_until_finished, m.close)


def without_gc(folder: Path) -> Mechanism:
    """The template's save with the loop's garbage collector off until the write ends: whether gc's pauses are the
    stalls (bench.ckpt.stalls hears them too)."""
    c = Checkpointer(folder, CheckpointConfig(every=1, keep=1))

    def start(step: int, item: Any) -> None:
        gc.disable()
        c.save(step, item)

    def finish() -> None:
        c.wait()
        gc.enable()

    return Mechanism(start, c.writing, finish, c.close)


def process(folder: Path) -> Mechanism:
    """A writer in a process of its own (bench.ckpt.writer): the loop copies to shared host memory, nothing of the
    write runs in its process."""
    w = ProcessWriter(folder)
    return Mechanism(w.start, w.writing, w.finish, w.close)


MECHANISMS: dict[str, Callable[[Path], Mechanism]] = {
    "the template's save": template,
    "the template's save, the loop's gc off while it writes": without_gc,
    "a writer process (nice 19; host copy via shared memory; orbax, template's handler)": process,
    "plain orbax async save (its defaults)": lambda f: orbax(f, defaults=True),
    "orbax, template's handler (what the template's save calls)": orbax,
    "orbax, template's handler, pinned host transfer": lambda f: orbax(f, enable_pinned_host_transfer=True),
    "orbax, template's handler, d2h async in 1 GB batches": lambda f: orbax(f, save_device_host_concurrent_gb=1.0),
    "orbax, template's handler, d2h async in 0.25 GB batches": lambda f: orbax(f, save_device_host_concurrent_gb=0.25),
}


def beside(m: Mechanism, fresh: Fresh, one: Callable[[], float], steps: Iterator[int], bound_s: float) -> list[dict]:
    """SAVES saves of fresh arrays, each: the loop's blocked time, every step until the write ends, the whole, and
    where the loop's thread was in the steps that stalled (bench.ckpt.stalls)."""
    out = []
    for _ in range(SAVES):
        item = fresh()
        began = time.perf_counter()
        m.start(next(steps), item)
        blocked = time.perf_counter() - began
        during: list[float] = []
        spans: list[tuple[float, float]] = []
        with Stalls() as stalls:
            while m.writing() and len(during) < MOST_STEPS and time.perf_counter() - began < MOST_S:
                start = time.perf_counter()
                during.append(one())
                spans.append((start, time.perf_counter()))
        m.finish()
        out.append({"blocked": blocked, "within_bound": blocked <= bound_s, "steps": during,
                    "whole": time.perf_counter() - began, "stalls": stalls.report(spans)})
    return out


def shown(saves: list[dict]) -> list[dict]:
    """Each save's figures rounded, its steps as count, first five, median, mean and slowest."""
    def one(s: dict) -> dict:
        d = s["steps"]
        return {"blocked": round(s["blocked"], 3), "within_bound": s["within_bound"], "n": len(d),
                "first": [round(x, 3) for x in d[:5]], "median": round(statistics.median(d), 4) if d else None,
                "mean": round(sum(d) / len(d), 4) if d else None, "max": round(max(d), 3) if d else None,
                "whole": round(s["whole"], 2), "stalls": s["stalls"]}
    return [one(s) for s in saves]


def restores(record: Record, folder: Path, fresh: Fresh, out: Path) -> None:
    """The template's restore, twice and once profiled; orbax's with restore_concurrent_gb 8; device_put alone."""
    state = fresh()
    c = Checkpointer(folder, CheckpointConfig(every=1, keep=1))
    c.save(1, state)
    c.wait()

    def timed(restore: Callable[[], Any]) -> float:
        began = time.perf_counter()
        jax.block_until_ready(restore())
        return time.perf_counter() - began

    times: dict[str, Any] = {"template": [timed(lambda: c.restore(1, state)) for _ in range(2)]}
    profile = cProfile.Profile()
    profile.runcall(timed, lambda: c.restore(1, state))
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    (out / "restore-profile.txt").write_text(text.getvalue())
    c.close()
    like = abstract(state)
    args = ocp.args.PyTreeRestore(item=like, restore_args=ocp.checkpoint_utils.construct_restore_args(like))
    try:
        m = ocp.CheckpointManager(folder, item_handlers=handler(restore_concurrent_gb=8))
        times["restore_concurrent_gb 8"] = [timed(lambda: m.restore(1, args=args)) for _ in range(2)]
        m.close()
    except Exception as exc:  # noqa: BLE001 - an option this orbax refuses is a finding, not the end
        times["restore_concurrent_gb 8"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    leaves = jax.tree.leaves(state)
    host = [np.asarray(x) for x in leaves]
    times["device_put of host arrays alone"] = [
        timed(lambda: [jax.device_put(h, x.sharding) for h, x in zip(host, leaves, strict=True)]) for _ in range(2)]
    record.put("restore", times)


def host_memory(record: Record, leaves: list[Any]) -> None:
    """This machine's host memory as a save uses it: numpy arrays of the state's shapes made and filled (page
    faults), then freed one by one (glibc returns large blocks to the kernel, under the GIL): the seconds of each,
    and the slowest single free."""
    began = time.perf_counter()
    arrays = [np.ones(x.shape, np.float32) for x in leaves]
    filled = time.perf_counter() - began
    frees = []
    while arrays:
        one = time.perf_counter()
        arrays.pop()
        frees.append(time.perf_counter() - one)
    nbytes = sum(x.nbytes for x in leaves)
    record.put("host memory", {"bytes": nbytes, "fill_s": filled, "free_s": sum(frees), "slowest_free_s": max(frees)},
               shown=f"{nbytes / 2**20:.0f} MiB made and filled in {filled:.3f} s ({nbytes / filled / 2**30:.2f} GiB/s),"
                     f" freed in {sum(frees):.3f} s, the slowest free {max(frees) * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv, "python -m bench.ckpt.beside", __doc__, only=(*MECHANISMS, "restore", "host memory"))
    out, small = args.out, args.small
    folders = scratch(out)
    record = Record(out, "beside")
    fresh = Fresh(small)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(fresh()))
    record.put("state", {"arrays": len(jax.tree.leaves(fresh.state)), "bytes": nbytes})
    stepper = Stepper(small)
    plain = [stepper.one() for _ in range(10)]
    record.put("plain", plain, shown=[round(x, 4) for x in plain])
    copies = [host_copy_seconds(jax.tree.leaves(fresh())) for _ in range(3)]
    rate = nbytes / statistics.median(copies)
    bound = nbytes / rate + SLACK_S
    record.put("link", {"seconds": copies, "bytes_per_s": rate, "bound_s": bound},
               shown=f"device-to-host {rate / 2**30:.2f} GiB/s ({[round(x, 3) for x in copies]} s for "
                     f"{nbytes / 2**20:.0f} MiB): a save may hold the loop {bound:.3f} s")
    if "host memory" in args.only:
        host_memory(record, jax.tree.leaves(fresh.state))
    steps = itertools.count(1)
    for i, (name, make) in enumerate(MECHANISMS.items()):
        if name not in args.only:
            continue
        m = make(folders / str(i))
        try:
            saves = beside(m, fresh, stepper.one, steps, bound)
        finally:
            m.close()
        record.put(name, saves, shown=shown(saves))
    if "restore" in args.only:
        restores(record, folders / "restore", fresh, out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
