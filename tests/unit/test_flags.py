"""job.core.flags reads --task and --run-dir as the config's parser (tyro) does: checked against it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.tpu.config import run_dir_of as tpu_run_dir
from job.core import flags
from job.runs.provenance import with_run_dir
from job.train import config
from job.train import task as tasks

TASK = tasks.load(tasks.DEFAULT_TASK)
DIRS = st.sampled_from(["runs/a", "b", "/abs/c", "gs://bucket/d", "with space", "x=y"])
RUN_DIR_WORDS = st.one_of(
    st.tuples(st.sampled_from(["--run-dir", "--run_dir"]), DIRS).map(list),
    st.builds(lambda name, d: [f"{name}={d}"], st.sampled_from(["--run-dir", "--run_dir"]), DIRS),
    st.just(["--steps", "3"]),
    st.just(["--log-every=2"]),
)


def _argv(groups: list[list[str]]) -> list[str]:
    return [word for group in groups for word in group]


@settings(max_examples=40, deadline=None)
@given(st.lists(RUN_DIR_WORDS, max_size=5))
def test_the_run_dir_read_and_rewritten_is_the_one_the_parser_takes(groups: list[list[str]]) -> None:
    argv = _argv(groups)
    parsed = config.parse(argv, TASK).run_dir
    assert flags.value(argv, "--run-dir", config.TrainConfig.run_dir) == parsed
    assert tpu_run_dir(("train", *argv)) == (parsed if flags.value(argv, "--run-dir") else None)
    rewritten = with_run_dir(["train", *argv], "runs/new")
    assert rewritten[0] == "train" and config.parse(rewritten[1:], TASK).run_dir == "runs/new"
    assert sum(word.startswith(("--run-dir", "--run_dir")) for word in rewritten) == 1
    assert flags.without(rewritten, "--run-dir") == ["train", *flags.without(argv, "--run-dir")]


def test_a_rerun_of_a_run_given_the_underscore_spelling_writes_into_the_new_folder() -> None:
    assert with_run_dir(["train", "--run_dir", "runs/old", "--steps", "4"], "runs/new") == [
        "train", "--run-dir", "runs/new", "--steps", "4"]


@pytest.mark.parametrize(("argv", "name", "rest"), [
    (["--task", "lm", "--steps", "2"], "lm", ["--steps", "2"]),
    (["--task=digits", "a", "--task", "lm"], "lm", ["a"]),
    (["--steps", "2"], None, ["--steps", "2"]),
    (["--task"], None, ["--task"]),  # no value: left for the parser to refuse
])
def test_the_task_is_the_last_one_given_and_its_command_gets_the_rest(argv: list[str], name: str | None,
                                                                       rest: list[str]) -> None:
    assert tasks.task_name(argv, default=None) == name
    assert tasks.without_task(argv) == rest


def test_a_flag_is_taken_in_both_spellings_of_its_name() -> None:
    assert flags.spellings("--run-dir") == ("--run-dir", "--run_dir")
    assert flags.spellings("--task") == ("--task",)


def test_a_saved_config_flattens_to_the_dotted_names_of_its_flags() -> None:
    assert flags.flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {"a.b": 1, "a.c.d": "x", "e": None}


def test_a_fix_writes_a_value_as_its_caller_gives_it_after_a_flag_or_as_a_keyword() -> None:
    assert flags.passing("--model.attention", "xla") == "--model.attention xla"
    assert flags.passing("kernel", "xla") == "kernel='xla'" and flags.passing("length", 256) == "length=256"
