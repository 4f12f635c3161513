"""The one owner of both checkpoint tiers in one process (job/runs/tiers.py): which tier a restore takes (a node-local
step newer than the persistent tier's newest wins, an older one does not, none without the tier, a fresh start with
--no-resume), what it says about it, and when the node-local tier saves. Real processes: tests/multiprocess/
test_local_tier.py and test_resume.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from job.core.errors import ConfigError
from job.runs.checkpoint import abstract
from job.runs.config import CheckpointConfig
from job.runs.local_tier import held
from job.runs.tiers import Checkpoints, Origin, Tier


def _state_of(offset: float) -> dict[str, jax.Array]:
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    return {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(16, 4) + offset,
                                NamedSharding(mesh, PartitionSpec("data"))),
            "b": jax.device_put(np.full(4, offset, np.float32), NamedSharding(mesh, PartitionSpec()))}


def _config(tmp_path: Path, local_every: int, every: int = 100) -> CheckpointConfig:
    return CheckpointConfig(every=every, keep=3, local_every=local_every, local_dir=str(tmp_path / "node"))


def _earlier_run(tmp_path: Path, persistent: list[int], local: list[int]) -> None:
    """A run that saved `persistent` steps (even) to RUN_DIR/checkpoints and `local` ones (odd) to the node-local
    tier (state of step S: every value plus S), then stopped."""
    checkpoints = Checkpoints(epath.Path(tmp_path / "run"), _config(tmp_path, 1, every=2), abstract(_state_of(0.0)),
                              "node1", resume=True, end=100)
    assert checkpoints.restore(lambda: _state_of(0.0)).origin == Origin(0, Tier.FRESH, "")
    for step in sorted(persistent + local):
        tier = checkpoints.due(step)
        assert tier is (Tier.PERSISTENT if step in persistent else Tier.LOCAL)
        checkpoints.save(step, _state_of(float(step)), tier)
    checkpoints.wait()
    assert checkpoints.persistent.all_steps() == sorted(persistent)
    assert sorted({s for s, _ in held(checkpoints.local.folder)}) == sorted(local)
    checkpoints.close(completed=False)


def _restored(tmp_path: Path, *, local_every: int = 1, resume: bool = True, every: int = 100, end: int = 1000,
              stopping: Callable[[], bool] = lambda: False) -> tuple[Origin, Any, Checkpoints]:
    checkpoints = Checkpoints(epath.Path(tmp_path / "run"), _config(tmp_path, local_every, every),
                              abstract(_state_of(0.0)), "node1", resume=resume, end=end, stopping=stopping)
    restored = checkpoints.restore(lambda: _state_of(-1.0))
    return restored.origin, restored.state, checkpoints


def _values(state: Any) -> float:
    return float(np.asarray(state["b"])[0])


def test_a_node_local_step_newer_than_the_persistent_newest_wins_and_says_where_it_came_from(tmp_path: Path) -> None:
    _earlier_run(tmp_path, persistent=[2], local=[3])
    origin, state, checkpoints = _restored(tmp_path)
    assert origin == Origin(3, Tier.LOCAL, "every process's from its own node") and _values(state) == 3.0
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state_of(3.0)["w"]))
    assert origin.said() == "resumed from step 3 (the node-local tier: every process's from its own node)"
    checkpoints.close(completed=True)
    assert not checkpoints.local.folder.exists()  # a completed run leaves no node-local folder


def test_a_node_local_step_older_than_the_persistent_newest_is_not_restored(tmp_path: Path) -> None:
    _earlier_run(tmp_path, persistent=[4], local=[3])
    origin, state, checkpoints = _restored(tmp_path)
    assert origin == Origin(4, Tier.PERSISTENT, str(tmp_path / "run" / "checkpoints")) and _values(state) == 4.0
    assert origin.said() == f"resumed from step 4 ({tmp_path / 'run' / 'checkpoints'})"
    checkpoints.close(completed=False)


def test_without_the_node_local_tier_its_newer_step_is_never_read(tmp_path: Path) -> None:
    _earlier_run(tmp_path, persistent=[2], local=[3])
    origin, state, checkpoints = _restored(tmp_path, local_every=0)
    assert (origin.step, origin.tier, _values(state)) == (2, Tier.PERSISTENT, 2.0)
    assert checkpoints.local is None and checkpoints.due(5) is None
    assert checkpoints.due(2) is None  # the step it restored
    checkpoints.close(completed=True)


def test_no_resume_starts_afresh_moves_the_checkpoints_aside_and_clears_the_node_local_steps(tmp_path: Path) -> None:
    _earlier_run(tmp_path, persistent=[2], local=[3])
    origin, state, checkpoints = _restored(tmp_path, resume=False)
    assert origin == Origin(0, Tier.FRESH, "") and origin.said() is None and _values(state) == -1.0
    assert checkpoints.newest_specs() is None and checkpoints.latest_step() is None
    assert checkpoints.moved is not None and (Path(checkpoints.moved) / "2").is_dir()  # kept, not deleted
    assert checkpoints.local is not None and held(checkpoints.local.folder) == []
    checkpoints.close(completed=False)


def test_a_fresh_start_over_checkpoints_set_aside_as_unreadable_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints" / "2.unreadable-1700000000").mkdir(parents=True)
    checkpoints = Checkpoints(epath.Path(tmp_path / "run"), _config(tmp_path, 0), abstract(_state_of(0.0)), "node1",
                              resume=True, end=10)
    with pytest.raises(ConfigError, match="set aside as unreadable: 2.unreadable-1700000000"):
        checkpoints.restore(lambda: _state_of(-1.0))
    checkpoints.close(completed=False)


def test_the_checkpoints_decide_which_steps_are_saved_and_in_which_tier_a_stop_included(tmp_path: Path) -> None:
    """The persistent tier every 4 steps, at the last (10) and at a stop; the node-local tier every 3 steps
    between them; a step both are due in goes to the persistent tier only; no step is saved twice."""
    stop = {"now": False}
    _, _, checkpoints = _restored(tmp_path, local_every=3, every=4, end=10, stopping=lambda: stop["now"])
    due = {step: checkpoints.due(step) for step in range(1, 13)}
    P, L = Tier.PERSISTENT, Tier.LOCAL
    assert {step: tier for step, tier in due.items() if tier is not None} == {
        3: L, 4: P, 6: L, 8: P, 9: L, 10: P, 12: P}  # 12: both are due, the persistent tier takes it
    for step in (3, 4, 6, 8, 9, 10, 12):
        checkpoints.save(step, _state_of(float(step)), due[step])
        assert checkpoints.due(step) is None and checkpoints.last_saved == step
    checkpoints.wait()
    assert checkpoints.persistent.all_steps() == [8, 10, 12]  # of 4, 8, 10 and 12: --ckpt.keep 3
    assert {s for s, _ in held(checkpoints.local.folder)} <= {3, 6, 9}  # the tier keeps its newest steps
    assert checkpoints.due(13) is None
    stop["now"] = True  # the processes agreed to stop after step 13: saved, in the persistent tier
    assert checkpoints.due(13) is P
    checkpoints.save(13, _state_of(13.0), P)
    checkpoints.wait()
    assert checkpoints.persistent.all_steps() == [10, 12, 13] and checkpoints.due(13) is None
    with pytest.raises(ValueError, match=r"expected the tier due\(step\) gives for step 14 .* found Tier.FRESH"):
        checkpoints.save(14, _state_of(14.0), Tier.FRESH)
    checkpoints.close(completed=True)
