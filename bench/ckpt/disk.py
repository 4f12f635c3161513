"""The disk's own rates, what a checkpoint's save and restore can at best reach: written and synced (as `dd
conv=fsync` measures it), written into the page cache only, read back from the page cache and read cold.

    from bench.ckpt.disk import probe, synced_write_rate
    synced_write_rate(folder)      # bytes a second, 2 GiB written in 16 MiB blocks then fsynced
    probe(folder, 2**30)           # Rates: all four, on one 1 GiB file
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from bench.ckpt.baseline import drop_page_cache

BLOCK = 2**24  # 16 MiB a write and a read, as `dd bs=16M`


@dataclasses.dataclass(frozen=True)
class Rates:
    """Bytes a second of one file on the disk under test."""

    synced_write: float  # written, then fsynced: the best a save can reach
    cached_write: float  # written into the page cache only (what an unsynced writer is timed at)
    warm_read: float  # read back from the page cache
    cold_read: float  # read after it was evicted (drop_page_cache); a network file system's server may still cache it
    file_system: str  # "TYPE on MOUNTPOINT"


def _write(path: Path, size: int, *, sync: bool) -> float:
    block = os.urandom(BLOCK)  # random: a compressing file system cannot shrink it
    count = max(1, size // BLOCK)
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(count):
            os.write(fd, block)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return count * BLOCK / (time.perf_counter() - began)


def _read(path: Path) -> float:
    buffer = bytearray(BLOCK)
    total = 0
    began = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return total / (time.perf_counter() - began)


def synced_write_rate(folder: Path, size: int = 2**31) -> float:
    """Bytes a second this disk takes written and synced (`size` bytes in 16 MiB writes, then fsync)."""
    path = folder / "synced-rate"
    try:
        return _write(path, size, sync=True)
    finally:
        path.unlink(missing_ok=True)


def probe(folder: Path, size: int = 2**30) -> Rates:
    """Every rate of `Rates`, on one file of `size` bytes in `folder` (removed after)."""
    path = folder / "disk-probe"
    try:
        synced = _write(path, size, sync=True)
        warm = _read(path)
        drop_page_cache(path)
        cold = _read(path)
        cached = _write(path, size, sync=False)
    finally:
        path.unlink(missing_ok=True)
    return Rates(synced, cached, warm, cold, file_system(folder))


def file_system(path: str | os.PathLike[str]) -> str:
    """'TYPE on MOUNTPOINT' of the file system holding `path` (from /proc/self/mounts)."""
    path = os.path.realpath(path)
    best = ("", "?")
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount, kind = fields[1], fields[2]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                best = (mount, kind)
    except OSError:
        pass
    return f"{best[1]} on {best[0] or '?'}"
