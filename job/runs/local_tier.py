"""The node-local checkpoint tier: a restart restores a step seconds old instead of one `--ckpt.every` old.

    python -m job train --ckpt.every 500 --ckpt.local-every 10 [--ckpt.local-dir /dev/shm]

Every `--ckpt.local-every` steps each process writes the shards it holds to its run's folder on its own node, and
sends the same file to a peer: the next process, in process order, that runs on another node, which keeps it in
its own node's folder. Losing one node then loses no local step: its processes' shards are held by their peers.
This module is the policy (which folder, when to save, which step to restore and from where); the file is
job/runs/local_format.py (checked by its SHA-256 before any restore), the peer copies job/runs/local_transport.py
(a server for the run's own processes only, every request signed with a per-run secret).

The run's folder is `LOCAL_DIR/jax-job-UID/DIGEST`: one folder of the user's own (0700) under `--ckpt.local-dir`,
and in it one folder per run, named from the user and the run dir resolved to an absolute path (a bucket's URL as
it is), so two runs, two checkouts or two users never share one. A folder of the user's name made by someone else
is one clear error on every process, before anything is saved or read.

At a restart every process lists what its node's folder holds and the newest persistent step it sees; process 0
chooses, through the coordination service's key-value store, the newest step that every process's file is held
for, saved on the same layout, when it is newer than every process's newest persistent step, and where each
process reads its file from (its own node, or the process that holds it). Every process restores that step or,
when any one cannot (a file that fails its checksum, a peer gone), every process restores the persistent tier:
each says the step it restored, and the step is part of what they agree on.

Written here rather than with orbax's emergency checkpointer: that one needs a data-parallel replica axis to
restore from (a pure fsdp mesh gets no local tier), keeps no non-array state, and needs stable process ids.
Here every process's shards are held twice whatever the mesh. A save that would not fit the folder's file
system (memory, for /dev/shm) with room to spare is skipped with one warning. The run's folder is removed when
the run completes; a persistent save (every `--ckpt.every`, at the end, at a preemption) is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from job.core import renamed
from job.core.errors import ConfigError
from job.parallel.multihost import coordination_client
from job.runs import local_transport as transport
from job.runs.local_format import Unreadable, layout, read_shards, shard_file, shard_files, size_bound, write_shards
from job.runtime.host import host_available
from job.runtime.preflight import raise_together

log = logging.getLogger(__name__)

KEY = "job/local-tier/"
KEEP = 2  # local steps kept in a node's folder (the newest, and the one before while the newest is sent)
ROOM_FACTOR = transport.ROOM_FACTOR  # a save needs this many times its bytes free in the folder's file system
TIMEOUT_S = transport.TIMEOUT_S  # a process that does not say its part within this is taken as gone


# ---------------------------------------------------------------- the run's folder


def identity(run_dir: str) -> str:
    """What names a run: its folder resolved to an absolute path, or a bucket's URL as it is."""
    return run_dir if "://" in run_dir else str(Path(run_dir).expanduser().resolve())


def user_folder(local_dir: str, uid: int | None = None) -> Path:
    """The user's own folder under the node-local dir (every run of theirs has one inside)."""
    return Path(local_dir) / f"jax-job-{os.getuid() if uid is None else uid}"


def run_folder(local_dir: str, run_dir: str, uid: int | None = None) -> Path:
    """This run's folder on every node: one per user and run dir (`identity`), the same name on every node."""
    uid = os.getuid() if uid is None else uid
    return user_folder(local_dir, uid) / hashlib.sha256(f"{uid}\n{identity(run_dir)}".encode()).hexdigest()[:32]


def _private(path: Path, uid: int) -> None:
    """`path` made if missing, then checked: a folder (not a link) of user `uid` that no one else may enter."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    found = path.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid:
        kind = "a folder" if stat.S_ISDIR(found.st_mode) else "a link" if stat.S_ISLNK(found.st_mode) else "a file"
        raise ConfigError("--ckpt.local-dir", expected=f"{path} to be a folder of user {uid} (yours, mode 0700)",
                          found=f"{kind} of user {found.st_uid}",
                          fix=f"ask its owner to remove {path}, or pass --ckpt.local-dir on a folder of yours")
    if stat.S_IMODE(found.st_mode) & 0o077:
        path.chmod(0o700)


def open_run_folder(local_dir: str, run_dir: str, uid: int | None = None) -> Path:
    """This run's folder, made private (0700, the user's folder above it too); ConfigError when the user's
    folder belongs to someone else or the node-local dir does not let this user make it."""
    uid = os.getuid() if uid is None else uid
    folder = run_folder(local_dir, run_dir, uid)
    try:
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        _private(folder.parent, uid)
        _private(folder, uid)
    except OSError as exc:
        raise ConfigError("--ckpt.local-dir", expected=f"a folder where user {uid} can make {folder.parent.name}/",
                          found=f"{local_dir} ({type(exc).__name__}: {exc.strerror or exc})",
                          fix="pass --ckpt.local-dir on a folder of yours (a node's scratch disk), or /dev/shm",
                          ) from None
    return folder


def held(folder: Path) -> list[tuple[int, int]]:
    """(step, process) of every sealed file in this node's folder."""
    return shard_files(folder)


def _prune(folder: Path) -> None:
    """Keep the newest KEEP steps of this node's folder."""
    steps = sorted({step for step, _ in held(folder)})
    for step in steps[:-KEEP]:
        shutil.rmtree(folder / str(step), ignore_errors=True)


# ---------------------------------------------------------------- what the processes agree on


@dataclasses.dataclass(frozen=True)
class Group:
    """The run's processes as the tier sees them: this one, how many, and the coordination service's key-value
    store they share (None for one process)."""

    me: int
    count: int
    client: transport.KeyValue | None

    @classmethod
    def of_this_run(cls) -> Group:
        return cls(jax.process_index(), jax.process_count(), coordination_client())

    def everyones(self, key: str, mine: str) -> list[str]:
        """Every process's value of `key`, in process order, this one's being `mine`. Collective."""
        if self.client is None:
            return [mine]
        self.client.key_value_set(f"{key}/{self.me}", mine, allow_overwrite=True)
        return [self.client.blocking_key_value_get(f"{key}/{p}", TIMEOUT_S * 1000) for p in range(self.count)]

    def decided(self, key: str, mine: str, decide: Callable[[list[str]], str]) -> str:
        """What process 0 decides from every process's value of `key` (this one's: `mine`). Collective."""
        if self.client is None:
            return decide([mine])
        self.client.key_value_set(f"{key}/{self.me}", mine, allow_overwrite=True)
        if self.me == 0:
            said = [self.client.blocking_key_value_get(f"{key}/{p}", TIMEOUT_S * 1000) for p in range(self.count)]
            self.client.key_value_set(f"{key}/decided", decide(said), allow_overwrite=True)
        return self.client.blocking_key_value_get(f"{key}/decided", TIMEOUT_S * 1000)


@dataclasses.dataclass(frozen=True)
class Listing:
    """What one process says at a restore: its node, the files its node's folder holds, its newest persistent step."""

    node: str
    held: tuple[tuple[int, int], ...]  # (step, process) of every sealed file
    persistent: int | None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Listing:
        said = json.loads(text)
        return cls(said["node"], tuple((int(s), int(p)) for s, p in said["held"]), said["persistent"])


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """The restore every process carries out: the local step (None: the persistent tier) and, by process, the
    process whose node holds its file (itself when its own node does)."""

    step: int | None
    sources: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RestorePlan:
        said = json.loads(text)
        return cls(said["step"], tuple(said["sources"]))


def plan_restore(listings: Sequence[Listing]) -> RestorePlan:
    """The newest step whose every process's file some process holds, when it is newer than every process's
    newest persistent step; each process's file from its own node when that holds it, else from the first
    process (in process order) that does."""
    count = len(listings)
    holders: dict[tuple[int, int], list[int]] = {}
    for p, listing in enumerate(listings):
        for entry in listing.held:
            holders.setdefault(entry, []).append(p)
    persistent = max((x.persistent for x in listings if x.persistent is not None), default=None)
    complete = [step for step in {s for s, _ in holders} if all((step, p) in holders for p in range(count))]
    newer = [step for step in complete if persistent is None or step > persistent]
    if not newer:
        return RestorePlan(None)
    step = max(newer)
    return RestorePlan(step, tuple(p if p in holders[(step, p)] else holders[(step, p)][0] for p in range(count)))


# ---------------------------------------------------------------- the tier


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another process as this one knows it: its node, its server's address (None: it runs none), and the most
    bytes its file can have."""

    node: str
    address: str | None
    bound: int


class LocalTier:
    """One process's part of the tier: its node's folder, its server, its peer. Collective to make and restore.
    `node`: this process's node name, as the other nodes resolve it; `group` and `uid` stand in for the run's
    processes and the user in tests."""

    def __init__(self, local_dir: str, run_dir: str, every: int, node: str, like: Any, *,
                 group: Group | None = None, uid: int | None = None) -> None:
        self.every, self.node = every, node
        self.warned: set[str] = set()
        self.group = group = Group.of_this_run() if group is None else group
        self.me, self.count = group.me, group.count
        self.fingerprint = layout(like)
        problem: dict[str, Any] | None = None
        self.folder = run_folder(local_dir, run_dir, uid)
        try:
            self.folder = open_run_folder(local_dir, run_dir, uid)
        except ConfigError as exc:
            problem = {"expected": exc.expected, "found": str(exc.found), "fix": exc.fix}
        said = [json.loads(x) for x in group.everyones(f"{KEY}peer", json.dumps(
            {"node": node, "bound": size_bound(like, self.fingerprint), "problem": problem}))]
        for p, x in enumerate(said):  # one error on every process, before any process saves or reads
            if x["problem"]:
                raise_together(ConfigError(f"--ckpt.local-dir (process {p} on {x['node']})", **x["problem"]),
                               "local_folder")
        self.secret = b""  # the run's, when there is a server
        self.server: transport.Server | None = None
        self.peers = [Peer(x["node"], None, x["bound"]) for x in said]
        self.peer = self._peer()
        if len({x["node"] for x in said}) > 1:  # processes on other nodes: a server each, and the run's secret
            self.secret = transport.shared_secret(group.client, self.me, f"{KEY}secret")
            self.server = self._serve(said)
            mine = self.server.address if self.server is not None else ""  # "": this process serves no copies
            addresses = [a or None for a in group.everyones(f"{KEY}address", mine)]
            self.peers = [dataclasses.replace(peer, address=a) for peer, a in zip(self.peers, addresses)]
        self.plan = RestorePlan(None)
        self._restores = 0
        self._writer: threading.Thread | None = None

    def _serve(self, said: list[dict[str, Any]]) -> transport.Server | None:
        """This process's server, listening on its interface toward another node (its peer's); None, with a
        warning, when that cannot be found (this process's shards are then held on its own node only)."""
        assert self.peer is not None  # a run on several nodes: every process has a peer on another
        toward = self.peers[self.peer].node
        try:
            host = transport.bind_host(toward)
            return transport.Server(host, self.folder, self.secret,
                                    bounds=lambda p: said[p]["bound"] if 0 <= p < self.count else None,
                                    received=lambda _step: _prune(self.folder))
        except OSError as exc:
            self._once("serve", f"the node-local tier keeps no copy of another node's shards here: no interface "
                       f"toward {toward} to listen on ({type(exc).__name__}: {exc}); the persistent tier is "
                       "unaffected")
            return None

    def _peer(self) -> int | None:
        """The next process (in process order) on another node; None when every process shares this node (its
        folder already holds their files)."""
        for offset in range(1, self.count):
            p = (self.me + offset) % self.count
            if self.peers[p].node != self.node:
                return p
        return None

    def due(self, done: int) -> bool:
        return self.every > 0 and done % self.every == 0

    def save(self, done: int, state: Any) -> None:
        """Step `done`'s shards of this process, written to its node's folder and sealed now (straight from their
        buffers: the one copy the step must wait for, as the next step may reuse them), then sent on a thread."""
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
        if free < ROOM_FACTOR * size:
            self._once("room", f"node-local save of step {done} skipped: expected {ROOM_FACTOR:.0f} x "
                       f"{size / 2**20:.0f} MiB free in {self.folder}, found {free / 2**20:.0f} MiB. Fix: "
                       "--ckpt.local-dir on a larger file system (node scratch), or a larger --ckpt.local-every")
            return
        path = shard_file(self.folder, done, self.me)
        try:
            write_shards(path, state, done, self.fingerprint)
        except OSError as exc:
            self._once("write", f"node-local save of step {done} failed ({exc}); the persistent tier is unaffected")
            return
        self._writer = threading.Thread(target=self._send, args=(done, path), daemon=True, name="job-local-save")
        self._writer.start()

    def _send(self, done: int, path: Path) -> None:
        """Keep the newest steps, and send step `done`'s file to the peer (on the save's thread)."""
        _prune(self.folder)
        if self.peer is None:
            return
        try:
            address = self.peers[self.peer].address
            assert address is not None  # a peer on another node runs a server
            transport.send(address, self.secret, done, self.me, path)
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

    def sources(self, step: int) -> str:
        """Where every process's shards of the restored `step` came from, in words: 'process 1's from process 0
        on node1 over the network; the others' from their own node'."""
        remote = [(p, q) for p, q in enumerate(self.plan.sources) if q != p] if self.plan.step == step else []
        if not remote:
            return "every process's from its own node"
        said = "; ".join(f"process {p}'s from process {q} on {self.peers[q].node} over the network"
                         for p, q in remote)
        return f"{said}; the others' from their own node" if len(remote) < self.count else said

    def _load(self, step: int, like: Any) -> Any:
        """This process's state of `step`, from its node's folder or from the process the plan names."""
        source, path = self.plan.sources[self.me], shard_file(self.folder, step, self.me)
        if source != self.me:  # held here from now on: the next restart needs no peer
            address = self.peers[source].address
            if address is None:
                raise FileNotFoundError(f"process {source} on {self.peers[source].node} holds it but runs no server")
            transport.fetch(address, self.secret, step, self.me, path)
        return read_shards(path, like, self.fingerprint)

    def restore(self, like: Any, newer_than: int | None) -> tuple[int, Any] | None:
        """The newest local step complete across the processes, when newer than every process's `newer_than` (its
        newest persistent step) and every process reads its part back; else None, on every process alike. The step
        is chosen by process 0 from every process's listing, and each process's outcome names it. Collective."""
        self._restores += 1
        key = f"{KEY}restore/{self._restores}"
        mine = Listing(self.node, tuple(held(self.folder)), newer_than)
        self.plan = RestorePlan.from_json(self.group.decided(
            f"{key}/listing", mine.to_json(),
            lambda said: plan_restore([Listing.from_json(x) for x in said]).to_json()))
        step = self.plan.step
        if step is None:
            return None
        state, problem, path = None, "", shard_file(self.folder, step, self.me)
        try:
            state = self._load(step, like)
        except Exception as exc:  # noqa: BLE001 - any failure here means: the persistent tier, on every process
            problem = str(exc) if isinstance(exc, Unreadable) else f"{path}: {type(exc).__name__}: {exc}"
            log.warning("node-local step %d not restored: %s; every process restores from the next tier",
                        step, problem)
        outcomes = [json.loads(x) for x in self.group.everyones(f"{key}/outcome",
                                                                 json.dumps({"step": step, "problem": problem}))]
        if any(o["step"] != step or o["problem"] for o in outcomes):
            return None
        return step, state

    def clear(self) -> None:
        """A fresh start: no step of an earlier run in this node's folder may be restored later."""
        for path in self.folder.iterdir() if self.folder.exists() else []:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def close(self, completed: bool) -> None:
        """Stop serving; a completed run's folder is removed (every step of it, this node's held ones too)."""
        self.wait()
        if self.server is not None:
            self.server.close()
        if completed:
            shutil.rmtree(self.folder, ignore_errors=True)


# their names before RestorePlan and plan_restore: each warns
__getattr__ = renamed.answer(__name__, {"Plan": "RestorePlan", "choose": "plan_restore"})

__all__ = ["KEEP", "Group", "Listing", "LocalTier", "Peer", "RestorePlan", "held", "identity", "open_run_folder",
           "plan_restore", "run_folder", "user_folder"]
