"""Bad input is one clear error before any gcloud call; the accelerator table; the command line."""

from __future__ import annotations

import dataclasses

import pytest

from deploy.tpu import cli as tpu
from deploy.tpu.accelerators import GENERATIONS, parse_accelerator
from deploy.tpu.config import TpuConfig, run_dir_of, validate_job
from job.errors import ConfigError
from tests.tpu.harness import ROOT
from tests.tpu.sim_runner import SimRunner

GOOD = {"name": "pod-1", "zone": "us-central2-b", "accelerator": "v4-32", "source_dir": str(ROOT),
        "job_args": ("train", "--run-dir", "/mnt/bucket/run")}


@pytest.mark.parametrize(("accelerator", "hosts"), [
    ("v2-8", 1), ("v3-32", 4), ("v4-8", 1), ("v4-16", 2), ("v4-32", 4), ("v4-4096", 512), ("v5p-8", 1),
    ("v5p-128", 16), ("v5litepod-1", 1), ("v5litepod-8", 1), ("v5litepod-16", 4), ("v5litepod-256", 64),
    ("v6e-4", 1), ("v6e-32", 8),
])
def test_accelerator_table_gives_the_worker_count(accelerator: str, hosts: int) -> None:
    assert parse_accelerator(accelerator).hosts == hosts


@pytest.mark.parametrize(("accelerator", "says"), [
    ("v4_32", "GENERATION-SIZE"), ("v4-", "GENERATION-SIZE"), ("", "GENERATION-SIZE"), ("V4-32", "GENERATION-SIZE"),
    ("v4-32 ", "GENERATION-SIZE"), ("v4-012", "GENERATION-SIZE"), ("v7-8", "a known TPU generation"),
    ("v4-12", "multiple of 8"), ("v5litepod-12", "1, 4, 8 or a multiple of 4"), ("v6e-512", "from 16 to 256"),
])
def test_malformed_or_unknown_accelerator_is_a_clear_error(accelerator: str, says: str) -> None:
    with pytest.raises(ConfigError, match="ACCELERATOR") as info:
        parse_accelerator(accelerator)
    assert says in str(info.value) and "Fix:" in str(info.value)


def test_every_generation_has_a_default_runtime() -> None:
    assert {g: GENERATIONS[g].runtime for g in ("v4", "v5litepod", "v6e")} == {
        "v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}
    assert TpuConfig(**{**GOOD, "accelerator": "v6e-8"}).runtime_version == "v2-alpha-tpuv6e"
    assert TpuConfig(**{**GOOD, "runtime": "my-runtime"}).runtime_version == "my-runtime"


@pytest.mark.parametrize(("change", "what"), [
    ({"name": ""}, "TPU_NAME"), ({"name": "My_Pod"}, "TPU_NAME"), ({"name": "pod; rm -rf /"}, "TPU_NAME"),
    ({"zone": ""}, "ZONE"), ({"zone": "us-central2"}, "ZONE"), ({"accelerator": "v4_32"}, "ACCELERATOR"),
    ({"runtime": "base $(id)"}, "RUNTIME"), ({"project": "P"}, "PROJECT"), ({"image": "a b"}, "IMAGE"),
    ({"retries": -1}, "RETRIES"), ({"remote_dir": "../x"}, "--remote-dir"), ({"ship": ("nope",)}, "--ship"),
    ({"job_args": ("train",)}, "--run-dir"), ({"job_args": ("train", "--run-dir", "runs/x")}, "--run-dir"),
    ({"job_args": ("train", "--steps", "3")}, "--run-dir"),
    ({"job_args": ("--steps", "3")}, "ARGS='train --steps 3'"),  # no command first: refused with the fix
    ({"job_args": ("train", "--run-dir", "s3://bucket/run1")}, "gs://BUCKET"),  # only Cloud Storage URLs
    ({"job_args": ("train", "--run-dir", "gs://bucket")}, "not the bucket's root"),  # as the job refuses it
    ({"job_args": ("train", "--run-dir", "gs://Bad_Bucket/run1")}, "lowercase"),
])
def test_bad_values_name_the_variable_expected_and_fix(change: dict, what: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_job(TpuConfig(**{**GOOD, **change}))
    message = str(info.value)
    assert what in message and "expected" in message and "Fix:" in message


def test_a_single_host_slice_may_keep_checkpoints_on_its_disk() -> None:
    validate_job(TpuConfig(**{**GOOD, "accelerator": "v4-8", "job_args": ("train", "--run-dir", "runs/x")}))
    validate_job(TpuConfig(**{**GOOD, "job_args": ("train", "--run-dir=/mnt/shared/run")}))
    validate_job(TpuConfig(**{**GOOD, "job_args": ("demo",)}))  # no checkpoints: no run dir needed


def test_only_the_commands_that_run_the_job_check_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--name=pod-1", "--zone=us-central2-b", "--accelerator=v4-32", "--args=train --run-dir runs/local"]
    assert tpu.main(["delete", *argv], runner=SimRunner(node="READY")) == 0
    assert tpu.main(["pod", *argv], runner=(runner := SimRunner())) == 2 and runner.calls == []
    assert "--run-dir" in capsys.readouterr().err


def test_run_dir_is_read_like_the_job_reads_it() -> None:
    assert run_dir_of(("train", "--run-dir", "a", "--run_dir=b")) == "b"
    assert run_dir_of(("train", "--steps", "3")) is None


def test_command_line_maps_make_variables_to_the_config() -> None:
    command, cfg = tpu.parse_args([
        "pod", "--name=pod-1", "--zone=us-central2-b", "--accelerator=v4-32", "--runtime=", "--project=",
        "--spot=1", "--queued=0", "--image=", "--retries=5", "--dry-run=", f"--source-dir={ROOT}",
        "--args=train --run-dir '/mnt/b/run 1' --name \"a b; $(id)\"",
    ])
    assert command == "pod"
    assert (cfg.spot, cfg.queued, cfg.dry_run, cfg.retries, cfg.runtime, cfg.project, cfg.image) == (
        True, False, False, 5, None, None, None)
    assert cfg.job_args == ("train", "--run-dir", "/mnt/b/run 1", "--name", "a b; $(id)")
    _, cfg = tpu.parse_args(["run", "--name=p", "--zone=us-central2-b", "--accelerator=v4-8", f"--source-dir={ROOT}",
                             "--", "train", "--steps", "3"])
    assert cfg.job_args == ("train", "--steps", "3")


@pytest.mark.parametrize("argv", [
    ["pod", "--spot=maybe"], ["pod", "--retries=-2"], ["pod", "--args=train 'unclosed"], ["frobnicate"],
])
def test_command_line_refuses_bad_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tpu.parse_args([*argv, "--name=p", "--zone=us-central2-b"])
    assert info.value.code == 2
    assert "expected" in capsys.readouterr().err or argv == ["frobnicate"]


@pytest.mark.parametrize("argv", [
    ["--zone=us-central2-b"], ["--name=pod-1"], ["--name=pod-1", "--zone=us-central2-b", "--accelerator=v4_32"],
    ["--name=pod-1", "--zone=us-central2-b", "--accelerator=v4-"],
    ["--name=pod-1", "--zone=us-central2-b", "--args=train", "--", "train"],
])
def test_bad_input_fails_before_any_gcloud_call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    runner = SimRunner()
    assert tpu.main(["pod", f"--source-dir={ROOT}", *argv], runner=runner) == 2
    assert runner.calls == []
    assert capsys.readouterr().err.startswith("error: ")


def test_missing_gcloud_says_how_to_install_it(capsys: pytest.CaptureFixture[str]) -> None:
    runner = SimRunner(has_gcloud=False)
    assert tpu.main(["pod", "--name=pod-1", "--zone=us-central2-b", f"--source-dir={ROOT}"], runner=runner) == 2
    assert runner.calls == []
    err = capsys.readouterr().err
    assert "gcloud" in err and "https://cloud.google.com/sdk/docs/install" in err


def test_config_is_frozen_and_documented() -> None:
    cfg = TpuConfig(**GOOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "x"  # type: ignore[misc]
    source = (ROOT / "deploy" / "tpu" / "config.py").read_text()
    for field in dataclasses.fields(TpuConfig):
        line = next(line for line in source.splitlines() if line.strip().startswith(f"{field.name}:"))
        assert "#" in line, f"field {field.name} has no comment"
