"""deploy.slurm without a cluster: validation, golden sbatch scripts and argv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import submitit.slurm.slurm as submitit_slurm

from deploy import slurm
from deploy.runner import RecordingRunner
from job.errors import ConfigError

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}: run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"{path} differs; if the change is intended, rerun with UPDATE_GOLDEN=1"


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("30", 30), ("90:30", 91), ("01:00:00", 60), ("2-00", 2880), ("1-02:30", 1590), ("0-00:00:59", 1)],
)
def test_slurm_time_formats(text: str, minutes: int) -> None:
    assert slurm.time_minutes(text) == minutes


@pytest.mark.parametrize("text", [" ", "1:2:3:4", "abc", "1h", "-5"])
def test_bad_time_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="TIME: expected MM, MM:SS, HH:MM:SS"):
        slurm.time_minutes(text)


@pytest.mark.parametrize("text", ["0", "00:00:00"])
def test_zero_time_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="TIME: expected a positive duration"):
        slurm.time_minutes(text)


@pytest.mark.parametrize(("nodes", "found"), [("0", "'0'"), ("abc", "'abc'"), ("-2", "'-2'"), ("1.5", "'1.5'")])
def test_bad_nodes_is_one_clear_error_and_nothing_runs(nodes: str, found: str, capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",))
    assert slurm.main(["--nodes", nodes], runner=runner) == 2
    assert f"NODES: expected a whole number >= 1, found {found}" in capsys.readouterr().err
    assert runner.calls == []


def test_missing_sbatch_says_how_to_start_the_local_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=())
    assert slurm.main(["--nodes", "4"], runner=runner) == 2
    err = capsys.readouterr().err
    assert "expected Slurm's sbatch on PATH, found 'no sbatch'" in err
    assert "make slurm-up NODES=4" in err
    assert runner.calls == []


def test_unknown_partition_lists_the_real_ones(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",), responses={("sinfo",): (0, "debug*\ngpu\n")})
    assert slurm.main(["--nodes", "2", "--partition", "big"], runner=runner) == 2
    assert "PARTITION: expected one of debug, gpu, found 'big'" in capsys.readouterr().err
    assert runner.calls == [["sinfo", "-h", "-o", "%P"]]


def test_bad_via_and_gpus_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    runner = RecordingRunner(available=("sbatch",))
    assert slurm.main(["--via", "ssh"], runner=runner) == 2
    assert slurm.main(["--gpus-per-node", "x"], runner=runner) == 2
    err = capsys.readouterr().err
    assert "VIA: expected submitit or sbatch, found 'ssh'" in err
    assert "GPUS_PER_NODE: expected a whole number >= 0, found 'x'" in err


def test_make_style_empty_values_mean_unset() -> None:
    cfg = slurm.parse(["--nodes", "4", "--partition", "", "--time", "", "--gpus-per-node", "", "--qos", "",
                       "--via", "", "--", "train", "--steps", "5"])
    assert cfg == slurm.SlurmConfig(nodes=4, args=("train", "--steps", "5"))


def _sbatch_text(cfg: slurm.SlurmConfig) -> str:
    return submitit_slurm._make_sbatch_string(
        command="/venv/bin/python -u -m submitit.core._submit /logs", folder="/logs",
        **slurm.submitit_parameters(cfg),
    )


def test_golden_sbatch_script_cpu() -> None:
    cfg = slurm.SlurmConfig(nodes=4, partition="debug", time="02:00:00", account="proj", qos="normal")
    text = _sbatch_text(cfg)
    assert "#SBATCH --ntasks-per-node=1" in text and "gpus" not in text
    check_golden("submitit_cpu.sbatch", text)


def test_golden_sbatch_script_gpu() -> None:
    cfg = slurm.SlurmConfig(nodes=2, time="1-00:00:00", gpus_per_node=8, cpus_per_task=12)
    text = _sbatch_text(cfg)
    assert "#SBATCH --ntasks-per-node=8" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --signal=USR2@120" in text
    check_golden("submitit_gpu.sbatch", text)


def test_golden_plain_sbatch_argv() -> None:
    cfg = slurm.SlurmConfig(nodes=4, gpus_per_node=4, partition="gpu", image="docker://example/job:cuda",
                            via="sbatch", args=("train", "--name", "a b; $(id)"))
    argv = slurm.sbatch_argv(cfg)
    argv = [a.replace(str(slurm.SBATCH_SCRIPT), "slurm/train.sbatch") for a in argv]
    argv = [a.replace(os.sys.executable, "/venv/bin/python") for a in argv]
    assert argv[-3:] == ["train", "--name", "a b; $(id)"]  # user arguments stay separate argv items
    check_golden("sbatch_gpu.argv", "\n".join(argv) + "\n")


def test_sbatch_submission_goes_through_the_runner(tmp_path: Path) -> None:
    runner = RecordingRunner(available=("sbatch",), responses={("sbatch",): (0, "1234\n")})
    cfg = slurm.SlurmConfig(nodes=2, via="sbatch", log_dir=str(tmp_path))
    sub = slurm.submit(cfg, runner)
    assert sub.job_id == "1234" and sub.log == tmp_path / "1234-0.log"
    assert runner.calls[0][:3] == ["sbatch", "--parsable", "--job-name=jax-job"]


def test_args_as_one_shell_style_string_as_make_passes_them() -> None:
    from deploy.slurm import parse

    assert parse(["--args=train --name 'a b; $(id)' ;"]).args == ("train", "--name", "a b; $(id)", ";")
    assert parse(["--args=train", "--", "demo"]).args == ("demo",)  # words after -- win
    assert parse([]).args == ("train", "--run-dir", "runs/slurm")
    with pytest.raises(SystemExit):
        parse(["--args=train --name 'open"])
