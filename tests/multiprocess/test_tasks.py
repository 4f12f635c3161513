"""The second example task (job/tasks/classify) through the same loop: it learns, resumes exactly after a
preemption, and gives the same losses on every topology, like the LM."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.multiprocess.test_train import REQUEUE, _preempt, losses_on_every_topology, summary, train

pytestmark = pytest.mark.multiprocess

TASK = ("--task", "classify", "--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")


def test_the_classifier_learns_its_spirals(tmp_path: Path) -> None:
    # measured: eval accuracy 0.99 after 200 steps with the default classifier (2 x 2)
    train(2, 2, tmp_path, "--task", "classify", "--steps", "200", "--eval-every", "200", "--log-every", "50")
    result = summary(tmp_path)
    assert result["task"] == "classify" and result["completed"] is True and result["final_step"] == 200
    assert result["eval_accuracy"] >= 0.9
    assert json.loads((tmp_path / "config.json").read_text())["task"] == "classify"
    assert "samples_per_s" in (tmp_path / "metrics.jsonl").read_text()


def test_the_classifier_gives_the_same_losses_on_every_topology(tmp_path: Path) -> None:
    losses_on_every_topology(tmp_path, *TASK)


def test_the_classifier_resumes_exactly_after_a_preemption(tmp_path: Path) -> None:
    flags = (*TASK, "--steps", "30", "--ckpt.every", "10", "--eval-every", "30")
    train(2, 1, tmp_path / "straight", *flags, "--log-every", "30")
    code, output = _preempt(tmp_path / "preempted", 2, 1, signal.SIGTERM, 1, 5, *flags)
    assert code == REQUEUE, output
    stopped = summary(tmp_path / "preempted")
    assert stopped["completed"] is False and 5 <= stopped["final_step"] < 30, output
    resumed = train(2, 1, tmp_path / "preempted", *flags)
    assert f"resumed from step {stopped['final_step']}" in resumed.stderr
    assert summary(tmp_path / "preempted")["params_sha256"] == summary(tmp_path / "straight")["params_sha256"]


def test_an_unknown_task_is_one_clear_error(tmp_path: Path) -> None:
    proc = train(1, 1, tmp_path, "--task", "nope", expect=2)
    assert "--task: expected one of classify, lm" in proc.stderr and "job/tasks/nope/" in proc.stderr


USER_TASK = ("--task", "tests.user_tasks.regression:TASK", "--eval-every", "20", "--log-every", "10")


def test_a_users_task_outside_the_package_with_its_own_optimizer_learns_and_resumes_bitwise(tmp_path: Path) -> None:
    train(2, 2, tmp_path / "straight", *USER_TASK, "--steps", "20")
    result = summary(tmp_path / "straight")
    assert result["task"] == "regression" and result["eval_loss"] < 0.2, result
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if r["split"] == "train"] == pytest.approx([0.05, 0.025])  # its own schedule
    metadata = (tmp_path / "straight" / "checkpoints" / "20" / "default" / "_METADATA").read_text()
    assert '"trace"' in metadata and '"mu"' not in metadata  # SGD's momentum, not AdamW's moments
    train(2, 2, tmp_path / "resumed", *USER_TASK, "--steps", "10")
    resumed = train(2, 2, tmp_path / "resumed", *USER_TASK, "--steps", "20")
    assert "resumed from step 10" in resumed.stderr
    assert summary(tmp_path / "resumed")["params_sha256"] == result["params_sha256"]
