"""The node-local tier's file: one process's shards of one step, sealed by a checksum (job/runs/local_tier.py).

A file (`STEP/process-P.jlt`) is MAGIC, the header's length (8 bytes, little-endian), the header (JSON: the step,
the process, the layout's fingerprint and every shard's leaf, index, dtype, shape, offset and size), zero padding,
each shard's raw bytes (each starting at a multiple of ALIGN: aligned views on a memory map), and last the SHA-256
of every byte before it. A save writes the shards straight from their buffers into a temporary file (the one copy
the step waits for), hashed alongside on a thread, and the file has its name only once its digest is written. A
restore checks the digest before a shard is placed: a file changed by one bit is refused, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

MAGIC = b"JLT2"  # JLT1 files (no digest) are refused as unreadable: a restore then uses the persistent tier
ALIGN = 64  # every shard starts at a multiple of this in the file
DIGEST = 32  # bytes of the SHA-256 that ends every file
_LENGTH = 8  # bytes of the header's length
_WIDEST_STEP = 2**63 - 1  # the step with the most digits, for the size bound


def shard_file(folder: Path, step: int, process: int) -> Path:
    """FOLDER/STEP/process-P.jlt: the file of `process`'s shards of `step` in a node's folder (the only place
    the name is spelled)."""
    return folder / str(step) / f"process-{process}.jlt"


def shard_files(folder: Path) -> list[tuple[int, int]]:
    """(step, process) of every file `shard_file` names in `folder`, sorted; none where the folder is not."""
    found = []
    for path in folder.glob("*/process-*.jlt") if folder.exists() else []:
        with contextlib.suppress(ValueError):
            found.append((int(path.parent.name), int(path.stem.split("-", 1)[1])))
    return sorted(found)


class Unreadable(ValueError):
    """A file that is not a sealed node-local checkpoint of this layout (damaged, cut short, or another layout)."""


def layout(tree: Any) -> str:
    """A fingerprint of every array leaf's shape, dtype and sharding, and the process count: a local step is
    restored only onto the same layout (its files hold each process's own shards)."""
    parts = [str(jax.process_count())]
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        mesh = getattr(sharding, "mesh", None)
        parts.append(f"{getattr(leaf, 'shape', None)}|{getattr(leaf, 'dtype', None)}|{spec}|"
                     f"{getattr(mesh, 'shape_tuple', None)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _index(index: tuple[slice, ...]) -> list[list[int | None]]:
    return [[s.start, s.stop] for s in index]


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _header(step: int, process: int, fingerprint: str, entries: list[dict[str, Any]]) -> bytes:
    return json.dumps({"step": step, "process": process, "layout": fingerprint, "arrays": entries}).encode()


def _entries(shards: list[tuple[int, tuple[slice, ...], np.dtype[Any], tuple[int, ...]]]) -> tuple[
        list[dict[str, Any]], int]:
    """The header's entry of every shard (leaf, index, dtype, shape) and the payload's size."""
    entries, offset = [], 0
    for leaf, index, dtype, shape in shards:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        entries.append({"leaf": leaf, "index": _index(index), "dtype": dtype.str, "shape": list(shape),
                        "offset": offset, "nbytes": nbytes})
        offset = _aligned(offset + nbytes)
    return entries, offset


def size_bound(like: Any, fingerprint: str) -> int:
    """The most bytes this process's file of any step can have, from the planned state `like` (shapes, dtypes and
    shardings, no array needed): what a peer accepts from this process before it stores a byte."""
    shards = []
    for i, target in enumerate(jax.tree.leaves(like)):
        sharding = getattr(target, "sharding", None)
        if sharding is None:
            continue
        for index in sharding.addressable_devices_indices_map(target.shape).values():
            shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, target.shape))
            shards.append((i, index, np.dtype(target.dtype), shape))
    entries, payload = _entries(shards)
    header = _header(_WIDEST_STEP, jax.process_count(), fingerprint, entries)
    return _aligned(len(MAGIC) + _LENGTH + len(header)) + payload + DIGEST


def _hash_in_order(update: Callable[[bytes | memoryview], None],
                   pieces: queue.SimpleQueue[bytes | memoryview | None]) -> None:
    """`update` with every piece in order until None (on a thread: hashlib lets go of the GIL for large pieces)."""
    while (piece := pieces.get()) is not None:
        update(piece)


def write_shards(path: Path, state: Any, step: int, fingerprint: str) -> int:
    """This process's shards of every array leaf, written straight from their buffers (one copy: into the file's
    pages) and sealed with the SHA-256 of those bytes, hashed on a thread while the next shard is written; the file
    is complete, sealed and named (atomically) when this returns, which the step waits for: the next step may reuse
    the buffers, and a crash after it leaves this step restorable. The bytes written. Arrays of plain dtypes only
    (typed PRNG keys are kept out by the tier)."""
    shards, arrays = [], []
    for i, leaf in enumerate(jax.tree.leaves(state)):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data, order="C")  # (ascontiguousarray would make a scalar 1-d)
            shards.append((i, shard.index, data.dtype, data.shape))
            arrays.append(data)
    entries, payload = _entries(shards)
    header = _header(step, jax.process_index(), fingerprint, entries)
    prefix = MAGIC + len(header).to_bytes(_LENGTH, "little") + header
    start, end = _aligned(len(prefix)), _aligned(len(prefix)) + payload
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    digest, pieces = hashlib.sha256(), queue.SimpleQueue[bytes | memoryview | None]()
    hasher = threading.Thread(target=_hash_in_order, args=(digest.update, pieces), name="job-local-hash", daemon=True)
    hasher.start()
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            pieces.put(prefix)
            position = len(prefix)
            for entry, data in zip(entries, arrays):
                at = start + entry["offset"]
                pieces.put(bytes(at - position))  # the zeros before the shard (alignment), as the file reads them
                view = data.data.cast("B") if data.nbytes else b""  # its own buffer (an empty view cannot be cast)
                f.seek(at)
                f.write(view)
                pieces.put(view)
                position = at + data.nbytes
            pieces.put(bytes(end - position))
            pieces.put(None)
            f.truncate(end)
            hasher.join()
            f.seek(end)
            f.write(digest.digest())
        os.replace(tmp, path)
    except BaseException:
        pieces.put(None)
        tmp.unlink(missing_ok=True)
        raise
    return end + DIGEST


def _checked(mapped: mmap.mmap, path: Path) -> dict[str, Any]:
    """The header of a mapped file whose digest matches its bytes; Unreadable naming the file otherwise."""
    size = len(mapped)
    if size < len(MAGIC) + _LENGTH + DIGEST or mapped[:len(MAGIC)] != MAGIC:
        raise Unreadable(f"{path}: not a sealed node-local checkpoint file ({size} bytes, expected {MAGIC!r} first)")
    view = memoryview(mapped)
    try:
        if hashlib.sha256(view[:size - DIGEST]).digest() != view[size - DIGEST:]:
            raise Unreadable(f"{path}: its checksum does not match its bytes (changed or damaged since it was "
                             "written)")
        length = int.from_bytes(view[len(MAGIC):len(MAGIC) + _LENGTH], "little")
        header = json.loads(bytes(view[len(MAGIC) + _LENGTH:len(MAGIC) + _LENGTH + length]))
        header["start"] = _aligned(len(MAGIC) + _LENGTH + length)
    finally:
        view.release()
    return header


def read_shards(path: Path, like: Any, fingerprint: str) -> Any:
    """The state from this process's file, its arrays placed as `like`'s shardings say, after its checksum is
    checked (the file is mapped, not read: a shard is copied once, onto its device). Unreadable names the file when
    the checksum, the format or the layout does not match."""
    with open(path, "rb") as f:
        # private copy-on-write pages: jax may keep a shard in them (no copy on the CPU), and a donated buffer is
        # then written in place without touching the file; closed by the last array viewing it
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header = _checked(mapped, path)
    if header.get("layout") != fingerprint:
        raise Unreadable(f"{path}: saved on another layout (process count, or an array's shape, dtype or sharding)")
    saved = {(e["leaf"], json.dumps(e["index"])): e for e in header["arrays"]}
    leaves, treedef = jax.tree.flatten(like)
    out = []
    for i, target in enumerate(leaves):
        if getattr(target, "sharding", None) is None:
            out.append(target)
            continue
        placed = []
        for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
            e = saved.get((i, json.dumps(_index(index))))
            if e is None:
                raise Unreadable(f"{path}: holds no shard of leaf {i} at {_index(index)}")
            view = np.frombuffer(mapped, dtype=np.dtype(e["dtype"]), count=int(np.prod(e["shape"], dtype=np.int64)),
                                 offset=header["start"] + e["offset"]).reshape(e["shape"])
            placed.append(jax.device_put(view, device))
        out.append(jax.make_array_from_single_device_arrays(target.shape, target.sharding, placed))
    return jax.tree.unflatten(treedef, out)


__all__ = ["ALIGN", "DIGEST", "MAGIC", "Unreadable", "layout", "read_shards", "shard_file", "shard_files",
           "size_bound", "write_shards"]
