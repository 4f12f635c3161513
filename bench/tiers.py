"""Checkpoint tiers on real storage: the persistent tier on disk (synced, cold reads) and the node-local tier in memory.

    python -m bench.tiers [--quick]

One process, 4 CPU devices, a state of random float32 (numpy's default_rng: it does not
compress, and orbax's plain store compresses) in a few 2-D arrays, each split along its
leading axis over a 1-D mesh of the 4 devices: ~1.5 GB (quick: ~200 MB). Timed,
interleaved (A B C A B C ...), median of 3 repetitions (quick: 2) after one warm-up round:

- persistent tier, to a folder on the real disk (under /var/tmp): every write ends with
  `os.sync()` inside the timed region (the bytes are on the disk, not in the page cache), and
  the page cache is dropped before every restore (untimed; bench.ckpt.baseline.drop_page_cache:
  `echo 3 > /proc/sys/vm/drop_caches` as root, else each file evicted with posix_fadvise), so
  every restore reads the disk:
  - numpy (bench.ckpt.baseline): `np.save` of each shard to its own file + `os.fsync`;
    `np.load` of each + `jax.make_array_from_single_device_arrays` with the same sharding;
  - plain orbax: `ocp.StandardCheckpointer()`: `save(path, state)` + `wait_until_finished()`;
    `restore(path, targets)` of ShapeDtypeStruct targets carrying the shardings (StandardRestore);
  - the template: `job.runs.checkpoint.Checkpointer(folder, CheckpointConfig(every=1, keep=2))`:
    `save(step, state)` + `wait()`; `restore(step, like)` with the abstract tree;
- node-local tier (`job.runs.local_tier.LocalTier`), in a folder under /dev/shm (memory; one
  process, so no peer: it writes its own file only): `save(done, state)` + `wait()` and
  `restore(like, newer_than=None)`, against numpy writing (`np.save` + `os.fsync` per shard)
  and reading the same bytes in the same /dev/shm folder.

Each variant keeps at most one copy on disk or in memory: its files are deleted (untimed, then
synced) after its restore. Tensorstore's threads, whose nice value the template's save may raise,
are put back to nice 0 before plain orbax's save and before every restore (a restore runs in a
fresh process, before any save).
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

from bench.ckpt.baseline import drop_page_cache, normal_priority, read_numpy, write_numpy
from bench.ckpt.disk import file_system
from bench.procs import cpu_env, emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_mb, fmt_ratio, fmt_s, fmt_x, interleave, median, ratio

NAME = "tiers"
TITLE = "Checkpoint tiers: persistent on disk (synced, cold reads) and node-local in memory, vs numpy and plain orbax"

DEVICES = 4
ARRAYS = 4
SHAPE = (24576, 4096)  # float32: 384 MiB an array, 1.5 GiB in all
QUICK_SHAPE = (3072, 4096)  # 48 MiB an array, 192 MiB in all
DISK = os.environ.get("BENCH_TIERS_DISK", "/var/tmp")  # a folder on the real disk (not a tmpfs)
SHM = os.environ.get("BENCH_TIERS_SHM", "/dev/shm")


def make_state(shape: tuple[int, int], seed: int = 0):  # noqa: ANN201
    """{"w0": .., "w1": ..}: random float32 arrays split along axis 0 over a 1-D mesh of every device.
    Made shard by shard (the host never holds a whole array beside its shards)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    rng = np.random.default_rng(seed)
    state = {}
    for i in range(ARRAYS):
        shards = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            rows = len(range(*index[0].indices(shape[0])))
            shards.append(jax.device_put(rng.standard_normal((rows, shape[1]), dtype=np.float32), device))
        state[f"w{i}"] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return jax.block_until_ready(state)


def worker(argv: list[str]) -> None:
    quick = "--quick" in argv
    reps = 2 if quick else 3
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from job.runs.checkpoint import Checkpointer, abstract
    from job.runs.config import CheckpointConfig
    from job.runs.local_format import shard_file
    from job.runs.local_tier import LocalTier

    state = make_state(QUICK_SHAPE if quick else SHAPE)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    like = abstract(state)
    disk = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=DISK))
    shm = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=SHM))
    print(f"[bench tiers] state: {nbytes / 2**20:.0f} MiB of random float32 in {len(leaves)} arrays over "
          f"{jax.device_count()} devices; {reps} repetitions; disk folder {disk} ({file_system(disk)}), "
          f"node-local folder {shm} ({file_system(shm)})", file=sys.stderr, flush=True)

    restores: dict[str, list[float]] = {}
    exact: dict[str, bool] = {}
    dropped: list[str] = []
    rounds = {"n": 0}

    def same(restored: object) -> bool:
        return all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(restored), leaves, strict=True))

    def resident(tree: object) -> int:
        """Touch one byte of every page of every shard (cheap where the bytes were copied in, a page-in where a
        restore left them in a mapped file)."""
        import numpy as np

        return sum(int(np.asarray(shard.data).reshape(-1).view(np.uint8)[::4096].sum())
                   for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards)

    def cycle(name: str, write: Callable[[], None], restore: Callable[[], object], clean: Callable[[], None],
              cold: bool) -> Callable[[], float]:
        """Time `write` (+ os.sync when `cold`), then `restore` (page cache dropped first when `cold`),
        then delete the files (untimed); returns the write's seconds, keeps the restore's."""
        def call() -> float:
            start = time.perf_counter()
            write()
            if cold:
                os.sync()
            written = time.perf_counter() - start
            if cold:
                dropped.append(drop_page_cache(disk, system=True))
            normal_priority()  # tensorstore's threads at nice 0, as in a fresh process that restores
            start = time.perf_counter()
            restored = jax.block_until_ready(restore())
            resident(restored)  # a mapped file is read as its pages are first touched: count that too
            restores.setdefault(name, []).append(time.perf_counter() - start)
            if rounds["n"] == reps:  # the last round: the values must come back
                exact[name] = same(restored)
            del restored
            clean()
            os.sync()  # the deletion's writes stay out of the next variant's timed region
            return written
        return call

    # --- persistent tier: numpy, one file per shard, fsynced
    npdisk = disk / "numpy"

    def numpy_write(folder: Path) -> Callable[[], None]:
        return lambda: write_numpy(folder, leaves)

    def numpy_read(folder: Path) -> Callable[[], object]:
        return lambda: read_numpy(folder, leaves)

    def remove(folder: Path) -> Callable[[], None]:
        return lambda: shutil.rmtree(folder, ignore_errors=True)

    # --- persistent tier: plain orbax
    plain = ocp.StandardCheckpointer()
    plain_path = disk / "plain"

    def plain_write() -> None:
        normal_priority()  # after the template's save, tensorstore's shared threads are at nice 19
        plain.save(plain_path, state)
        plain.wait_until_finished()

    def plain_read() -> object:
        return plain.restore(plain_path, like)  # = args=ocp.args.StandardRestore(like)

    # --- persistent tier: the template
    template = Checkpointer(disk / "template", CheckpointConfig(every=1, keep=2))
    steps = iter(range(1, 1_000_000))
    current = {"step": 0}

    def template_write() -> None:
        current["step"] = next(steps)
        template.save(current["step"], state)
        template.wait()

    def template_read() -> object:
        return template.restore(current["step"], like)

    def template_clean() -> None:
        template.manager.delete(current["step"])  # one copy at a time: the next save deletes nothing

    # --- node-local tier
    tier = LocalTier(str(shm / "local"), str(disk / "run"), every=1, node="localhost", like=state)
    npshm = shm / "numpy"

    def tier_write() -> None:
        current["local"] = next(steps)
        tier.save(current["local"], state)
        tier.wait()
        if not shard_file(tier.folder, current["local"], tier.me).exists():
            raise RuntimeError(f"the node-local tier did not write step {current['local']} (skipped: see its warning)")

    def tier_read() -> object:
        got = tier.restore(like, newer_than=None)
        if got is None or got[0] != current["local"]:
            raise RuntimeError(f"the node-local tier restored {got and got[0]}, expected step {current['local']}")
        return got[1]

    def tier_clean() -> None:
        shutil.rmtree(tier.folder / str(current["local"]), ignore_errors=True)

    variants = {
        "numpy (disk)": cycle("numpy (disk)", numpy_write(npdisk), numpy_read(npdisk), remove(npdisk), cold=True),
        "plain orbax (disk)": cycle("plain orbax (disk)", plain_write, plain_read, remove(plain_path), cold=True),
        "template (disk)": cycle("template (disk)", template_write, template_read, template_clean, cold=True),
        "numpy (/dev/shm)": cycle("numpy (/dev/shm)", numpy_write(npshm), numpy_read(npshm), remove(npshm),
                                  cold=False),
        "local tier (/dev/shm)": cycle("local tier (/dev/shm)", tier_write, tier_read, tier_clean, cold=False),
    }

    order = list(variants)

    def last_variant(fn: Callable[[], float]) -> Callable[[], float]:
        def call() -> float:
            try:
                return fn()
            finally:
                rounds["n"] += 1
        return call

    variants[order[-1]] = last_variant(variants[order[-1]])
    load = [os.getloadavg()[0]]
    writes = interleave(variants, reps=reps, warmup=1)
    load.append(os.getloadavg()[0])
    restores = {name: times[1:] for name, times in restores.items()}  # the warm-up round off
    tier.close(completed=True)
    template.close()
    plain.close()
    shutil.rmtree(disk, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    result = {"bytes": nbytes, "arrays": len(leaves), "shape": list(leaves[0].shape), "devices": jax.device_count(),
              "reps": reps, "writes": writes, "restores": restores, "exact": exact,
              "caches_dropped": sorted(set(dropped)), "disk": f"{DISK} ({file_system(DISK)})",
              "shm": f"{SHM} ({file_system(SHM)})", "load": load}
    emit(dataclasses.asdict(section(result)))


def section(r: dict) -> Section:
    w, rs = r["writes"], r["restores"]
    mib = r["bytes"] / 2**20

    def cell(times: list[float], rate: bool = False) -> str:
        return fmt_s(median(times)) + (f" ({mib / median(times):.0f} MiB/s)" if rate else "")

    columns = ["figure", "template", "plain orbax", "numpy (baseline)", "template / plain orbax",
               "plain orbax / numpy", "template / numpy"]
    s = Section(NAME, TITLE, columns=columns, data=r)
    for label, times in (("persistent tier (disk): write + os.sync", w),
                         ("persistent tier (disk): restore, page cache dropped", rs)):
        t, o, n = times["template (disk)"], times["plain orbax (disk)"], times["numpy (disk)"]
        s.rows.append([label, cell(t), cell(o), cell(n, rate=True), fmt_ratio(t, o), fmt_ratio(o, n),
                       fmt_ratio(t, n)])
    for label, times in (("node-local tier (/dev/shm): save + wait", w), ("node-local tier (/dev/shm): restore", rs)):
        t, n = times["local tier (/dev/shm)"], times["numpy (/dev/shm)"]
        s.rows.append([label, cell(t), "", cell(n, rate=True), "", "", fmt_ratio(t, n)])
    s.headline += [
        ("persistent write (synced), template / plain orbax",
         fmt_x(ratio(w["template (disk)"], w["plain orbax (disk)"])), "<= 1.2x"),
        ("persistent restore (cold), template / plain orbax",
         fmt_x(ratio(rs["template (disk)"], rs["plain orbax (disk)"])), "<= 1.2x"),
        ("persistent write (synced), template / numpy", fmt_x(ratio(w["template (disk)"], w["numpy (disk)"])),
         "report"),
        ("persistent restore (cold), template / numpy", fmt_x(ratio(rs["template (disk)"], rs["numpy (disk)"])),
         "report"),
        ("node-local write, local tier / numpy", fmt_x(ratio(w["local tier (/dev/shm)"], w["numpy (/dev/shm)"])),
         "report"),
        ("node-local restore, local tier / numpy",
         fmt_x(ratio(rs["local tier (/dev/shm)"], rs["numpy (/dev/shm)"])), "report"),
    ]
    s.notes.append(f"State: {fmt_mb(r['bytes'])} of random float32 (incompressible) in {r['arrays']} arrays of "
                   f"{' x '.join(map(str, r['shape']))}, each split along its first axis over {r['devices']} CPU "
                   f"devices (one process); median of {r['reps']} interleaved repetitions after a warm-up round; "
                   "ratios are of medians, with the interquartile range of the paired ratios.")
    s.notes.append(f"Persistent tier in {r['disk']}: every write is timed up to the end of an `os.sync()`; the "
                   "page cache was dropped before every restore, by "
                   f"{' and '.join(r['caches_dropped']) or 'nothing'} (`drop_caches`: the whole cache, as root; "
                   "`posix_fadvise`: each file of the folder). Numpy writes one `.npy` per shard and fsyncs it; plain orbax is "
                   "`ocp.StandardCheckpointer` (zstd-compressed OCDBT store, orbax's defaults); the template is "
                   "`Checkpointer(CheckpointConfig(every=1, keep=2))` (orbax's async save of the live arrays, "
                   "uncompressed store). Each step is deleted after its restore, so "
                   "the template's keep-N deletion never runs in a timed save.")
    s.notes.append(f"Node-local tier in {r['shm']} (memory; one process, so no peer to send to): `LocalTier.save` "
                   "writes this process's shards straight from their buffers into one file (timed to the end of "
                   "`wait()`, which would also cover sending it to a peer); `restore` maps the file and places each "
                   "shard (on the CPU jax keeps it in the mapped pages, no copy). Every restore is timed until one "
                   "byte of every page of every shard has been read (a mapped file's pages come in then). "
                   "Numpy writes (`np.save` + `os.fsync` per shard) and reads the same bytes in the same folder.")
    s.notes.append("Values restored equal to the saved ones: "
                   + ", ".join(f"{name} {ok}" for name, ok in r["exact"].items()) + ".")
    s.notes.append("1-minute load average before and after: " + ", ".join(f"{x:.1f}" for x in r["load"])
                   + f" on {os.cpu_count()} cores.")
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.tiers", ["--quick"] if quick else [], devices=DEVICES,
                                        timeout_s=600 if quick else 1800, env=cpu_env(DEVICES)))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
