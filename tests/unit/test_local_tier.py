"""The node-local checkpoint tier in one process (job/runs/local_tier.py, local_format.py): shards round-trip onto
their layout only, a file changed by one bit is never loaded, each run and user has its own private folder, the
processes agree on one step whatever each one's folder lists (several processes on several nodes stood in for by
threads sharing a key-value store), a save that would not fit is skipped with one warning, and a completed run
leaves no folder. The server: tests/unit/test_local_transport.py; several real processes, each rule, a corrupted
file and two checkouts: tests/multiprocess/test_local_tier.py; a lost node: tests/slurm/test_retries.py."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from job.errors import ConfigError
from job.runs import local_tier
from job.runs.local_format import DIGEST, Unreadable, layout, read_shards, size_bound, write_shards
from job.runs.local_tier import Group, Listing, LocalTier, RestorePlan, held, open_run_folder, plan_restore, run_folder


def _sharded_state(spec: P) -> dict[str, jax.Array]:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    kernel = jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, spec))
    bias = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P()))
    count = jax.device_put(jnp.int32(3), NamedSharding(mesh, P()))  # a scalar, as an optimizer's step count
    return {"kernel": kernel, "bias": bias, "count": count}


def _abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


@pytest.mark.parametrize("spec", [P(), P("data"), P("data", "model"), P(None, "model")])
def test_every_shard_round_trips_onto_the_same_layout_and_the_file_is_within_its_bound(spec: P, tmp_path: Path) -> None:
    state = _sharded_state(spec)
    fingerprint = layout(state)
    path = tmp_path / "7" / "process-0.jlt"
    assert write_shards(path, state, 7, fingerprint) == path.stat().st_size
    assert path.stat().st_size <= size_bound(_abstract(state), fingerprint) <= path.stat().st_size + 64
    back = read_shards(path, _abstract(state), fingerprint)
    for name in state:
        assert back[name].sharding == state[name].sharding
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(state[name]))


def test_a_state_with_an_empty_array_round_trips(tmp_path: Path) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    state = {**_sharded_state(P("data")),
             "empty": jax.device_put(jnp.zeros((0, 8), jnp.float32), NamedSharding(mesh, P()))}  # e.g. no extra tokens
    write_shards(tmp_path / "f.jlt", state, 7, layout(state))
    back = read_shards(tmp_path / "f.jlt", _abstract(state), layout(state))
    assert back["empty"].shape == (0, 8)
    np.testing.assert_array_equal(np.asarray(back["kernel"]), np.asarray(state["kernel"]))


def test_a_step_saved_on_another_layout_is_refused(tmp_path: Path) -> None:
    state = _sharded_state(P("data"))
    write_shards(tmp_path / "f.jlt", state, 7, layout(state))
    other = _abstract(_sharded_state(P(None, "model")))
    assert layout(other) != layout(state)
    with pytest.raises(Unreadable, match="another layout"):
        read_shards(tmp_path / "f.jlt", other, layout(other))


@pytest.mark.parametrize("where", ["magic", "header", "payload", "last payload byte", "digest", "cut short"])
def test_a_file_changed_by_one_bit_anywhere_is_refused_naming_it(tmp_path: Path, where: str) -> None:
    state = _sharded_state(P("data"))
    path = tmp_path / "f.jlt"
    size = write_shards(path, state, 7, layout(state))
    data = bytearray(path.read_bytes())
    if where == "cut short":
        data = data[:size // 2]
    else:
        at = {"magic": 0, "header": 20, "payload": size // 2, "last payload byte": size - DIGEST - 1,
              "digest": size - 1}[where]
        data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(Unreadable, match=str(path)):
        read_shards(path, _abstract(state), layout(state))


def test_one_process_saves_restores_keeps_two_steps_and_a_completed_run_leaves_nothing(tmp_path: Path) -> None:
    state = _sharded_state(P("data", "model"))
    tier = LocalTier(str(tmp_path), "/runs/a", 2, "node1", _abstract(state))
    assert tier.server is None  # every process on one node: no listener at all
    for done in (2, 4, 6):
        tier.save(done, jax.tree.map(lambda x, d=done: x + d, state))
        tier.wait()
    assert held(tier.folder) == [(4, 0), (6, 0)]
    assert tier.restore(_abstract(state), newer_than=6) is None  # the persistent tier has it, or newer
    step, back = tier.restore(_abstract(state), newer_than=4)
    assert step == 6
    np.testing.assert_array_equal(np.asarray(back["kernel"]), np.asarray(state["kernel"] + 6))
    assert tier.due(4) and not tier.due(5)
    tier.close(completed=True)
    assert not tier.folder.exists() and tier.folder.parent.exists()  # the user's folder stays, for their other runs


def test_a_save_returns_with_its_file_sealed_so_a_crash_right_after_keeps_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What runs on the save's thread (pruning, the peer's copy) may never run: a process killed two steps later
    must still leave this step restorable (seen as a resume from the step before, under load)."""
    stalled = threading.Event()
    monkeypatch.setattr(LocalTier, "_send", lambda self, done, path: stalled.wait(60))
    state = _sharded_state(P("data"))
    tier = LocalTier(str(tmp_path), "/runs/a", 2, "node1", _abstract(state))
    tier.save(4, state)
    assert held(tier.folder) == [(4, 0)]
    back = read_shards(tier.folder / "4" / "process-0.jlt", _abstract(state), layout(state))
    np.testing.assert_array_equal(np.asarray(back["kernel"]), np.asarray(state["kernel"]))
    stalled.set()
    tier.close(completed=True)


def test_a_flipped_byte_in_a_local_file_falls_back_to_the_next_tier_with_one_warning_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = _sharded_state(P("data"))
    tier = LocalTier(str(tmp_path), "/runs/a", 2, "node1", _abstract(state))
    tier.save(4, state)
    tier.wait()
    path = tier.folder / "4" / "process-0.jlt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="job.runs.local_tier"):
        assert tier.restore(_abstract(state), newer_than=2) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(path) in said[0] and "checksum" in said[0], said
    tier.close(completed=True)


# ---------------------------------------------------------------- one folder per run and user


def test_a_runs_folder_is_named_by_its_resolved_dir_and_its_user(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = run_folder("/dev/shm", "runs/example")
    assert first == run_folder("/dev/shm", str(tmp_path / "a" / "runs" / "example"))  # relative = its absolute path
    monkeypatch.chdir(tmp_path / "b")
    assert run_folder("/dev/shm", "runs/example") != first  # another checkout, the same relative run dir
    assert run_folder("/dev/shm", "gs://bucket/runs/x") != run_folder("/dev/shm", "gs://bucket/runs/y")
    assert local_tier.identity("gs://bucket/runs/x") == "gs://bucket/runs/x"  # a bucket's URL as it is
    mine, theirs = run_folder("/dev/shm", "/runs/a", uid=1000), run_folder("/dev/shm", "/runs/a", uid=1001)
    assert mine.parent.name == "jax-job-1000" and theirs.parent.name == "jax-job-1001" and mine.name != theirs.name


def test_the_folders_are_private_and_a_user_folder_of_someone_else_is_one_clear_error(tmp_path: Path) -> None:
    folder = open_run_folder(str(tmp_path / "shm"), "/runs/a")
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.parent.stat().st_mode & 0o777 == 0o700
    folder.parent.chmod(0o755)  # left open by an earlier version: closed again
    assert open_run_folder(str(tmp_path / "shm"), "/runs/a") == folder and folder.parent.stat().st_mode & 0o777 == 0o700

    other = os.getuid() + 1  # the folder of that name was made by this user: to user `other`, someone else's
    (tmp_path / "shm" / f"jax-job-{other}").mkdir()
    with pytest.raises(ConfigError, match=f"jax-job-{other} to be a folder of user {other}.*found 'a folder of user "
                                          f"{os.getuid()}'.*Fix: ask its owner to remove"):
        open_run_folder(str(tmp_path / "shm"), "/runs/a", uid=other)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "shm" / f"jax-job-{other + 1}").symlink_to(tmp_path / "elsewhere")  # a planted link
    with pytest.raises(ConfigError, match="found 'a link of user"):
        open_run_folder(str(tmp_path / "shm"), "/runs/a", uid=other + 1)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_local_dir_the_user_cannot_write_in_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_mkdir = Path.mkdir

    def refused(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith("jax-job-"):  # another user's folder above it: no write permission
            raise PermissionError(13, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(ConfigError, match=r"--ckpt.local-dir: expected a folder where user \d+ can make jax-job-\d+/, "
                                          r"found '.*Permission denied.*Fix: pass --ckpt.local-dir on a folder of yours"):
        open_run_folder(str(tmp_path), "/runs/a")


# ---------------------------------------------------------------- one step for all


class Store:
    """The coordination service's key-value store, for processes stood in for by threads."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout=timeout_in_ms / 1000):
                raise TimeoutError(key)
            return self.values[key]


def _together(count: int, work: Callable[[int], Any]) -> list[Any]:
    """`work(process)` for every process at once, each on its own thread: what each returned (or raised)."""
    out: list[Any] = [None] * count

    def one(p: int) -> None:
        try:
            out[p] = work(p)
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            out[p] = exc

    threads = [threading.Thread(target=one, args=(p,)) for p in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def _tiers(tmp_path: Path, count: int, like: Any, store: Store, nodes: list[str] | None = None) -> list[LocalTier]:
    """A tier for each of `count` processes, each on a node of its own (its name an address the others reach it
    at: 127.0.0.P+1), unless `nodes` names them; a node's folder is tmp_path/NODE."""
    nodes = nodes or [f"127.0.0.{p + 1}" for p in range(count)]
    return _together(count, lambda p: LocalTier(str(tmp_path / nodes[p]), "/runs/a", 2, nodes[p], like,
                                                group=Group(p, count, store)))


def test_the_newest_step_every_process_is_held_for_is_chosen_and_each_reads_from_its_own_node_first() -> None:
    listings = [Listing("node1", ((4, 0), (6, 0), (6, 2)), None),
                Listing("node3", (), None),  # a spare: nothing of its own
                Listing("node2", ((4, 1), (4, 2), (6, 1), (6, 2), (8, 2)), None)]
    assert plan_restore(listings) == RestorePlan(6, (0, 2, 2))  # 8: only process 2's is held
    # persistent 6 is as new
    assert plan_restore([*listings[:2], Listing("node2", listings[2].held, 6)]) == RestorePlan(None)
    assert plan_restore([*listings[:2], Listing("node2", listings[2].held, 4)]).step == 6
    assert RestorePlan.from_json(RestorePlan(6, (0, 2, 2)).to_json()) == RestorePlan(6, (0, 2, 2))


def test_processes_whose_folders_list_different_steps_restore_one_step_fetching_what_their_node_lacks(
        tmp_path: Path) -> None:
    """Three processes on three nodes: node0 holds steps 4 and 6 of processes 0 and 2 (its own and those it was
    sent), node1 only step 4's of process 1 (its step 6 was lost), node2 steps 4 and 6 of processes 1 and 2. Every
    process restores step 6, process 1 fetching its file from process 2 over the network (signed), the others
    reading their own; and each says so through the key-value store with the step in what it says."""
    state = _sharded_state(P("data"))
    like = _abstract(state)
    store = Store()
    tiers = _tiers(tmp_path, 3, like, store)
    assert all(t.server is not None and t.server.server_address[0] == "127.0.0.1" for t in tiers)
    assert [t.peer for t in tiers] == [1, 2, 0]
    for node, files in enumerate(([(4, 0), (4, 2), (6, 0), (6, 2)], [(4, 1)], [(4, 1), (4, 2), (6, 1), (6, 2)])):
        for step, process in files:
            write_shards(tiers[node].folder / str(step) / f"process-{process}.jlt",
                         jax.tree.map(lambda x, s=step, p=process: x + 10 * s + p, state), step, layout(like))
    assert len({tuple(held(t.folder)) for t in tiers}) == 3  # three listings, no two the same
    restored = _together(3, lambda p: tiers[p].restore(like, newer_than=None))
    assert [r[0] for r in restored] == [6, 6, 6], restored
    for p, (_, back) in enumerate(restored):
        np.testing.assert_array_equal(np.asarray(back["kernel"]), np.asarray(state["kernel"] + 60 + p))
    assert tiers[0].sources(6) == ("process 1's from process 2 on 127.0.0.3 over the network; the others' from their "
                                   "own node")
    assert (6, 1) in held(tiers[1].folder)  # held on its node from now on
    assert sorted(k for k in store.values if "/outcome/" in k) == [f"job/local-tier/restore/1/outcome/{p}"
                                                                     for p in range(3)]
    assert all('"step": 6' in store.values[f"job/local-tier/restore/1/outcome/{p}"] for p in range(3))
    _together(3, lambda p: tiers[p].close(completed=False))


def test_when_one_process_cannot_read_its_file_every_process_restores_the_next_tier(tmp_path: Path) -> None:
    state = _sharded_state(P("data"))
    like = _abstract(state)
    tiers = _tiers(tmp_path, 2, like, Store())
    for t in tiers:  # each node holds both files of step 4
        for p in range(2):
            write_shards(t.folder / "4" / f"process-{p}.jlt", state, 4, layout(like))
    damaged = tiers[1].folder / "4" / "process-1.jlt"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    assert _together(2, lambda p: tiers[p].restore(like, newer_than=None)) == [None, None]
    _together(2, lambda p: tiers[p].close(completed=True))


def test_processes_on_one_node_share_its_folder_and_open_no_listener(tmp_path: Path) -> None:
    like = _abstract(_sharded_state(P()))
    tiers = _tiers(tmp_path, 2, like, Store(), nodes=["same", "same"])
    assert [t.server for t in tiers] == [None, None] and [t.peer for t in tiers] == [None, None]
    assert tiers[0].folder == tiers[1].folder == run_folder(str(tmp_path / "same"), "/runs/a")


def test_a_folder_that_is_not_private_on_one_process_stops_every_process_with_the_same_error(tmp_path: Path) -> None:
    like = _abstract(_sharded_state(P()))
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / f"jax-job-{os.getuid()}").symlink_to(tmp_path)  # on node1 only
    store = Store()
    raised = _together(2, lambda p: LocalTier(str(tmp_path / f"node{p}"), "/runs/a", 2, f"node{p}", like,
                                              group=Group(p, 2, store)))
    assert [type(e) for e in raised] == [ConfigError, ConfigError], raised
    assert str(raised[0]) == str(raised[1]) and "--ckpt.local-dir (process 1 on node1)" in str(raised[0])
    assert "a link of user" in str(raised[0])


def test_a_save_that_would_not_fit_is_skipped_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    state = _sharded_state(P())
    tier = LocalTier(str(tmp_path), "/runs/a", 1, "node1", _abstract(state))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100, 90, 10))
    with caplog.at_level(logging.WARNING, logger="job.runs.local_tier"):
        tier.save(1, state)
        tier.save(2, state)
    tier.wait()
    assert held(tier.folder) == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("node-local save of step 1 skipped: expected 2 x ") and "Fix: " in said[0]
    tier.close(completed=True)
