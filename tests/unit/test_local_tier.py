"""The node-local checkpoint tier in one process (job/runs/local_tier.py): shards round-trip onto their layout
only, a peer's server takes and gives files, the newest step complete across processes is chosen, a save that
would not fit is skipped with one warning, and a completed run leaves no folder. Several processes, each rule
and a lost node: tests/multiprocess/test_resume.py and tests/slurm/test_retries.py."""

from __future__ import annotations

import logging
import shutil
from collections import namedtuple
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from job.runs import local_tier
from job.runs.local_tier import LocalTier, held, layout, read_shards, write_shards


def _sharded_state(spec: P) -> dict[str, jax.Array]:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    kernel = jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, spec))
    bias = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P()))
    count = jax.device_put(jnp.int32(3), NamedSharding(mesh, P()))  # a scalar, as an optimizer's step count
    return {"kernel": kernel, "bias": bias, "count": count}


def _abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


@pytest.mark.parametrize("spec", [P(), P("data"), P("data", "model"), P(None, "model")])
def test_every_shard_round_trips_onto_the_same_layout(spec: P, tmp_path: Path) -> None:
    state = _sharded_state(spec)
    fingerprint = layout(state)
    path = tmp_path / "7" / "process-0.jlt"
    assert write_shards(path, state, 7, fingerprint) == path.stat().st_size
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
    with pytest.raises(ValueError, match="another layout"):
        read_shards(tmp_path / "f.jlt", other, layout(other))


def test_one_process_saves_restores_keeps_two_steps_and_a_completed_run_leaves_nothing(tmp_path: Path) -> None:
    state = _sharded_state(P("data", "model"))
    tier = LocalTier(str(tmp_path), "/runs/a", 2, "node1", _abstract(state))
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
    assert not tier.folder.exists()


def test_a_peers_server_takes_a_file_and_gives_it_back(tmp_path: Path) -> None:
    peer = LocalTier(str(tmp_path / "peer"), "/runs/a", 2, "127.0.0.1", _abstract(_sharded_state(P())))
    address = peer.peers[0]["address"]
    sent = tmp_path / "sent.jlt"
    sent.write_bytes(b"bytes" * 1000)
    local_tier._send(address, 4, 3, sent)
    assert held(peer.folder) == [(4, 3)]
    local_tier._fetch(address, 4, 3, tmp_path / "back.jlt")
    assert (tmp_path / "back.jlt").read_bytes() == sent.read_bytes()
    with pytest.raises(FileNotFoundError):
        local_tier._fetch(address, 4, 2, tmp_path / "none.jlt")
    peer.close(completed=False)
    assert peer.folder.exists()  # a run that did not complete keeps its local steps


def test_the_newest_step_is_the_newest_every_process_is_held_for_and_each_reads_from_its_own_node_first(
        tmp_path: Path) -> None:
    tier = LocalTier(str(tmp_path), "/runs/a", 2, "node1", _abstract(_sharded_state(P())))
    tier.count = 3
    tier.peers = {0: {"node": "node1", "held": [[4, 0], [6, 0], [6, 2]]},
                  1: {"node": "node3", "held": []},  # a spare: nothing of its own
                  2: {"node": "node2", "held": [[4, 1], [4, 2], [6, 1], [6, 2], [8, 2]]}}
    assert tier.newest() == 6  # 8: only process 2's is held
    assert [tier.source(6, p) for p in range(3)] == [0, 2, 2]
    assert tier.sources(6) == "process 1's from process 2 on node2 over the network; the others' from their own node"
    tier.close(completed=True)


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
