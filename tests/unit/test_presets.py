"""--preset NAME: a task's named experiments, with the flags given beside it winning."""

from __future__ import annotations

import pytest

from job import task
from job.errors import ConfigError
from job.train import config


def test_a_preset_sets_the_model_and_data_and_flags_beside_it_win() -> None:
    lm = task.load("lm")
    cfg = config.parse(["--preset", "1b", "--model.layers", "2", "--steps", "3"], lm)
    assert (cfg.preset, cfg.model.dim, cfg.model.layers, cfg.model.remat, cfg.data.global_batch, cfg.steps) == (
        "1b", 2048, 2, "full", 4, 3)
    assert config.parse(["--model.layers", "2", "--preset", "gpt2-small"], lm).model.layers == 2  # in any order
    assert config.parse([], lm) == config.parse(["--preset", "tiny"], lm).__class__(
        **{**config.parse(["--preset", "tiny"], lm).__dict__, "preset": ""})
    assert config.from_dict(config.to_dict(cfg), lm) == cfg


@pytest.mark.parametrize("name", ["tiny", "gpt2-small", "1b"])
def test_each_lm_preset_names_the_command_that_runs_it_and_validates(name: str) -> None:
    lm = task.load("lm")
    assert f"--preset {name}" in lm.presets[name].__doc__
    config.validate(config.parse(["--preset", name], lm), lm)


def test_an_unknown_preset_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"--preset: expected one of the lm task's presets: tiny, gpt2-small, 1b"):
        config.parse(["--preset", "huge"], task.load("lm"))
    with pytest.raises(ConfigError, match="drop --preset"):
        config.parse(["--preset", "x"], task.load("classify"))
