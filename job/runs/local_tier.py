"""The node-local checkpoint tier: a restart restores a step seconds old instead of one `--ckpt.every` old.

    python -m job train --ckpt.every 500 --ckpt.local-every 10 [--ckpt.local-dir /dev/shm/jax-job]

Every `--ckpt.local-every` steps each process writes the shards it holds to a folder on its own node
(`--ckpt.local-dir`, /dev/shm by default: memory), and sends the same bytes over the network to a peer: the next
process, in process order, that runs on another node, which keeps them in its own node's folder. Losing one node
then loses no local step: its processes' shards are held by their peers. A node's folder holds files by step and
by the process whose shards they are (`STEP/process-P.npz`), whoever wrote them.

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
import os
import shutil
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from job.parallel.multihost import coordination_client
from job.runs import headroom

log = logging.getLogger(__name__)

KEY = "job/local-tier/"
META = "__meta__"
KEEP = 2  # local steps kept in a node's folder (the newest, and the one before while the newest is sent)
HEADROOM = 2.0  # a save needs this many times its bytes free in the folder's file system (its own, a peer's)
TIMEOUT_S = 120  # a peer that does not answer within this is taken as gone


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


def pack(state: Any, step: int, fingerprint: str) -> dict[str, np.ndarray]:
    """This process's shards of every array leaf as host arrays (a copy: the step may reuse the buffers)."""
    arrays: dict[str, np.ndarray] = {}
    shards: list[list[list[Any]]] = []
    for i, leaf in enumerate(jax.tree.leaves(state)):
        mine = []
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                raise TypeError("typed PRNG key arrays")
            for k, shard in enumerate(leaf.addressable_shards):
                arrays[f"{i}/{k}"] = np.array(shard.data)
                mine.append(_index(shard.index))
        shards.append(mine)
    meta = {"step": step, "process": jax.process_index(), "layout": fingerprint, "shards": shards}
    arrays[META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return arrays


def unpack(data: bytes, like: Any, fingerprint: str) -> Any:
    """The state from this process's file, its arrays placed as `like`'s shardings say."""
    with np.load(io.BytesIO(data)) as npz:
        meta = json.loads(bytes(npz[META]).decode())
        if meta["layout"] != fingerprint:
            raise ValueError("saved on another layout")
        leaves, treedef = jax.tree.flatten(like)
        out = []
        for i, target in enumerate(leaves):
            if not hasattr(target, "sharding") or target.sharding is None:
                out.append(target)
                continue
            saved = {json.dumps(index): f"{i}/{k}" for k, index in enumerate(meta["shards"][i])}
            placed = []
            for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
                name = saved[json.dumps(_index(index))]
                placed.append(jax.device_put(npz[name], device))
            out.append(jax.make_array_from_single_device_arrays(target.shape, target.sharding, placed))
    return jax.tree.unflatten(treedef, out)


def _to_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _write(path: Path, data: bytes) -> None:
    """Atomically: a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _file(folder: Path, step: int, process: int) -> Path:
    return folder / str(step) / f"process-{process}.npz"


def held(folder: Path) -> list[tuple[int, int]]:
    """(step, process) of every complete file in this node's folder."""
    out = []
    for path in folder.glob("*/process-*.npz") if folder.exists() else []:
        with contextlib.suppress(ValueError):
            out.append((int(path.parent.name), int(path.stem.split("-", 1)[1])))
    return sorted(out)


class _Handler(socketserver.StreamRequestHandler):
    """`GET STEP PROCESS` -> `SIZE` and the bytes (-1: none); `PUT STEP PROCESS SIZE` and the bytes -> `ok`."""

    def handle(self) -> None:
        folder: Path = self.server.folder  # type: ignore[attr-defined]
        words = self.rfile.readline().decode().split()
        if len(words) == 3 and words[0] == "GET":
            path = _file(folder, int(words[1]), int(words[2]))
            data = path.read_bytes() if path.exists() else None
            self.wfile.write(f"{-1 if data is None else len(data)}\n".encode() + (data or b""))
        elif len(words) == 4 and words[0] == "PUT":
            data = self.rfile.read(int(words[3]))
            _write(_file(folder, int(words[1]), int(words[2])), data)
            _prune(folder)
            self.wfile.write(b"ok\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _prune(folder: Path) -> None:
    """Keep the newest KEEP steps of this node's folder."""
    steps = sorted({step for step, _ in held(folder)})
    for step in steps[:-KEEP]:
        shutil.rmtree(folder / str(step), ignore_errors=True)


def _ask(address: str, request: bytes, payload: bytes = b"") -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
        conn.sendall(request + payload)
        reader = conn.makefile("rb")
        head = reader.readline().decode().strip()
        if head == "ok":
            return b""
        size = int(head)
        if size < 0:
            raise FileNotFoundError(request.decode().strip())
        return reader.read(size)


class LocalTier:
    """One process's part of the tier: its node's folder, its server, its peer. Collective to make and restore."""

    def __init__(self, local_dir: str, run_dir: str, every: int, node: str, like: Any) -> None:
        self.every = every
        self.fingerprint = layout(like)
        self.folder = run_folder(local_dir, run_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.me, self.count = jax.process_index(), jax.process_count()
        self.server = _Server(("0.0.0.0", 0), _Handler)
        self.server.folder = self.folder  # type: ignore[attr-defined]
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
        """Step `done`'s shards of this process: copied to host now, written and sent on a thread."""
        self.wait()
        try:
            arrays = pack(state, done, self.fingerprint)
        except TypeError as exc:
            self._once("type", f"the node-local tier keeps no {exc}: only the persistent tier saves this state")
            return
        size = sum(a.nbytes for a in arrays.values())
        free = shutil.disk_usage(self.folder).free
        memory = headroom.host_available()  # a tmpfs's pages are memory, whatever its size says
        if str(self.folder).startswith("/dev/shm") and memory is not None:
            free = min(free, memory)
        if free < HEADROOM * size:
            self._once("room", f"node-local save of step {done} skipped: expected {HEADROOM:.0f} x {size / 2**20:.0f} MiB "
                       f"free in {self.folder}, found {free / 2**20:.0f} MiB. Fix: --ckpt.local-dir on a larger "
                       "file system (node scratch), or a larger --ckpt.local-every")
            return
        self._writer = threading.Thread(target=self._write_and_send, args=(done, arrays), daemon=True,
                                        name="job-local-save")
        self._writer.start()

    def _write_and_send(self, done: int, arrays: dict[str, np.ndarray]) -> None:
        try:
            data = _to_bytes(arrays)
            _write(_file(self.folder, done, self.me), data)
            _prune(self.folder)
            if self.peer is not None:
                _ask(self.peers[self.peer]["address"], f"PUT {done} {self.me} {len(data)}\n".encode(), data)
        except Exception as exc:  # noqa: BLE001 - the tier is a shortcut: the persistent saves go on without it
            self._once("write", f"node-local save of step {done} failed ({type(exc).__name__}: {exc}); the persistent "
                       "tier is unaffected")

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
        remote = [(p, self.source(step, p)) for p in range(self.count) if self.source(step, p) != p]
        if not remote:
            return "every process's from its own node"
        said = "; ".join(f"process {p}'s from process {q} on {self.peers[q]['node']} over the network"
                         for p, q in remote)
        return f"{said}; the others' from their own node" if len(remote) < self.count else said

    def load(self, step: int, like: Any) -> Any:
        """This process's state of `step`, from its node's folder or from the process that holds it."""
        source = self.source(step, self.me)
        if source == self.me:
            data = _file(self.folder, step, self.me).read_bytes()
        else:
            data = _ask(self.peers[source]["address"], f"GET {step} {self.me}\n".encode())
            _write(_file(self.folder, step, self.me), data)  # held here now: the next restart needs no peer
        return unpack(data, like, self.fingerprint)

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


__all__ = ["KEEP", "LocalTier", "held", "layout", "pack", "run_folder", "unpack"]
