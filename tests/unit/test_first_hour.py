"""What a newcomer meets first: `python -m job` alone and `--help` list the commands and nothing trains without
`train`; a `--task` mistake gets the fix a user can apply (the MODULE:ATTR form, the nearest task's name, the
module's own Tasks); job arguments that start with a flag are refused before anything is queued."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from deploy.runner import Runner
from deploy.slurm import submit as slurm
from job import __main__ as job_cli
from job.errors import ConfigError
from job.train import batches, config, task
from tests import launching
from tests.user_tasks import regression, unseeded


def test_python_m_job_alone_lists_the_commands_and_trains_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert job_cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m job COMMAND [ARGS]") and "python -m job train" in err
    assert "python -m job eval --run-dir" in err and "`python -m job COMMAND --help`" in err


@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_help_lists_the_commands_not_the_train_flags(word: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert job_cli.main([word]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m job COMMAND [ARGS]") and "python -m job runs" in out
    assert "--optim.lr" not in out


def test_flags_without_a_command_are_refused_with_the_train_they_lack(capsys: pytest.CaptureFixture[str]) -> None:
    assert job_cli.main(["--steps", "5"]) == 2
    assert "Fix: python -m job train --steps 5" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "fix"), [
    ("stripes.task", "pass --task stripes.task:TASK (MODULE:ATTR"),
    ("stripes/task.py", "pass --task stripes.task:TASK (MODULE:ATTR"),
    ("classfy", "pass --task classify (did you mean classify?)"),
    ("lmm", "pass --task lm (did you mean lm?)"),
    ("zzz", "pass --task lm, or --task MODULE:ATTR for a task in your own package"),
])
def test_a_task_name_mistake_gets_the_fix_a_user_can_apply(given: str, fix: str) -> None:
    with pytest.raises(ConfigError) as raised:
        task.load(given)
    assert raised.value.fix.startswith(fix), raised.value.fix


def test_a_missing_attribute_names_the_modules_tasks() -> None:
    with pytest.raises(ConfigError) as raised:
        task.load("tests.user_tasks.regression:TAKS")
    assert raised.value.found == "no TAKS in tests.user_tasks.regression"
    assert raised.value.fix == "pass --task tests.user_tasks.regression:TASK"


def test_slurm_refuses_job_arguments_without_a_command_before_anything_is_queued(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert slurm.main(["--dry-run", "--", "--steps", "5"], runner=Runner(dry_run=True)) == 2
    err = capsys.readouterr().err
    assert "ARGS: expected a command of python -m job first" in err and "Fix: ARGS='train --steps 5'" in err


def test_an_unseeded_source_stops_the_run_before_its_first_step_naming_the_split_the_step_and_the_fix(
        tmp_path: Path) -> None:
    proc = launching.run([sys.executable, "-m", "job", "train", "--task", "tests.user_tasks.unseeded:TASK",
                          "--steps", "5", "--run-dir", str(tmp_path / "run")], JAX_PLATFORMS="cpu")
    assert proc.returncode == 2, launching.explain(proc)
    error = [line for line in proc.stderr.splitlines() if "rows(" in line]
    assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("the task's rows: expected rows(split, step, start, stop) a pure function of its arguments" in error[0]
            and "process 0: rows('train', 0, 0, 16) asked twice: field 'x' differs, first at row 0" in error[0]
            and "Fix: draw the rows' randomness from job.random" in error[0]), error
    assert not list((tmp_path / "run").glob("checkpoints/*")), "nothing trained, nothing saved"


def test_a_pure_source_asked_twice_is_the_same_and_each_kind_of_difference_is_named() -> None:
    pure = regression.Rows(features=3)
    rows, problem = batches.impurity(pure, "train", 4, 2, 6)
    assert problem is None and np.array_equal(rows["x"], pure.rows("train", 4, 2, 6)["x"])
    assert batches.impurity(unseeded.Rows(3, fresh_from=4), "train", 0, 0, 6)[1] == (
        "rows('train', 0, 0, 6) asked twice: field 'x' differs, first at row 4")

    class Grows:  # each answer has one column more: another shape; from the third on, one field more
        calls = 0

        def rows(self, split: str, step: int, start: int, stop: int) -> dict:
            self.calls += 1
            more = {"extra": np.zeros(1)} if self.calls > 3 else {}
            return {"x": np.zeros((stop - start, self.calls), np.float32), **more}

    grows = Grows()
    assert batches.impurity(grows, "eval", 1, 0, 2)[1] == (
        "rows('eval', 1, 0, 2) asked twice: field 'x' float32[2, 1], then float32[2, 2]")
    assert batches.impurity(grows, "eval", 1, 0, 2)[1] == (
        "rows('eval', 1, 0, 2) asked twice: fields ['x'], then ['extra', 'x']")


def test_a_data_config_without_the_fields_the_loop_reads_is_one_error_naming_them() -> None:
    @dataclasses.dataclass(frozen=True)
    class BatchOnly:  # a user's data config that forgot eval_batches
        global_batch: int = 16

    own = dataclasses.replace(regression.TASK, data_config=BatchOnly)
    with pytest.raises(ConfigError) as raised:
        config.validate(config.defaults(own), own)
    assert str(raised.value) == ("Task.data_config of regression: expected a dataclass with the fields global_batch "
                                 "and eval_batches (the loop reads them), found 'BatchOnly without eval_batches'. "
                                 "Fix: add global_batch: int = 32 and eval_batches: int = 2 to it "
                                 "(docs/your-model.md)")


def test_sampling_from_a_run_of_another_task_is_one_error_naming_the_run_dir(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from job.tasks.lm import task as lm_task
    from job.train import trained

    classify_cfg = config.defaults(task.load("classify"))
    monkeypatch.setattr(trained, "load_model", lambda run_dir, step, ema=False: (object(), classify_cfg))
    assert lm_task.TASK.commands["sample"](["--run-dir", "runs/spirals"]) == 2
    err = capsys.readouterr().err
    assert "--run-dir: expected a run of the lm task" in err and "a run of task classify" in err, err
    assert "Traceback" not in err
