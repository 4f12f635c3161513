"""4. Checkpointing: `job.runs.checkpoint.Checkpointer` (orbax, async) vs the step time and vs numpy.

    python -m bench.ckpt [--quick]                      # 2 CPU devices; python -m bench runs it as "ckpt"
    python -m bench.ckpt worker --size gpt2-small       # on a chip, in HBM (python -m bench.tpu runs it)

One process, 2 CPU devices, the train state of a ~10M-parameter lm-task transformer as `job.train.loop.run`
holds and saves it: `nnx.split` of the model and its `nnx.Optimizer` (AdamW state), replicated. Timed, interleaved:

- blocking: how long `Checkpointer.save(step, state)` holds the training loop (orbax's async save: the loop waits
  for the device-to-host copy, orbax's threads write), against a train step of the same model
  (`job.train.steps.jit_train_step`, which donates the state, as in the loop), and against the device-to-host
  copy of the state alone (`jax.device_get` of fresh arrays: the link's rate); then the train steps taken while
  the save writes, one after another until it is written: the first, and their mean. The same for plain orbax's
  async save with its defaults (a CheckpointManager, StandardSave), and where orbax's blocking part goes in each,
  from the durations orbax itself reports through `jax.monitoring` (device-to-host copies, directory creation,
  tree metadata, barriers, the keep-N deletion);
- throughput: save + `wait()` (the whole write) against writing the same arrays with numpy
  (bench.ckpt.baseline: one `np.save` per array, each file and the folder fsynced), and against the disk's own
  synced rate (bench.ckpt.disk);
- restore: `Checkpointer.restore(step, like)` against `np.load` of those files + `jax.device_put` with the same
  shardings, both warm (the files in the page cache) and both cold (evicted from it first).

Both write to the same temporary folder's file system and both sync what they write: orbax's tensorstore syncs
every file it writes (its `file_io_sync` default), and the numpy baseline fsyncs its files and folder.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ckpt import NAME, TITLE, run
from bench.ckpt.baseline import drop_page_cache, host_copy_seconds, normal_priority, read_numpy, write_numpy
from bench.ckpt.disk import synced_write_rate
from bench.procs import emit
from bench.report import Section, standalone
from bench.timing import fmt_mb, fmt_pct, fmt_ratio, fmt_s, fmt_x, interleave, median, ratio

TASK = "lm"
MODEL = {"vocab_size": 256, "seq_len": 64, "dim": 384, "heads": 6, "layers": 6, "mlp_dim": 1536}
QUICK_MODEL = {"vocab_size": 256, "seq_len": 64, "dim": 128, "heads": 4, "layers": 2, "mlp_dim": 512}
BATCH = 8
SLACK_S = 0.2  # the acceptance: a save holds the loop at most the device-to-host copy at the link's rate + this

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
VARIANTS = {"template": "the template's save", "plain": "plain orbax async save (its defaults)"}


def loop_state(quick: bool, size: str = ""):  # noqa: ANN201
    """(task, model config, mesh, parameter count, graphdef, state): the train state as the loop holds it; `size`
    "gpt2-small": bench.mfu's GPT-2-small-sized LM (on a chip, python -m bench.tpu)."""
    from flax import nnx  # the parent that starts the worker imports this module too; only the worker loads jax

    from bench.mfu import SIZES
    from job import sharding
    from job import task as tasks
    from job.train.config import OptimConfig
    from job.train.state import count_params
    from job.train.steps import make_optimizer

    task = tasks.load(TASK)
    # remat none: the step is traced outside the loop, which is what chooses a policy for `auto`
    cfg = task.model_config(**(SIZES[size] if size else QUICK_MODEL if quick else MODEL), remat="none")
    mesh = sharding.make_mesh()
    model = task.build(cfg, nnx.Rngs(0))
    tx, _ = make_optimizer(OptimConfig(), 1000)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sharding.shard_model(model, mesh)
    sharding.shard_model(optimizer, mesh)
    params = count_params(model)
    graphdef, state = nnx.split({"model": model, "optimizer": optimizer})
    return task, cfg, mesh, params, graphdef, state


class Parts:
    """Sums the blocking durations orbax reports per save, for whichever variant is saving."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.totals: dict[str, dict[str, list[float]]] = {}
        self._current: dict[str, float] = {}

    def record(self, event: str, duration_secs: float, **_: str | int) -> None:
        if self.active is not None and event in BLOCKING_PARTS:
            self._current[event] = self._current.get(event, 0.0) + duration_secs

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


def worker(argv: list[str]) -> None:
    """`[--quick] [--size gpt2-small|400m]`: the figures of the default backend's devices (a chip's HBM with
    --size, run by python -m bench.tpu; 2 CPU devices otherwise)."""
    quick = "--quick" in argv
    size = argv[argv.index("--size") + 1] if "--size" in argv else ""
    reps = 2 if quick or size else 5  # on a chip a save of gpt2-small takes seconds: 2 after a warm-up
    import jax  # as in loop_state
    import numpy as np
    import orbax.checkpoint as ocp

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

    def state() -> Any:
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
    plain = ocp.CheckpointManager(root / "orbax-plain", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=True, create=True))
    counter = iter(range(1, 1_000_000))
    saved: list[int] = []
    beside: dict[str, list[list[float]]] = {variant: [] for variant in VARIANTS}

    # --- blocking: a train step, the device-to-host copy alone, each save; then the steps while it writes
    def host_copy() -> float:
        one_step()  # fresh arrays: jax keeps the host copy of an array once read
        return host_copy_seconds(jax.tree.leaves(state()))

    def steps_while(writing: Callable[[], bool]) -> list[float]:
        """The train steps taken while `writing()`, one after another (at least one)."""
        during = [one_step()]
        while writing() and len(during) < 1000:
            during.append(one_step())
        return during

    def blocking(variant: str, save: Callable[[int], object], writing: Callable[[], bool],
                 wait: Callable[[], object]) -> Callable[[], float]:
        """Time what `save` holds the loop for, then the steps taken while it writes."""
        def call() -> float:
            step = next(counter)
            if variant == "plain":
                normal_priority()  # tensorstore's (shared) threads at nice 0, as plain orbax alone runs them
            start = time.perf_counter()
            save(step)
            blocked = time.perf_counter() - start
            beside[variant].append(steps_while(writing))
            wait()
            if variant == "template":
                saved.append(step)
            return blocked
        return call

    parts = Parts()
    jax.monitoring.register_event_duration_secs_listener(parts.record)
    blocks = interleave({
        "device-to-host copy": host_copy, "step": one_step,
        "template": parts.tagged("template", blocking("template", lambda step: ckpt.save(step, state()),
                                                      ckpt.writing, ckpt.wait)),
        "plain": parts.tagged("plain", blocking(
            "plain", lambda step: plain.save(step, args=ocp.args.StandardSave(state()), force=True),
            plain.is_saving_in_progress, plain.wait_until_finished)),
    }, reps=reps, warmup=1)
    beside = {variant: runs[1:] for variant, runs in beside.items()}  # the warm-up round off
    plain.close()

    # --- throughput: whole orbax write vs numpy, and orbax's fixed cost
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

    # --- restore: orbax vs numpy files + device_put with the same shardings, warm and cold
    like = state()
    last = saved[-1]

    def orbax_restore(cold: bool) -> Callable[[], float]:
        def call() -> float:
            if cold:
                drop_page_cache(Path(str(ckpt.directory)) / str(last))
            start = time.perf_counter()
            jax.block_until_ready(ckpt.restore(last, like))
            return time.perf_counter() - start
        return call

    def numpy_restore(cold: bool) -> Callable[[], float]:
        def call() -> float:
            if cold:
                drop_page_cache(npdir)
            start = time.perf_counter()
            jax.block_until_ready(read_numpy(npdir, jax.tree.leaves(like)))
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
              "device": f"{len(jax.devices())} x {jax.devices()[0].device_kind}", "batch": BATCH,
              "seq_len": cfg.seq_len, "blocking": blocks, "beside": beside, "parts": parts.medians(reps),
              "priority_reset": normal_priority(), "writes": writes, "restores": restores,
              "disk_synced_bytes_per_s": disk, "restore_exact": exact}
    emit(dataclasses.asdict(section(result)))


def steps_beside(saves: list[list[float]]) -> tuple[float, float, float]:
    """(median first step, median of the saves' mean step, median count of steps) of the steps taken while each
    save wrote."""
    return (median([x[0] for x in saves]), median([sum(x) / len(x) for x in saves]),
            median([float(len(x)) for x in saves]))


def section(r: dict) -> Section:
    b, w, rs = r["blocking"], r["writes"], r["restores"]
    step = median(b["step"])
    link = median(b["device-to-host copy"])
    mib = r["bytes"]
    s = Section(NAME, TITLE, columns=["figure", "template (orbax)", "baseline", "ratio"], data=r)
    block = median(b["template"])
    first, during, count = steps_beside(r["beside"]["template"])
    block_plain = median(b["plain"])
    first_plain, during_plain, _ = steps_beside(r["beside"]["plain"])
    s.rows = [
        ["save: time the loop is blocked", fmt_s(block), f"train step {fmt_s(step)}", fmt_pct(block / step)],
        ["save: time the loop is blocked, against the device-to-host copy of the state (link's rate)",
         fmt_s(block), f"`jax.device_get` {fmt_s(link)} ({mib / link / 2**20:.0f} MiB/s)", fmt_x(block / link)],
        ["first train step while the write runs", fmt_s(first), f"train step {fmt_s(step)}", fmt_x(first / step)],
        [f"train steps while the write runs (mean of {count:.0f})", fmt_s(during), f"train step {fmt_s(step)}",
         fmt_x(during / step)],
        ["plain orbax async save (its defaults): time the loop is blocked", fmt_s(block_plain),
         f"train step {fmt_s(step)}", fmt_pct(block_plain / step)],
        ["plain orbax: first train step / mean while the write runs",
         f"{fmt_s(first_plain)} / {fmt_s(during_plain)}", f"train step {fmt_s(step)}", fmt_x(during_plain / step)],
        ["save, whole write (save + wait)", fmt_s(median(w["orbax"])), f"numpy {fmt_s(median(w['numpy']))}",
         fmt_ratio(w["orbax"], w["numpy"])],
        ["save throughput", f"{mib / median(w['orbax']) / 2**20:.0f} MiB/s",
         f"numpy {mib / median(w['numpy']) / 2**20:.0f} MiB/s", fmt_x(median(w["numpy"]) / median(w["orbax"]))],
        ["save throughput against the disk's synced write rate", f"{mib / median(w['orbax']) / 2**20:.0f} MiB/s",
         f"disk {r['disk_synced_bytes_per_s'] / 2**20:.0f} MiB/s",
         fmt_x(mib / median(w["orbax"]) / r["disk_synced_bytes_per_s"])],
        ["save of a one-number state (fixed cost)", fmt_s(median(w["orbax (one number)"])), "", ""],
        ["restore, warm (files in the page cache)", fmt_s(median(rs["orbax"])),
         f"np.load + device_put {fmt_s(median(rs['numpy']))}", fmt_ratio(rs["orbax"], rs["numpy"])],
        ["restore, cold (files evicted from the page cache)", fmt_s(median(rs["orbax cold"])),
         f"np.load + device_put {fmt_s(median(rs['numpy cold']))}", fmt_ratio(rs["orbax cold"], rs["numpy cold"])],
    ]
    s.headline += [
        ("async save blocks the loop, as a share of one step", fmt_pct(block / step), "small"),
        ("save blocks the loop beyond the device-to-host copy at the link's rate", fmt_s(block - link),
         f"<= {fmt_s(SLACK_S)}"),
        ("first train step while the write runs / plain step", fmt_x(first / step), "small"),
        ("train steps while the write runs (mean) / plain step", fmt_x(during / step), "small"),
        ("blocking, template / plain orbax", fmt_x(block / block_plain), "small"),
        ("save time, orbax / numpy", fmt_x(ratio(w["orbax"], w["numpy"])), "report"),
        ("restore time, orbax / numpy", fmt_x(ratio(rs["orbax"], rs["numpy"])), "report"),
    ]
    s.notes.append(f"Train state of a {r['params']:,}-parameter model with its AdamW state: {fmt_mb(mib)} in "
                   f"{r['arrays']} arrays on {r['device']}; train step on a {r['batch']} x {r['seq_len']} batch; "
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
                   "processes at a barrier and starts orbax's async save, which copies the live arrays to host "
                   "memory (the loop waits for that copy: the device-to-host row sets it against `jax.device_get` "
                   "of the same arrays, every copy started at once) and writes them on orbax's and tensorstore's "
                   "threads while the loop takes its next steps. Plain orbax does the same with its defaults "
                   "(StandardSave, each replicated array split into per-replica slices), its threads at nice 0"
                   + ("" if r["priority_reset"] else
                      " where this process was allowed to set it: it was not") + ". On 2 cores whatever "
                   "the save does in the background takes CPU from the step it overlaps.")
    parts = r["parts"]

    def rest(variant: str) -> float:
        """The blocking part orbax does not itemise: thread starts, per-array save arguments, commit setup."""
        got = parts.get(variant, {})
        return got.get(WHOLE, 0.0) - sum(v for event, v in got.items() if event != WHOLE)

    def row(label: str, value: Callable[[str], float]) -> str:
        return f"| {label} | " + " | ".join(fmt_s(value(v)) for v in VARIANTS) + " |"

    def part(event: str) -> Callable[[str], float]:
        return lambda variant: parts.get(variant, {}).get(event, 0.0)

    rows = [row(label, part(event)) for event, label in BLOCKING_PARTS.items() if event != WHOLE]
    rows += [row("the rest (thread starts, per-array arguments)", rest), row(BLOCKING_PARTS[WHOLE], part(WHOLE))]
    s.notes.append("Where orbax's blocking part goes (median per save, as orbax reports it through jax.monitoring; "
                   "the template's own barrier before the save is outside orbax's count):\n\n"
                   "| part | " + " | ".join(VARIANTS.values()) + " |\n|---|---|---|\n" + "\n".join(rows))
    return s


def main(argv: list[str] | None = None) -> int:
    return standalone(sys.argv[1:] if argv is None else argv, run, worker)


if __name__ == "__main__":
    sys.exit(main())
