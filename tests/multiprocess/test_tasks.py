"""The second example task (job/tasks/classify) through the same loop: it learns. What the loop does for
every task is proven once, on the LM (test_train): the same losses on every topology (which holds for this
task too, as its rows are the same however the hosts cut a batch: tests/unit/test_batches.py) and a bitwise
resume after a preemption (for tasks with their own state, optimizer and sharding: the user tasks below,
test_eval_sets and test_sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import train
from tests.records import records, summary

pytestmark = pytest.mark.multiprocess


def test_the_classifier_learns_its_spirals(tmp_path: Path) -> None:
    # measured: eval accuracy 0.99 after 200 steps with the default classifier (2 x 2)
    train(2, 2, tmp_path, "--task", "classify", "--steps", "200", "--eval-every", "200", "--log-every", "50")
    result = summary(tmp_path)
    assert result["task"] == "classify" and result["completed"] is True and result["final_step"] == 200
    assert result["eval_accuracy"] >= 0.9
    assert json.loads((tmp_path / "config.json").read_text())["task"] == "classify"
    assert "samples_per_s" in (tmp_path / "metrics.jsonl").read_text()


def test_an_unknown_task_is_one_clear_error(tmp_path: Path) -> None:
    proc = train(1, 1, tmp_path, "--task", "nope", expect=2)
    assert "--task: expected one of classify, lm" in proc.stderr and "job/tasks/nope/" in proc.stderr


USER_TASK = ("--task", "tests.user_tasks.regression:TASK", "--eval-every", "20", "--log-every", "10")


def test_a_users_task_outside_the_package_with_its_own_optimizer_learns_and_resumes_bitwise(tmp_path: Path) -> None:
    train(2, 2, tmp_path / "straight", *USER_TASK, "--steps", "20")
    result = summary(tmp_path / "straight")
    assert result["task"] == "regression" and result["eval_loss"] < 0.2, result
    lrs = [r["lr"] for r in records(tmp_path / "straight") if r["split"] == "train"]
    assert lrs == pytest.approx([0.05, 0.025])  # its own schedule
    metadata = (tmp_path / "straight" / "checkpoints" / "20" / "default" / "_METADATA").read_text()
    assert '"trace"' in metadata and '"mu"' not in metadata  # SGD's momentum, not AdamW's moments
    train(2, 2, tmp_path / "resumed", *USER_TASK, "--steps", "10")
    resumed = train(2, 2, tmp_path / "resumed", *USER_TASK, "--steps", "20")
    assert "resumed from step 10" in resumed.stderr
    assert summary(tmp_path / "resumed")["params_sha256"] == result["params_sha256"]


def test_each_train_batch_is_asked_of_the_source_once_on_every_process(tmp_path: Path) -> None:
    # the first step's batch is made for its compilation and then handed to the step, not made again; its rows
    # are asked for twice (the check that the source is a pure function), every later batch's once
    asked = tmp_path / "asked"
    train(2, 2, tmp_path / "run", "--task", "tests.user_tasks.counted:TASK", "--steps", "3", "--eval-every", "3",
          "--log-every", "3", ROWS_ASKED=str(asked))
    for process in (0, 1):
        calls = [line.split() for line in Path(f"{asked}.{process}").read_text().splitlines()]
        # 16 rows a step: each process's 2 devices hold 8 of them
        assert [step for split, step, _, _ in calls if split == "train"] == ["0", "0", "1", "2"], (process, calls)
        assert {(start, stop) for _, _, start, stop in calls} == {("0", "8") if process == 0 else ("8", "16")}
    assert summary(tmp_path / "run")["final_step"] == 3


def test_rows_only_one_process_finds_impure_stop_every_process_with_exit_2_naming_that_process(
        tmp_path: Path) -> None:
    # tests/user_tasks/unseeded.py:LATE_ROWS draws rows 8.. from an unseeded generator: process 1's half
    proc = train(2, 1, tmp_path, "--task", "tests.user_tasks.unseeded:LATE_ROWS", "--steps", "3", expect=2)
    for rank in (0, 1):
        said = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                if line.startswith(f"[rank {rank}]") and "ConfigError: the task's rows" in line]
        assert len(said) == 1 and "process 1: rows('train', 0, 8, 16) asked twice: field 'x' differs, first at " \
            "row 8" in said[0], (rank, proc.stderr)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_task_that_imports_only_the_public_names_trains_on_2_x_2(tmp_path: Path) -> None:
    # tests/user_tasks/textures.py: job.task, job.random, job.sharding, job.errors and TrainConfig, nothing else
    # (tests/unit/test_public_api.py holds it to docs/api.md); its source's `size` is its image side
    proc = train(2, 2, tmp_path, "--task", "tests.user_tasks.textures:TASK", "--steps", "4", "--log-every", "2",
                 "--eval-every", "4")
    result = summary(tmp_path)
    assert result["task"] == "textures" and result["completed"] is True and result["final_step"] == 4, result
    assert result["eval_loss"] is not None and result["test_accuracy"] is not None
    assert "eval split test: 40 rows in 3 batches" in proc.stderr  # its split_size: one full pass
    assert "eval split eval: 16 rows in 1 batches" in proc.stderr  # no split_size: --data.eval-batches batches
    assert "FutureWarning" not in proc.stderr  # its `size` is not taken for the old split-size method
