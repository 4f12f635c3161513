"""The node-local checkpoint tier: a restart restores a step seconds old instead of one `--ckpt.every` old.

    python -m job train --ckpt.every 500 --ckpt.local-every 10 [--ckpt.local-dir /dev/shm/jax-job]

Every `--ckpt.local-every` steps each process writes the shards it holds to a folder on its own node
(`--ckpt.local-dir`, /dev/shm by default: memory), and sends the same bytes over the network to a peer: the next
process, in process order, that runs on another node, which keeps them in its own node's folder. Losing one node
then loses no local step: its processes' shards are held by their peers. A node's folder holds files by step and
by the process whose shards they are (`STEP/process-P.jlt`: a JSON header, then each shard's raw bytes),
whoever wrote them. A save writes the shards straight from their buffers (the one copy the loop waits for), and
sends the file on a thread (sendfile); a restore maps the file and copies each shard once, onto its device.

At a restart (a spare in place of a lost node, or the same nodes) every process lists what its node's folder
holds and where it listens; the newest step that every process's shards are somewhere for, saved on the same
layout (process count and every array's shape, dtype and sharding), is restored when it is newer than the
newest persistent checkpoint: each process reads its own file, or asks the process that holds it for the bytes
(a process on a spare node has none of its own). If any process cannot, all restore from the persistent tier.

Written here rather than with orbax's emergency checkpointer: that one needs a data-parallel replica axis to
restore from (a pure fsdp mesh gets no local tier), keeps no non-array state, and needs stable process ids.
Here every process's shards are held twice whatever the mesh. A save that would not fit the folder's file
system (memory, for /dev/shm) with room to spare is skipped with one warning. The run's folder is removed when
the run completes; a persistent save (every `--ckpt.every`, at the end, at a preemption) is unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import mmap
import os
import shutil
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from job.parallel.multihost import coordination_client
from job.runtime.host import host_available

log = logging.getLogger(__name__)

KEY = "job/local-tier/"
KEEP = 2  # local steps kept in a node's folder (the newest, and the one before while the newest is sent)
HEADROOM = 2.0  # a save needs this many times its bytes free in the folder's file system (its own, a peer's)
TIMEOUT_S = 120  # a peer that does not answer within this is taken as gone
CHUNK = 8 << 20  # bytes read from a connection at a time


def run_folder(local_dir: str, run_dir: str) -> Path:
    """This run's folder under the node-local dir: one per run dir, on every node the same name."""
    return Path(local_dir) / hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]


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


MAGIC = b"JLT1"  # a file: MAGIC, the header's length (8 bytes), the header (JSON), then each shard's bytes
ALIGN = 64  # every shard starts at a multiple of this in the file (aligned views on a memory map)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def write_shards(path: Path, state: Any, step: int, fingerprint: str) -> int:
    """This process's shards of every array leaf, written straight from their buffers (one copy: into the file's
    pages), atomically; the bytes written. Called between steps: the next step may reuse the buffers. Arrays of
    plain dtypes only (`LocalTier.save` keeps a state with typed PRNG keys out)."""
    entries: list[dict[str, Any]] = []
    arrays: list[np.ndarray] = []
    offset = 0
    for i, leaf in enumerate(jax.tree.leaves(state)):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data, order="C")  # (ascontiguousarray would make a scalar 1-d)
            entries.append({"leaf": i, "index": _index(shard.index), "dtype": data.dtype.str, "shape": data.shape,
                            "offset": offset, "nbytes": data.nbytes})
            arrays.append(data)
            offset = _aligned(offset + data.nbytes)
    header = json.dumps({"step": step, "process": jax.process_index(), "layout": fingerprint,
                         "arrays": entries}).encode()
    start = _aligned(len(MAGIC) + 8 + len(header))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        for entry, data in zip(entries, arrays):
            f.seek(start + entry["offset"])
            if data.nbytes:  # the array's own buffer, as bytes (a memoryview of no elements cannot be cast)
                f.write(data.data.cast("B"))
        f.truncate(start + offset)
    os.replace(tmp, path)
    return start + offset


def read_shards(path: Path, like: Any, fingerprint: str) -> Any:
    """The state from this process's file, its arrays placed as `like`'s shardings say (the file is mapped, not
    read: a shard is copied once, onto its device)."""
    with open(path, "rb") as f:
        # private copy-on-write pages: jax may keep a shard in them (no copy on the CPU), and a donated buffer is
        # then written in place without touching the file; closed by the last array viewing it
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if mapped[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path}: not a node-local checkpoint file")
    size = int.from_bytes(mapped[len(MAGIC):len(MAGIC) + 8], "little")
    header = json.loads(mapped[len(MAGIC) + 8:len(MAGIC) + 8 + size])
    if header["layout"] != fingerprint:
        raise ValueError("saved on another layout")
    start = _aligned(len(MAGIC) + 8 + size)
    saved = {(e["leaf"], json.dumps(e["index"])): e for e in header["arrays"]}
    leaves, treedef = jax.tree.flatten(like)
    out = []
    for i, target in enumerate(leaves):
        if getattr(target, "sharding", None) is None:
            out.append(target)
            continue
        placed = []
        for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
            e = saved[(i, json.dumps(_index(index)))]
            view = np.frombuffer(mapped, dtype=np.dtype(e["dtype"]), count=int(np.prod(e["shape"], dtype=np.int64)),
                                 offset=start + e["offset"]).reshape(e["shape"])
            placed.append(jax.device_put(view, device))
        out.append(jax.make_array_from_single_device_arrays(target.shape, target.sharding, placed))
    return jax.tree.unflatten(treedef, out)


def _file(folder: Path, step: int, process: int) -> Path:
    return folder / str(step) / f"process-{process}.jlt"


def held(folder: Path) -> list[tuple[int, int]]:
    """(step, process) of every complete file in this node's folder."""
    out = []
    for path in folder.glob("*/process-*.jlt") if folder.exists() else []:
        with contextlib.suppress(ValueError):
            out.append((int(path.parent.name), int(path.stem.split("-", 1)[1])))
    return sorted(out)


def _receive(reader: io.BufferedIOBase, size: int, path: Path) -> None:
    """`size` bytes from a connection into `path`, atomically, in chunks (never the whole file in memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        left = size
        while left:
            chunk = reader.read(min(left, CHUNK))
            if not chunk:
                raise ConnectionError(f"the connection closed with {left} of {size} bytes still to come")
            f.write(chunk)
            left -= len(chunk)
    os.replace(tmp, path)


class _Handler(socketserver.StreamRequestHandler):
    """`GET STEP PROCESS` -> `SIZE` and the file's bytes (-1: none); `PUT STEP PROCESS SIZE` and the bytes -> `ok`."""

    server: _Server

    def handle(self) -> None:
        folder = self.server.folder
        words = self.rfile.readline().decode().split()
        if len(words) == 3 and words[0] == "GET":
            path = _file(folder, int(words[1]), int(words[2]))
            if not path.exists():
                self.wfile.write(b"-1\n")
                return
            with open(path, "rb") as f:
                self.wfile.write(f"{os.fstat(f.fileno()).st_size}\n".encode())
                self.connection.sendfile(f)
        elif len(words) == 4 and words[0] == "PUT":
            _receive(self.rfile, int(words[3]), _file(folder, int(words[1]), int(words[2])))
            _prune(folder)
            self.wfile.write(b"ok\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    folder: Path  # this node's folder (LocalTier's), which the handler serves


def _prune(folder: Path) -> None:
    """Keep the newest KEEP steps of this node's folder."""
    steps = sorted({step for step, _ in held(folder)})
    for step in steps[:-KEEP]:
        shutil.rmtree(folder / str(step), ignore_errors=True)


def _send(address: str, step: int, process: int, path: Path) -> None:
    """PUT this process's file of `step` to the peer at `address` (the kernel copies it: sendfile)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn, open(path, "rb") as f:
        conn.sendall(f"PUT {step} {process} {os.fstat(f.fileno()).st_size}\n".encode())
        conn.sendfile(f)
        if conn.makefile("rb").readline().strip() != b"ok":
            raise ConnectionError(f"{address} did not take step {step}'s file")


def _fetch(address: str, step: int, process: int, path: Path) -> None:
    """GET `process`'s file of `step` from the process at `address` into `path`."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
        conn.sendall(f"GET {step} {process}\n".encode())
        reader = conn.makefile("rb")
        size = int(reader.readline())
        if size < 0:
            raise FileNotFoundError(f"{address} holds no file of process {process} at step {step}")
        _receive(reader, size, path)


class LocalTier:
    """One process's part of the tier: its node's folder, its server, its peer. Collective to make and restore."""

    def __init__(self, local_dir: str, run_dir: str, every: int, node: str, like: Any) -> None:
        self.every = every
        self.fingerprint = layout(like)
        self.folder = run_folder(local_dir, run_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.me, self.count = jax.process_index(), jax.process_count()
        self.server = _Server(("0.0.0.0", 0), _Handler)
        self.server.folder = self.folder
        threading.Thread(target=self.server.serve_forever, name="job-local-tier", daemon=True).start()
        address = f"{node}:{self.server.server_address[1]}"
        self.client = coordination_client()
        self.peers: dict[int, dict[str, Any]] = {self.me: {"node": node, "address": address,
                                                           "held": held(self.folder)}}
        if self.client is not None:  # everyone's node, address and files; started afresh at every attempt
            self.client.key_value_set(f"{KEY}{self.me}", json.dumps(self.peers[self.me]), allow_overwrite=True)
            for p in range(self.count):
                self.peers[p] = json.loads(self.client.blocking_key_value_get(f"{KEY}{p}", TIMEOUT_S * 1000))
        self.peer = self._peer()
        self._writer: threading.Thread | None = None
        self.warned: set[str] = set()

    def _peer(self) -> int | None:
        """The next process (in process order) on another node; the next process when every one shares a node."""
        for offset in range(1, self.count):
            p = (self.me + offset) % self.count
            if self.peers[p]["node"] != self.peers[self.me]["node"]:
                return p
        return (self.me + 1) % self.count if self.count > 1 else None

    def due(self, done: int) -> bool:
        return self.every > 0 and done % self.every == 0

    def save(self, done: int, state: Any) -> None:
        """Step `done`'s shards of this process, written to its node's folder now (straight from their buffers: the
        one copy the step must wait for, as the next step may reuse them), then sent to the peer on a thread."""
        self.wait()
        leaves = [leaf for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)]
        if any(jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) for leaf in leaves):
            self._once("type", "the node-local tier keeps no typed PRNG key arrays: only the persistent tier saves "
                       "this state")
            return
        size = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)
        free = shutil.disk_usage(self.folder).free
        memory = host_available()  # a tmpfs's pages are memory, whatever its size says
        if str(self.folder).startswith("/dev/shm") and memory is not None:
            free = min(free, memory)
        if free < HEADROOM * size:
            self._once("room", f"node-local save of step {done} skipped: expected {HEADROOM:.0f} x "
                       f"{size / 2**20:.0f} MiB free in {self.folder}, found {free / 2**20:.0f} MiB. Fix: "
                       "--ckpt.local-dir on a larger file system (node scratch), or a larger --ckpt.local-every")
            return
        path = _file(self.folder, done, self.me)
        try:
            write_shards(path, state, done, self.fingerprint)
        except OSError as exc:
            self._once("write", f"node-local save of step {done} failed ({exc}); the persistent tier is unaffected")
            return
        self._writer = threading.Thread(target=self._send, args=(done, path), daemon=True, name="job-local-save")
        self._writer.start()

    def _send(self, done: int, path: Path) -> None:
        try:
            _prune(self.folder)
            if self.peer is not None:
                _send(self.peers[self.peer]["address"], done, self.me, path)
        except Exception as exc:  # noqa: BLE001 - the tier is a shortcut: the persistent saves go on without it
            self._once("send", f"node-local save of step {done}: sending it to process {self.peer} failed "
                       f"({type(exc).__name__}: {exc}); this node holds it, the persistent tier is unaffected")

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _once(self, kind: str, message: str) -> None:
        """One warning of each kind for the run (a skip every K steps would flood the log)."""
        if kind not in self.warned:
            log.warning("%s", message)
        self.warned.add(kind)

    def newest(self) -> int | None:
        """The newest step whose every process's file is held by some process (the same on every process)."""
        have: dict[int, set[int]] = {}
        for info in self.peers.values():
            for step, process in info["held"]:
                have.setdefault(step, set()).add(process)
        complete = [step for step, owners in have.items() if owners >= set(range(self.count))]
        return max(complete) if complete else None

    def source(self, step: int, process: int) -> int:
        """The process `process` reads its file of `step` from: itself when its node holds it."""
        holders = [p for p, info in sorted(self.peers.items()) if [step, process] in map(list, info["held"])]
        return process if process in holders else holders[0]

    def sources(self, step: int) -> str:
        """Where every process's shards of `step` come from, in words: 'process 1's from process 0 on node1 over
        the network; the others' from their own node'."""
        remote = [(p, q) for p in range(self.count) if (q := self.source(step, p)) != p]
        if not remote:
            return "every process's from its own node"
        said = "; ".join(f"process {p}'s from process {q} on {self.peers[q]['node']} over the network"
                         for p, q in remote)
        return f"{said}; the others' from their own node" if len(remote) < self.count else said

    def load(self, step: int, like: Any) -> Any:
        """This process's state of `step`, from its node's folder or from the process that holds it."""
        source, path = self.source(step, self.me), _file(self.folder, step, self.me)
        if source != self.me:  # held here from now on: the next restart needs no peer
            _fetch(self.peers[source]["address"], step, self.me, path)
        return read_shards(path, like, self.fingerprint)

    def restore(self, like: Any, newer_than: int | None) -> tuple[int, Any] | None:
        """The newest local step complete across the processes, when newer than `newer_than` (the persistent
        tier's newest) and every process reads its part back; else None, on every process alike. Collective."""
        self.peers[self.me]["held"] = held(self.folder)  # this node's own listing, as it is now
        step = self.newest()
        if step is None or (newer_than is not None and step <= newer_than):
            return None
        try:
            state, problem = self.load(step, like), ""
        except Exception as exc:  # noqa: BLE001 - any failure here means: the persistent tier, on every process
            state, problem = None, f"{type(exc).__name__}: {exc}"
        failed = [(self.me, problem)] if problem else []
        if self.client is not None:
            self.client.key_value_set(f"{KEY}restored/{self.me}", problem or "ok", allow_overwrite=True)
            said = [self.client.blocking_key_value_get(f"{KEY}restored/{p}", TIMEOUT_S * 1000)
                    for p in range(self.count)]
            failed = [(p, why) for p, why in enumerate(said) if why != "ok"]
        if failed:
            log.warning("node-local step %d not restored: process %d: %s; every process restores from the persistent "
                        "tier", step, *failed[0])
            return None
        return step, state

    def clear(self) -> None:
        """A fresh start: no step of an earlier run in this node's folder may be restored later."""
        for path in self.folder.iterdir() if self.folder.exists() else []:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def close(self, completed: bool) -> None:
        """Stop serving; a completed run's folder is removed (every step of it, this node's held ones too)."""
        self.wait()
        self.server.shutdown()
        self.server.server_close()
        if completed:
            shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["KEEP", "LocalTier", "held", "layout", "read_shards", "run_folder", "write_shards"]
