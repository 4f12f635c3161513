"""4. Checkpointing: `job.runs.checkpoint.Checkpointer` (orbax, async) vs the step time and vs numpy.

    python -m bench.ckpt [--quick]

One process, 2 CPU devices, the train state of a ~10M-parameter lm-task
transformer as `job.train.loop.run` holds and saves it: `nnx.split` of the model
and its `nnx.Optimizer` (AdamW state), replicated. Timed, interleaved:

- blocking: how long `Checkpointer.save(step, state)` holds the training loop
  (it copies the state on its devices and starts orbax's save on a thread),
  against a train step of the same model (`job.train.steps.jit_train_step`, which
  donates the state, as in the loop); and the train steps taken while the save
  writes, one after another until it is written: the first, and their mean. The same for `--ckpt.no-background` (orbax's save started on
  the loop's thread) and for a CheckpointManager with orbax's defaults (what the
  Checkpointer used before), and where orbax's blocking part goes in each, from
  the durations orbax itself reports through `jax.monitoring` (device-to-host
  copies, directory creation, tree metadata, barriers, the keep-N deletion);
- throughput: save + `wait()` (the whole write) against writing the same
  arrays with numpy (`jax.device_get` + one `np.save` per leaf, each file and the
  folder fsynced), and against the disk's own synced rate (`synced_write_rate`);
- restore: `Checkpointer.restore(step, like)` against `np.load` of those files
  + `jax.device_put` with the same shardings, both warm (the files in the page
  cache) and both cold (evicted from it first, `dropped_from_cache`).

Both write to the same temporary folder's file system and both sync what they
write: orbax's tensorstore syncs every file it writes (its `file_io_sync`
default), and the numpy baseline fsyncs its files and folder.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.procs import emit, run_worker
from bench.report import Section, standalone
from bench.timing import (
    fmt_mb,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    fmt_x,
    interleave,
    median,
    ratio,
)

NAME = "ckpt"
TITLE = "4. Checkpointing: async orbax save/restore vs step time and numpy"

TASK = "lm"
MODEL = {"vocab_size": 256, "seq_len": 64, "dim": 384, "heads": 6, "layers": 6, "mlp_dim": 1536}
QUICK_MODEL = {"vocab_size": 256, "seq_len": 64, "dim": 128, "heads": 4, "layers": 2, "mlp_dim": 512}
BATCH = 8


def synced_write_rate(folder: Path, size: int = 2**31) -> float:
    """Bytes a second this disk takes written and synced (`size` bytes in 16 MiB writes, then fsync), as `dd
    conv=fsync` measures it: the rate a checkpoint's save can at best reach."""
    path = folder / "synced-rate"
    block = os.urandom(2**24)
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(max(1, size // len(block))):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    rate = max(1, size // len(block)) * len(block) / (time.perf_counter() - began)
    path.unlink()
    return rate


def write_numpy(folder: Path, arrays: list, *, sync: bool = True) -> None:
    """The numpy baseline's write: `jax.device_get` of `arrays`, one `np.save` each into `folder` (made), every file
    and the folder fsynced with `sync`, as orbax's tensorstore syncs what it writes."""
    import jax  # a benchmark's worker imports jax after setting its device count
    import numpy as np

    folder.mkdir()
    for i, x in enumerate(jax.device_get(arrays)):
        with (folder / f"{i}.npy").open("wb") as f:
            np.save(f, x)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    if sync:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dropped_from_cache(folder: Path) -> None:
    """Every file under `folder` synced and evicted from the page cache (posix_fadvise DONTNEED, no root needed):
    the next read comes from the disk, cold."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def loop_state(quick: bool, size: str = ""):  # noqa: ANN201
    """(task, model config, mesh, parameter count, graphdef, state): the train state as the loop holds it; `size`
    "gpt2-small": bench.mfu's GPT-2-small-sized LM (on a chip, python -m bench.tpu)."""
    from flax import nnx

    from bench.mfu import SIZES
    from job import sharding
    from job import task as tasks
    from job.train.config import OptimConfig
    from job.train.state import count_params
    from job.train.steps import make_optimizer

    task = tasks.load(TASK)
    cfg = task.model_config(**(SIZES[size] if size else QUICK_MODEL if quick else MODEL))
    mesh = sharding.make_mesh()
    model = task.build(cfg, nnx.Rngs(0))
    tx, _ = make_optimizer(OptimConfig(), 1000)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sharding.shard_model(model, mesh)
    sharding.shard_model(optimizer, mesh)
    params = count_params(model)
    graphdef, state = nnx.split({"model": model, "optimizer": optimizer})
    return task, cfg, mesh, params, graphdef, state


def worker(argv: list[str]) -> None:
    """`[--quick] [--size gpt2-small|400m]`: the figures of the default backend's devices (a chip's HBM with
    --size, run by python -m bench.tpu; 2 CPU devices otherwise)."""
    quick = "--quick" in argv
    size = argv[argv.index("--size") + 1] if "--size" in argv else ""
    reps = 2 if quick or size else 5  # on a chip a save of gpt2-small takes seconds: 2 after a warm-up
    import jax
    import numpy as np
    from flax import nnx

    from job import sharding
    from job.runs.checkpoint import Checkpointer
    from job.train.batches import global_batch
    from job.train.config import CheckpointConfig
    from job.train.steps import jit_train_step

    task, cfg, mesh, params, graphdef, train_state = loop_state(quick, size)
    train_step = jit_train_step(task.loss, graphdef, train_state)
    source = task.source(task.data_config(global_batch=BATCH), cfg)
    batch = global_batch(source, sharding.batch_sharding(mesh), split="train", step=0, size=BATCH)
    held = {"state": train_state}

    def state() -> nnx.State:
        """The loop's current train state (each step donates the previous one)."""
        return held["state"]

    def one_step() -> float:
        start = time.perf_counter()
        with sharding.mesh_context(mesh):
            held["state"], metrics = train_step(held["state"], batch)
            jax.block_until_ready(metrics)
        return time.perf_counter() - start

    leaves = jax.tree.leaves(state())
    nbytes = sum(x.nbytes for x in leaves)
    print(f"[bench ckpt] train state: {params:,} parameters, {nbytes / 2**20:.0f} MiB "
          f"in {len(leaves)} arrays; {reps} repetitions", file=sys.stderr, flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    ckpt = Checkpointer(root / "orbax", CheckpointConfig(every=1, keep=2, async_save=True))
    on_loop = Checkpointer(root / "orbax-on-loop", CheckpointConfig(every=1, keep=2, background=False))
    counter = iter(range(1, 1_000_000))
    saved: list[int] = []
    after_save: list[list[float]] = []
    after_on_loop: list[list[float]] = []

    # --- blocking: a train step vs the save call; then the steps while the write runs
    def beside(writing: Callable[[], bool]) -> list[float]:
        """The train steps taken while `writing()`, one after another (at least one)."""
        during = [one_step()]
        while writing() and len(during) < 1000:
            during.append(one_step())
        return during

    def blocking(checkpointer: Checkpointer, after: list[list[float]], steps: list[int]) -> Callable[[], float]:
        """Time what `checkpointer.save` holds the loop for, then the steps taken while it writes."""
        def call() -> float:
            step = next(counter)
            start = time.perf_counter()
            checkpointer.save(step, state())
            blocked = time.perf_counter() - start
            after.append(beside(checkpointer.writing))
            checkpointer.wait()
            steps.append(step)
            return blocked
        return call

    blocking_save = blocking(ckpt, after_save, saved)
    # --ckpt.no-background: orbax's save (its copies to host included) on the loop's thread
    blocking_on_loop = blocking(on_loop, after_on_loop, [])

    import orbax.checkpoint as ocp

    defaults = ocp.CheckpointManager(root / "orbax-defaults", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=True, create=True))
    after_default: list[list[float]] = []

    def blocking_default() -> float:
        """orbax's defaults: StandardSave, each replicated array split into per-replica slices."""
        step = next(counter)
        normal_priority()  # the template lowered the priority of tensorstore's (shared) threads
        start = time.perf_counter()
        defaults.save(step, args=ocp.args.StandardSave(state()), force=True)
        blocked = time.perf_counter() - start
        after_default.append(beside(defaults.is_saving_in_progress))
        defaults.wait_until_finished()
        return blocked

    parts = Parts()
    jax.monitoring.register_event_duration_secs_listener(parts.record)
    blocking = interleave({"step": one_step, "save (blocking part)": parts.tagged("template", blocking_save),
                           "on the loop's thread (blocking part)": parts.tagged("on_loop", blocking_on_loop),
                           "orbax defaults (blocking part)": parts.tagged("defaults", blocking_default)},
                          reps=reps, warmup=1)
    after_save, after_on_loop, after_default = after_save[1:], after_on_loop[1:], after_default[1:]
    parts.active = None
    defaults.close()
    on_loop.close()

    # --- throughput: whole orbax write vs numpy
    def orbax_write() -> float:
        step = next(counter)
        start = time.perf_counter()
        ckpt.save(step, state())
        ckpt.wait()
        saved.append(step)
        return time.perf_counter() - start

    npdir = root / "numpy"

    def numpy_write() -> float:
        shutil.rmtree(npdir, ignore_errors=True)
        start = time.perf_counter()
        write_numpy(npdir, jax.tree.leaves(state()))
        return time.perf_counter() - start

    tiny = Checkpointer(root / "orbax-tiny", CheckpointConfig(every=1, keep=2, async_save=True))

    def orbax_tiny() -> float:
        """The same save of a one-number state: orbax's fixed cost per checkpoint."""
        start = time.perf_counter()
        tiny.save(next(counter), {"x": np.zeros((), np.float32)})
        tiny.wait()
        return time.perf_counter() - start

    writes = interleave({"orbax": orbax_write, "numpy": numpy_write, "orbax (one number)": orbax_tiny},
                        reps=reps, warmup=1)
    tiny.close()

    # --- restore: orbax vs numpy files + device_put with the same shardings
    like = state()
    last = saved[-1]
    flat_like, treedef = jax.tree.flatten(like)

    def orbax_restore(cold: bool) -> Callable[[], float]:
        def call() -> float:
            if cold:
                dropped_from_cache(Path(str(ckpt.directory)) / str(last))
            start = time.perf_counter()
            jax.block_until_ready(ckpt.restore(last, like))
            return time.perf_counter() - start
        return call

    def numpy_restore(cold: bool) -> Callable[[], float]:
        def call() -> float:
            if cold:
                dropped_from_cache(npdir)
            start = time.perf_counter()
            arrays = [jax.device_put(np.load(npdir / f"{i}.npy"), x.sharding) for i, x in enumerate(flat_like)]
            jax.block_until_ready(jax.tree.unflatten(treedef, arrays))
            return time.perf_counter() - start
        return call

    restores = interleave({"orbax": orbax_restore(False), "numpy": numpy_restore(False),
                           "orbax cold": orbax_restore(True), "numpy cold": numpy_restore(True)}, reps=reps, warmup=1)
    disk = synced_write_rate(root, 2**31 if size else 2**28)
    restored = ckpt.restore(last, like)
    exact = all(np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state()), strict=True))
    ckpt.close()
    shutil.rmtree(root, ignore_errors=True)
    result = {"params": params, "bytes": nbytes, "arrays": len(leaves), "reps": reps,
              "device": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
              "batch": BATCH, "seq_len": cfg.seq_len, "blocking": blocking, "step_during_write": after_save,
              "step_during_on_loop_write": after_on_loop, "step_during_default_write": after_default,
              "parts": parts.medians(reps), "priority_reset": normal_priority(),
              "writes": writes, "restores": restores, "disk_synced_bytes_per_s": disk, "restore_exact": exact, "tmp": str(root.parent)}
    emit(dataclasses.asdict(section(result)))


def normal_priority() -> bool:
    """Tensorstore's threads back to nice 0, for orbax's defaults to write as they would alone (the
    template raises their nice value; lowering it needs CAP_SYS_NICE). Whether every one could be."""
    from job.runs.checkpoint import WRITER_THREADS
    from job.runtime.priority import threads_named

    done = True
    for tid in threads_named(WRITER_THREADS):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            done = False
    return done


# Where orbax says a save's blocking time went: its own jax.monitoring durations (orbax-checkpoint 0.12).
BLOCKING_PARTS = {
    "/jax/orbax/write/checkpoint_start_sync_duration_secs": "barrier before the save",
    "/jax/orbax/write/blocking_val_duration_secs": "argument checks, listing the steps",
    "/jax/orbax/write/blocking_directory_creation_secs": "creating the step's folders",
    "/jax/orbax/write/blocking_tree_map_duration_secs": "tree metadata",
    "/jax/orbax/write/blocking_d2h_duration_secs": "device-to-host copies",
    "/jax/checkpoint/write/remove_steps_duration_secs": "keep-N deletion",
    "/jax/checkpoint/write/async/blocking_duration_secs": "whole blocking part (orbax's count)",
}

WHOLE = "/jax/checkpoint/write/async/blocking_duration_secs"


class Parts:
    """Sums the blocking durations orbax reports per save, for whichever variant is saving."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.totals: dict[str, dict[str, list[float]]] = {}
        self._current: dict[str, float] = {}

    def record(self, event: str, seconds: float, **_: object) -> None:
        if self.active is not None and event in BLOCKING_PARTS:
            self._current[event] = self._current.get(event, 0.0) + seconds

    def tagged(self, variant: str, fn: Callable[[], float]) -> Callable[[], float]:
        def call() -> float:
            self.active, self._current = variant, {}
            try:
                return fn()
            finally:
                self.active = None
                per = self.totals.setdefault(variant, {})
                for event in BLOCKING_PARTS:
                    per.setdefault(event, []).append(self._current.get(event, 0.0))
        return call

    def medians(self, reps: int) -> dict[str, dict[str, float]]:
        """Median seconds per part and variant, over the recorded (not warm-up) saves."""
        return {variant: {event: median(v[-reps:]) for event, v in per.items()} for variant, per in self.totals.items()}


def beside_write(saves: list) -> tuple[float, float, float]:
    """(median first step, median of the saves' mean step, median count of steps) of the steps taken while each
    save wrote; a record from before the steps were kept one by one holds one step per save."""
    runs = [x if isinstance(x, list) else [x] for x in saves]
    return (median([x[0] for x in runs]), median([sum(x) / len(x) for x in runs]),
            median([float(len(x)) for x in runs]))


def section(r: dict) -> Section:
    from job.runs.checkpoint import WRITER_NICE

    b, w, rs = r["blocking"], r["writes"], r["restores"]
    step = median(b["step"])
    block = median(b["save (blocking part)"])
    first, during, count = beside_write(r["step_during_write"])
    block_on_loop = median(b["on the loop's thread (blocking part)"])
    first_on_loop, during_on_loop, _ = beside_write(r["step_during_on_loop_write"])
    block_default = median(b["orbax defaults (blocking part)"])
    first_default, during_default, _ = beside_write(r["step_during_default_write"])
    mib = r["bytes"]
    s = Section(NAME, TITLE, columns=["figure", "template (orbax)", "baseline", "ratio"], data=r)
    s.rows = [
        ["save: time the loop is blocked", fmt_s(block), f"train step {fmt_s(step)}", fmt_pct(block / step)],
        ["first train step while the write runs", fmt_s(first), f"train step {fmt_s(step)}", fmt_x(first / step)],
        [f"train steps while the write runs (mean of {count:.0f})", fmt_s(during), f"train step {fmt_s(step)}",
         fmt_x(during / step)],
        ["`--ckpt.no-background`: time the loop is blocked", fmt_s(block_on_loop), f"train step {fmt_s(step)}",
         fmt_pct(block_on_loop / step)],
        ["`--ckpt.no-background`: first train step / mean while the write runs",
         f"{fmt_s(first_on_loop)} / {fmt_s(during_on_loop)}", f"train step {fmt_s(step)}",
         fmt_x(during_on_loop / step)],
        ["orbax defaults: time the loop is blocked", fmt_s(block_default), f"train step {fmt_s(step)}",
         fmt_pct(block_default / step)],
        ["orbax defaults: first train step / mean while the write runs",
         f"{fmt_s(first_default)} / {fmt_s(during_default)}", f"train step {fmt_s(step)}",
         fmt_x(during_default / step)],
        ["save, whole write (save + wait)", fmt_s(median(w["orbax"])), f"numpy {fmt_s(median(w['numpy']))}",
         fmt_ratio(w["orbax"], w["numpy"])],
        ["save throughput", f"{mib / median(w['orbax']) / 2**20:.0f} MiB/s",
         f"numpy {mib / median(w['numpy']) / 2**20:.0f} MiB/s",
         fmt_x(median(w["numpy"]) / median(w["orbax"]))],
        ["save of a one-number state (fixed cost)", fmt_s(median(w["orbax (one number)"])), "", ""],
        ["restore, warm (files in the page cache)", fmt_s(median(rs["orbax"])),
         f"np.load + device_put {fmt_s(median(rs['numpy']))}", fmt_ratio(rs["orbax"], rs["numpy"])],
    ]
    if "orbax cold" in rs:
        s.rows.append(["restore, cold (files evicted from the page cache)", fmt_s(median(rs["orbax cold"])),
                       f"np.load + device_put {fmt_s(median(rs['numpy cold']))}",
                       fmt_ratio(rs["orbax cold"], rs["numpy cold"])])
    if "disk_synced_bytes_per_s" in r:
        disk = r["disk_synced_bytes_per_s"]
        s.rows.append(["save throughput against the disk's synced write rate",
                       f"{mib / median(w['orbax']) / 2**20:.0f} MiB/s", f"disk {disk / 2**20:.0f} MiB/s",
                       fmt_x(mib / median(w["orbax"]) / disk)])
    s.headline += [
        ("async save blocks the loop, as a share of one step", fmt_pct(block / step), "small"),
        ("first train step while the write runs / plain step", fmt_x(first / step), "small"),
        ("train steps while the write runs (mean) / plain step", fmt_x(during / step), "small"),
        ("blocking, template / orbax defaults", fmt_x(block / block_default), "small"),
        ("save time, orbax / numpy", fmt_x(ratio(w["orbax"], w["numpy"])), "report"),
        ("restore time, orbax / numpy", fmt_x(ratio(rs["orbax"], rs["numpy"])), "report"),
    ]
    s.notes.append(f"Train state of a {r['params']:,}-parameter model with its AdamW state: {fmt_mb(mib)} in "
                   f"{r['arrays']} arrays on {r.get('device', '2 x cpu')}; train step on a {r['batch']} x "
                   f"{r['seq_len']} batch; "
                   f"median of {r['reps']} interleaved repetitions. Restored values equal the saved ones: "
                   f"{r['restore_exact']}.")
    fixed = median(w["orbax (one number)"])
    marginal = mib / max(median(w["orbax"]) - fixed, 1e-9) / 2**20
    s.notes.append("Every ratio is template / baseline (for throughput: below 1 means orbax writes slower "
                   f"than numpy). Orbax's save here = a fixed cost of about {fmt_s(fixed)} per checkpoint "
                   f"+ about {marginal:.0f} MiB/s for the data. Its timed save includes what the template's "
                   "Checkpointer does on every save: a temporary folder renamed on commit, a tensorstore "
                   "OCDBT store of uncompressed chunks, one array at a time, and the keep-N cleanup that "
                   "deletes the oldest checkpoint; numpy writes raw bytes, one file per array.")
    s.notes.append("What holds the loop: the template's `save` waits for the previous write, meets the other "
                   "processes at a barrier, dispatches one jitted copy of the state on its devices and starts "
                   "a thread; that thread runs orbax's save (its barriers, tree metadata, copies to host "
                   "memory: the part orbax blocks on) while the loop takes its next steps. With "
                   "`--ckpt.no-background` and with orbax's defaults the loop does all of that itself. "
                   "On 2 cores whatever the save does in the background takes CPU from the step it "
                   "overlaps; the template's save thread and the write on tensorstore's threads run at nice "
                   f"{WRITER_NICE} so that they fill the step's gaps instead (orbax's defaults were measured "
                   "with those threads at nice 0"
                   + ("" if r.get("priority_reset", True) else
                      " where this process was allowed to lower it: it was not") + ").")
    parts = r.get("parts", {})
    if parts:
        def rest(variant: str) -> float:
            """The blocking part orbax does not itemise: thread starts, per-array save arguments, commit setup."""
            got = parts.get(variant, {})
            return got.get(WHOLE, 0.0) - sum(v for event, v in got.items() if event != WHOLE)

        variants = ("defaults", "on_loop", "template")

        def row(label: str, value: Callable[[str], float]) -> str:
            return f"| {label} | " + " | ".join(fmt_s(value(v)) for v in variants) + " |"

        rows = [row(label, lambda v, e=event: parts.get(v, {}).get(e, 0.0))
                for event, label in BLOCKING_PARTS.items() if event != WHOLE]
        rows += [row("the rest (thread starts, per-array arguments)", rest),
                 row(BLOCKING_PARTS[WHOLE], lambda v: parts.get(v, {}).get(WHOLE, 0.0))]
        s.notes.append("Where orbax's blocking part goes (median per save, as orbax reports it through "
                       "jax.monitoring; the template's own barrier before the save is outside orbax's count). "
                       "It holds the loop with orbax's defaults and with `--ckpt.no-background`; the "
                       "template runs it on the save's thread, beside the loop:\n\n"
                       "| part | orbax defaults | `--ckpt.no-background` | template (on the save's thread) |\n"
                       "|---|---|---|---|\n" + "\n".join(rows))
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.ckpt", ["--quick"] if quick else [], devices=2))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
