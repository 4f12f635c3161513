"""What the checkpoint benchmarks measure the template against: numpy writing the same bytes (synced) and reading
them back onto the same devices, the device-to-host copy alone, and the page cache dropped before a cold read.

Numpy writes one `.npy` per distinct shard of every array (`LEAF-SHARD.npy`: a replicated array is one file, a
sharded one a file per shard), and with `sync` fsyncs each file and the folder, as orbax's tensorstore syncs every
file it writes (its `file_io_sync` default). Used by bench.ckpt.save, .options, bench.tiers and bench.scale.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from job.core import internals
from job.runtime import priority

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def _distinct(x: Any) -> list[Any]:
    """The shards of `x` this process holds, one per distinct index (replica 0 of each)."""
    return [shard for shard in x.addressable_shards if shard.replica_id == 0]


def _key(index: tuple[slice, ...]) -> tuple[tuple[int | None, ...], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


def write_numpy(folder: Path, leaves: list[Any], *, sync: bool = True) -> None:
    """`np.save` of every distinct shard of `leaves` into `folder` (made); with `sync`, each file and the folder
    fsynced. Every device-to-host copy is started at once (`jax.device_get`), as orbax starts them."""
    import jax  # the parent that starts a worker imports this module too; only the worker loads jax

    folder.mkdir()
    host = jax.device_get([[shard.data for shard in _distinct(x)] for x in leaves])
    for i, shards in enumerate(host):
        for j, data in enumerate(shards):
            with (folder / f"{i}-{j}.npy").open("wb") as f:
                np.save(f, data)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
    if sync:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_numpy(folder: Path, leaves: list[Any]) -> list[Any]:
    """The arrays `write_numpy` saved, laid out as `leaves` are: each file `np.load`ed once and put on every
    device holding its index."""
    import jax  # as in write_numpy

    arrays = []
    for i, x in enumerate(leaves):
        host = {_key(shard.index): np.load(folder / f"{i}-{j}.npy") for j, shard in enumerate(_distinct(x))}
        shards = [jax.device_put(host[_key(shard.index)], shard.device) for shard in x.addressable_shards]
        arrays.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards))
    return arrays


def host_copy_seconds(leaves: list[Any]) -> float:
    """Seconds `jax.device_get` takes to copy `leaves` to host memory, every copy started at once: the
    device-to-host link's rate is their bytes over it, the floor of what a save holds the loop for. `leaves` must
    never have been read to the host (jax keeps an array's host copy once read; a second read costs nothing)."""
    import jax  # as in write_numpy

    began = time.perf_counter()
    jax.device_get(leaves)
    return time.perf_counter() - began


def drop_page_cache(path: Path, *, system: bool = False) -> str:
    """Evict `path` (a file, or every file under a folder) from the page cache, so that its next read comes from
    the disk: dirty pages written out (`os.sync`), then each file dropped with posix_fadvise(DONTNEED), which
    needs no root. With `system`, the whole page cache is dropped instead where this process may (`echo 3 >
    /proc/sys/vm/drop_caches`, as root). Says which it did: "drop_caches" or "posix_fadvise"."""
    os.sync()
    if system:
        try:
            DROP_CACHES.write_text("3\n")
            return "drop_caches"
        except OSError:  # not root, or /proc/sys read-only in a container
            pass
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise"


def normal_priority() -> bool:
    """Tensorstore's threads back to nice 0, for plain orbax to write as it would alone (the template may raise
    their nice value; lowering it back needs CAP_SYS_NICE). Whether every one could be."""
    done = True
    for tid in priority.threads_named(internals.TENSORSTORE_WRITER_THREADS):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            done = False
    return done
