"""The plan of a run's step (job/train/plan.py): the run's mesh, its axes asked of the --mesh flag's module and
each error naming the user's flag; the run's opening lines; the plan's old names in the loop, each still
answering with a DeprecationWarning; the loop's side of its hang watchdog alone in one process; the step the restore
is expected at."""

from __future__ import annotations

import types
from pathlib import Path

import jax
import pytest
from etils import epath

from job import sharding as sh
from job.errors import ConfigError
from job.runs.tiers import Origin, Tier
from job.runtime.cluster import ClusterInfo
from job.runtime.rollcall import Progress
from job.train import hang, loop, plan


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


def test_the_restore_is_expected_at_the_newest_saved_step(tmp_path: Path) -> None:
    run_dir, resuming = epath.Path(tmp_path), types.SimpleNamespace(resume=True)
    assert plan.expected_start(resuming, run_dir) == 0  # type: ignore[arg-type]  # no checkpoints folder
    (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save that never completed
    assert plan.expected_start(resuming, run_dir) == 0  # type: ignore[arg-type]
    for step in ("4", "12", "10"):
        (tmp_path / "checkpoints" / step).mkdir()
    assert plan.expected_start(resuming, run_dir) == 12  # type: ignore[arg-type]
    assert plan.expected_start(types.SimpleNamespace(resume=False), run_dir) == 0  # type: ignore[arg-type]
