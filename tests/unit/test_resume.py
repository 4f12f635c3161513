"""job.runs.resume: a changed flag against the run dir's checkpoints is an error that names it, never a quarantine."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from etils import epath

from job.errors import ConfigError
from job.runs import resume


def state(layers: int = 2, dim: int = 8) -> dict:
    return {"model": {"blocks": {str(i): {"w": jnp.zeros((dim, dim))} for i in range(layers)},
                      "embed": jnp.zeros((16, dim), jnp.bfloat16)},
            "optimizer": {"step": jnp.zeros((), jnp.uint32)}}


def saved(tmp_path: Path, config: dict) -> epath.Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return epath.Path(tmp_path)


CONFIG = {"task": "lm", "steps": 4, "run_dir": "a", "resume": True, "model": {"layers": 2, "dim": 8},
          "data": {"global_batch": 8}, "optim": {"lr": 3e-3}}


def test_flags_are_spelled_as_the_cli_spells_them() -> None:
    assert resume.flag("data.global_batch") == "--data.global-batch"
    assert resume.flag("steps") == "--steps"


@pytest.mark.parametrize(("name", "free"), [("steps", True), ("ckpt.every", True), ("optim.lr", True),
                                            ("optim.decay_steps", True),
                                            ("wandb.project", True), ("model.layers", False), ("optim.b1", False),
                                            ("task", False), ("data.global_batch", False), ("stepsX", False)])
def test_only_fields_that_leave_the_state_as_it_was_are_free(name: str, free: bool) -> None:
    assert resume.is_free(name) is free


def test_config_changes_lists_every_differing_leaf_and_ignores_where_the_run_runs() -> None:
    given = {**CONFIG, "steps": 8, "run_dir": "b", "model": {"layers": 3, "dim": 8, "new": 1}}
    assert resume.config_changes(CONFIG, given) == [("model.layers", 2, 3), ("model.new", None, 1), ("steps", 4, 8)]
    assert resume.config_changes(CONFIG, CONFIG) == []


def test_leaf_specs_name_every_array_by_its_path_with_shape_and_dtype() -> None:
    specs = resume.leaf_specs(state(layers=1))
    assert specs == {"model/blocks/0/w": ((8, 8), "float32"), "model/embed": ((16, 8), "bfloat16"),
                     "optimizer/step": ((), "uint32")}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state(layers=1))
    assert resume.leaf_specs(abstract) == specs  # orbax's tree metadata has the same shape and dtype fields


def test_state_differences_name_missing_new_and_reshaped_leaves() -> None:
    old, new = resume.leaf_specs(state(layers=2)), resume.leaf_specs(state(layers=3, dim=4))
    lines = resume.state_differences(old, new)
    assert "model/blocks/2/w: built by this run, not in the checkpoint" in lines
    assert "model/embed: saved bfloat16[16, 8], built bfloat16[16, 4]" in lines
    assert resume.state_differences(old, old) == []


def test_a_changed_state_flag_is_one_error_naming_the_flag_its_saved_and_given_values_and_the_fixes(
        tmp_path: Path) -> None:
    run_dir = saved(tmp_path, CONFIG)
    given = {**CONFIG, "steps": 8, "model": {"layers": 3, "dim": 8}}
    with pytest.raises(resume.StateMismatch) as err:
        resume.check(run_dir, given, 4, resume.leaf_specs(state(layers=2)), state(layers=3))
    message = str(err.value)
    assert isinstance(err.value, ConfigError)  # bad input: exit 2
    assert "--model.layers saved 2, given 3" in message
    assert "--steps" not in message  # free to change: never a suspect
    assert "checkpoint step 4" in message and "model/blocks/2/w" in message
    assert "rerun with the saved flags (--model.layers 2)" in message
    assert "a new --run-dir" in message and "--no-resume" in message and "never deleted" in message


def test_flags_that_leave_the_state_as_it_was_may_change_and_are_returned(tmp_path: Path) -> None:
    run_dir = saved(tmp_path, CONFIG)
    given = {**CONFIG, "steps": 8, "optim": {"lr": 1e-3}}
    changes = resume.check(run_dir, given, 4, resume.leaf_specs(state()), state())
    assert changes == [("optim.lr", 3e-3, 1e-3), ("steps", 4, 8)]


def test_the_same_flags_with_a_differently_built_state_blame_the_code(tmp_path: Path) -> None:
    run_dir = saved(tmp_path, CONFIG)
    renamed = {"model": {"layers_renamed": state()["model"]["blocks"]}, "optimizer": state()["optimizer"]}
    with pytest.raises(resume.StateMismatch, match="changed code or library versions"):
        resume.check(run_dir, CONFIG, 4, resume.leaf_specs(state()), renamed)


def test_a_run_dir_without_config_json_is_still_checked_by_its_state(tmp_path: Path) -> None:
    with pytest.raises(resume.StateMismatch, match="built differently"):
        resume.check(epath.Path(tmp_path), CONFIG, 2, resume.leaf_specs(state(layers=2)), state(layers=1))
    assert resume.check(epath.Path(tmp_path), CONFIG, 2, resume.leaf_specs(state()), state()) == []


def test_only_set_aside_checkpoints_left_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    directory = epath.Path(tmp_path / "checkpoints")
    directory.mkdir()
    resume.refuse_fresh_start_over_set_aside(directory)  # nothing set aside: a new run may start
    (directory / "4.unreadable-1796000000").mkdir()
    with pytest.raises(ConfigError) as err:
        resume.refuse_fresh_start_over_set_aside(directory)
    assert "4.unreadable-1796000000" in str(err.value) and "--no-resume" in str(err.value)


@pytest.mark.parametrize(("names", "holds"), [((), False), (("notes.txt",), False), (("4",), True),
                                              (("6.orbax-checkpoint-tmp",), True), (("2.unreadable-1",), True)])
def test_holds_checkpoints_sees_every_kind_of_step_folder(tmp_path: Path, names: tuple[str, ...],
                                                          holds: bool) -> None:
    for name in names:
        (tmp_path / name).mkdir()
    assert resume.holds_checkpoints(epath.Path(tmp_path)) is holds
    assert resume.holds_checkpoints(epath.Path(tmp_path / "missing")) is False


def test_a_fresh_start_moves_the_old_checkpoints_aside_and_deletes_nothing(tmp_path: Path) -> None:
    directory = epath.Path(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "4" / "data").write_bytes(b"weights")
    moved = resume.move_aside_for_fresh_start(directory)
    assert moved is not None and moved.name.startswith(resume.FRESH_START)
    assert (Path(moved) / "4" / "data").read_bytes() == b"weights"
    assert not directory.exists()
    assert resume.move_aside_for_fresh_start(directory) is None


@pytest.mark.parametrize("name", ["lm", "classify"])
def test_a_saved_config_json_turns_back_into_the_same_config(name: str) -> None:
    from job import task
    from job.train import config

    chosen = task.load(name)
    cfg = config.parse(["--steps", "7", "--optim.name", "lion", "--ema.decay", "0.5", "--rule", "fsdp"], chosen)
    assert config.from_dict(json.loads(config.to_json(cfg)), chosen) == cfg
    older = {k: v for k, v in config.to_dict(cfg).items() if k != "ema"}  # written before --ema existed
    assert config.from_dict(older, chosen).ema == config.EmaConfig()
    with pytest.raises(ConfigError, match=r"config.json.optim: expected fields of OptimConfig .* found \['nope'\]"):
        config.from_dict({**config.to_dict(cfg), "optim": {"nope": 1}}, chosen)
