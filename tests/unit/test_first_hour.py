"""What a newcomer meets first: `python -m job` alone and `--help` list the commands and nothing trains without
`train`; a `--task` mistake gets the fix a user can apply (the MODULE:ATTR form, the nearest task's name, the
module's own Tasks); job arguments that start with a flag are refused before anything is queued."""

from __future__ import annotations

import pytest

from deploy.runner import Runner
from deploy.slurm import submit as slurm
from job import __main__ as job_cli
from job.errors import ConfigError
from job.train import task


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
