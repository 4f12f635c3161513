"""The plan of a run's step (job/train/plan.py): the run's mesh, its axes asked of the --mesh flag's module and
each error naming the user's flag; the run's opening lines; the plan's old names in the loop, each still
answering with a DeprecationWarning; the loop's side of its hang watchdog alone in one process; the step the restore
is expected at."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import jax
import pytest
from etils import epath

from job import sharding as sh
from job.errors import ConfigError
from job.runs import local_tier
from job.runs.local_format import shard_file
from job.runs.local_tier import Group
from job.runs.tiers import Origin, Tier
from job.runtime.cluster import ClusterInfo
from job.runtime.rollcall import Progress
from job.train import hang, loop, plan
from job.train.config import TrainConfig
from tests.unit.test_local_tier import Store, _together


def test_the_runs_mesh_is_the_one_sharding_builds_for_the_model_axis_or_the_mesh_flag() -> None:
    assert plan.run_mesh(2) == sh.make_mesh(model_axis=2)
    assert dict(plan.run_mesh(1, "data=-1,expert=2").shape) == {"data": 4, "expert": 2}
    devices = jax.devices()[:4]
    mesh = plan.run_mesh(2, devices=devices)
    assert dict(mesh.shape) == {"data": 2, "model": 2} and set(mesh.devices.flat) == set(devices)


def test_a_mesh_that_does_not_fit_the_devices_names_the_users_flag_not_the_function_that_builds_it() -> None:
    with pytest.raises(ConfigError) as raised:
        plan.run_mesh(3)
    assert str(raised.value) == ("--model-axis: expected a positive divisor of the device count 8, found 3. Fix: "
                                 "pass --model-axis one of [1, 2, 4, 8]")
    with pytest.raises(ConfigError) as raised:
        plan.run_mesh(1, "data=-1,model=3")
    assert raised.value.what == "--mesh" and "make_mesh" not in str(raised.value)


def _built(splits: dict[str, int]) -> plan.Built:
    """What the opening lines read of a built run: the preflight's line, the parameters, mesh and eval splits."""
    evaluator = types.SimpleNamespace(plan={split: [None] * 2 for split in splits}, rows=splits.__getitem__)
    return types.SimpleNamespace(  # type: ignore[return-value]
        checked=types.SimpleNamespace(line=lambda: "preflight: 1 process(es) agree"),
        planned=types.SimpleNamespace(params=1234), mesh=types.SimpleNamespace(shape={"data": 4, "model": 2}),
        evaluator=evaluator)


def test_the_opening_lines_say_where_the_state_came_from_and_what_was_built() -> None:
    cfg, task = types.SimpleNamespace(rule="fsdp"), types.SimpleNamespace(name="lm")
    info = ClusterInfo("single", 0, 1, None, None)
    resumed = Origin(12, Tier.PERSISTENT, "runs/x/checkpoints")
    lines = plan.opening_lines(cfg, task, info, _built({"eval": 64}), 12, resumed, [], None)  # type: ignore[arg-type]
    assert lines == ["resumed from step 12 (runs/x/checkpoints)", "preflight: 1 process(es) agree",
                     f"{info.summary()}; task lm; 1234 parameters; mesh {{'data': 4, 'model': 2}}; rule fsdp",
                     "eval split eval: 64 rows in 2 batches"]
    fresh = plan.opening_lines(cfg, task, info, _built({}), 0, Origin(0, Tier.FRESH, ""), [],  # type: ignore[arg-type]
                               "runs/x/checkpoints.before-fresh-start-1")  # type: ignore[arg-type]
    assert fresh[0] == ("--no-resume: starting afresh; the earlier checkpoints are kept in "
                        "runs/x/checkpoints.before-fresh-start-1") and len(fresh) == 3


@pytest.mark.parametrize("name", ["RunPlan", "first_batch", "plan_run", "run_mesh", "run_rules", "train_step_of"])
def test_the_plans_old_names_in_the_loop_answer_with_a_deprecation_warning_naming_the_new_path(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"job.train.loop.{name} is now job.train.plan.{name}"):
        old = getattr(loop, name)
    assert old is getattr(plan, name)
    with pytest.raises(AttributeError):
        loop.no_such_name  # noqa: B018 - an unknown name is still an AttributeError


def test_a_single_process_hang_has_no_roll_call_and_leaves_at_once() -> None:
    info = ClusterInfo("single", 0, 1, None, None)
    watched = hang.Hang(info, Progress(), watchdog_s=600.0)
    assert watched.roll_call() == ""
    watched.leave()  # nothing to wait for
    assert watched.answered == 0


def _expecting(resume: bool = True, local_every: int = 0, local_dir: str = "/dev/shm") -> TrainConfig:
    """The fields of a run's config `expected_start` reads."""
    ckpt = types.SimpleNamespace(local_every=local_every, local_dir=local_dir)
    return types.SimpleNamespace(resume=resume, ckpt=ckpt)  # type: ignore[return-value]


def test_the_restore_is_expected_at_the_newest_saved_step(tmp_path: Path) -> None:
    run_dir, resuming = epath.Path(tmp_path), _expecting()
    assert plan.expected_start(resuming, run_dir) == 0  # no checkpoints folder
    (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save that never completed
    assert plan.expected_start(resuming, run_dir) == 0
    for step in ("4", "12", "10"):
        (tmp_path / "checkpoints" / step).mkdir()
    assert plan.expected_start(resuming, run_dir) == 12
    assert plan.expected_start(_expecting(resume=False), run_dir) == 0


def _held_locally(local_dir: Path, run_dir: Path, step: int, processes: tuple[int, ...] = (0,)) -> None:
    """Sealed node-local files of `step` for `processes` in this node's folder of the run (their names only)."""
    for p in processes:
        path = shard_file(local_tier.run_folder(str(local_dir), str(run_dir)), step, p)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def test_the_restore_is_expected_at_a_node_local_step_newer_than_the_persistent_tiers_newest(tmp_path: Path) -> None:
    run_dir, local_dir = tmp_path / "run", tmp_path / "shm"
    (run_dir / "checkpoints" / "10").mkdir(parents=True)
    resuming = _expecting(local_every=5, local_dir=str(local_dir))
    assert plan.expected_start(resuming, epath.Path(run_dir)) == 10  # the node-local folder holds nothing
    _held_locally(local_dir, run_dir, 5)  # older than the persistent tier's newest: never restored
    assert plan.expected_start(resuming, epath.Path(run_dir)) == 10
    _held_locally(local_dir, run_dir, 15)
    assert plan.expected_start(resuming, epath.Path(run_dir)) == 15
    assert plan.expected_start(_expecting(resume=True, local_dir=str(local_dir)), epath.Path(run_dir)) == 10  # no tier
    assert plan.expected_start(_expecting(resume=False, local_every=5, local_dir=str(local_dir)),
                               epath.Path(run_dir)) == 0  # --no-resume: afresh, whatever either tier holds
    (run_dir / "checkpoints" / "15").mkdir()  # as new in the persistent tier: restored from there
    assert plan.expected_start(resuming, epath.Path(run_dir)) == 15
    (run_dir / "checkpoints" / "20").mkdir()
    assert plan.expected_start(resuming, epath.Path(run_dir)) == 20


def test_every_process_expects_the_node_local_step_process_0_chooses_a_spare_node_holding_none_included(
        tmp_path: Path) -> None:
    """Two processes, the second on a spare node whose folder is empty: the first's node holds step 15 of both
    (its own and the one its dead peer sent), so both expect 15; where process 1's file of 15 is held nowhere,
    both expect the persistent tier's 10. One exchange each, through the key-value store."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "10").mkdir(parents=True)
    nodes = [tmp_path / "node0", tmp_path / "spare"]
    _held_locally(nodes[0], run_dir, 15, processes=(0,))

    def expected(store: Store) -> list[Any]:
        return _together(2, lambda p: plan.local_expected(_expecting(local_every=5, local_dir=str(nodes[p])),
                                                          epath.Path(run_dir), 10, Group(p, 2, store)))

    assert expected(Store()) == [None, None]  # process 1's file of 15 is held on no node
    _held_locally(nodes[0], run_dir, 15, processes=(1,))
    store = Store()
    assert expected(store) == [15, 15]
    assert sorted(store.values) == ["job/local-tier/expected/0", "job/local-tier/expected/1",
                                    "job/local-tier/expected/decided"]