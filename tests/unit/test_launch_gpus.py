"""The local launcher on a GPU machine: each process gets its own share of the GPUs.

The machine's GPUs are stand-ins: a CUDA_VISIBLE_DEVICES value, or a folder of
empty /dev/nvidiaN files. Each child's environment comes from
`child_environments`; what jax would then open comes from the harness of
test_effective_devices (the real `jax.distributed.initialize`, inert runtime).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from job import launch
from job.errors import ConfigError
from job.runtime.cluster.base import visible_gpus
from job.runtime.preflight import gpus_given
from tests.unit.test_cluster import ALL_FOUR, gpu_task
from tests.unit.test_effective_devices import effective_devices

CMD = ["--", sys.executable, "-c", "pass"]
PORT = 47011


def devices(tmp_path: Path, gpus: int) -> Path:
    """A /dev stand-in with `gpus` nvidiaN files and the driver's other files, which are not GPUs."""
    folder = tmp_path / "dev"
    folder.mkdir()
    for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "null"]:
        (folder / name).touch()
    (folder / "nvidia-caps").mkdir()
    return folder


def children(argv: list[str], env: dict[str, str], device_dir: Path) -> list[dict[str, str]]:
    cfg = launch.parse_args([*argv, *CMD], env=env, device_dir=device_dir)
    return launch.child_environments(cfg, PORT, dict(env))


def cuda_of(envs: list[dict[str, str]]) -> list[str | None]:
    return [env.get("CUDA_VISIBLE_DEVICES") for env in envs]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-n", "8"], ["0", "1", "2", "3", "4", "5", "6", "7"]),
        (["-n", "4"], ["0,1", "2,3", "4,5", "6,7"]),
        (["-n", "1"], ["0,1,2,3,4,5,6,7"]),
        (["-n", "2", "--gpus-per-process", "3"], ["0,1,2", "3,4,5"]),  # two idle
        (["-n", "8", "--gpus-per-process", "1", "--devices-per-process", "2"], [str(i) for i in range(8)]),
    ],
)
def test_device_files_split_into_one_share_per_process(tmp_path: Path, argv: list[str], expected: list[str]) -> None:
    envs = children(argv, {"PATH": "/usr/bin"}, devices(tmp_path, 8))
    assert cuda_of(envs) == expected
    assert [gpus_given(env) for env in envs] == [len(share.split(",")) for share in expected]


@pytest.mark.parametrize(
    ("visible", "argv", "expected"),
    [
        ("4,5,6,7", ["-n", "2"], ["4,5", "6,7"]),  # the physical ids the parent was given
        ("3,1", ["-n", "2"], ["3", "1"]),
        ("GPU-a1,GPU-b2", ["-n", "2"], ["GPU-a1", "GPU-b2"]),
        ("0,1,2,3", ["-n", "2", "--gpus-per-process", "1"], ["0", "1"]),
    ],
)
def test_the_parents_cuda_visible_devices_wins_over_device_files(
    tmp_path: Path, visible: str, argv: list[str], expected: list[str]
) -> None:
    envs = children(argv, {"CUDA_VISIBLE_DEVICES": visible}, devices(tmp_path, 8))
    assert cuda_of(envs) == expected


@pytest.mark.parametrize(
    ("env", "gpus", "argv"),
    [
        ({}, 0, ["-n", "4"]),  # a CPU machine
        ({"CUDA_VISIBLE_DEVICES": ""}, 8, ["-n", "4"]),  # GPUs hidden on purpose
        ({"JAX_PLATFORMS": "cpu"}, 8, ["-n", "4"]),  # `make run-local` on a GPU machine
        ({}, 8, ["-n", "3", "--gpus-per-process", "0"]),  # every process sees every GPU
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 8, ["-n", "3", "--gpus-per-process", "0"]),
    ],
    ids=["no-gpus", "cuda-visible-devices-empty", "jax-platforms-cpu", "do-not-split", "do-not-split-listed"],
)
def test_without_gpus_to_share_the_children_see_what_the_parent_sees(
    tmp_path: Path, env: dict[str, str], gpus: int, argv: list[str]
) -> None:
    cfg = launch.parse_args([*argv, "--devices-per-process", "2", *CMD], env=env, device_dir=devices(tmp_path, gpus))
    assert cfg.gpus == ()
    envs = launch.child_environments(cfg, PORT, dict(env))
    cpu_path = launch.child_environments(
        launch.LaunchConfig(cfg.num_processes, cfg.command, devices_per_process=2), PORT, dict(env))
    assert envs == cpu_path
    assert cuda_of(envs) == [env.get("CUDA_VISIBLE_DEVICES")] * cfg.num_processes


def test_a_missing_device_folder_means_no_gpus(tmp_path: Path) -> None:
    assert launch.gpus_here({}, tmp_path / "absent") == ((), f"0 {tmp_path / 'absent' / 'nvidiaN'} device files")


@pytest.mark.parametrize(
    ("env", "gpus", "argv", "needles"),
    [
        ({}, 8, ["-n", "3"],
         ["--gpus-per-process: expected the 8 visible GPUs", "to split evenly over -n 3 processes",
          "found 2 left over", "Fix: pass -n 8 or another divisor of 8, --gpus-per-process 2 (some idle), "
          "or --gpus-per-process 0"]),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 0, ["-n", "4"],
         ["expected the 3 visible GPUs (CUDA_VISIBLE_DEVICES=0,1,2) to split evenly over -n 4", "found 3 left over"]),
        ({}, 8, ["-n", "3", "--gpus-per-process", "3"],
         ["--gpus-per-process: expected 3 x 3 processes = 9 GPUs at most, found 8 visible", "Fix: "]),
        ({}, 0, ["-n", "2", "--gpus-per-process", "1"], ["expected 1 x 2 processes = 2 GPUs at most, found 0 visible",
                                                         "leave --gpus-per-process out on a machine without GPUs"]),
        ({"JAX_PLATFORMS": "cpu"}, 8, ["-n", "2", "--gpus-per-process", "1"], ["found 0 visible (JAX_PLATFORMS=cpu)"]),
        ({}, 8, ["-n", "2", "--gpus-per-process", "-1"], ["expected a whole number 0..1024, found '-1'"]),
        ({}, 8, ["-n", "2", "--gpus-per-process", "two"], ["expected a whole number 0..1024, found 'two'"]),
    ],
    ids=["uneven", "uneven-listed", "too-many", "none-visible", "jax-platforms-cpu", "negative", "not-a-number"],
)
def test_gpus_that_do_not_fit_are_one_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], env: dict[str, str], gpus: int, argv: list[str],
    needles: list[str],
) -> None:
    with pytest.raises(SystemExit) as caught:
        launch.parse_args([*argv, *CMD], env=env, device_dir=devices(tmp_path, gpus))
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m job.launch" in err
    for needle in needles:
        assert needle in err


def test_the_help_says_how_gpus_are_shared(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        launch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--gpus-per-process K GPUs each process gets, through CUDA_VISIBLE_DEVICES" in text
    assert "0: every process sees them all" in text


def test_a_config_with_a_share_per_process_is_checked() -> None:
    cfg = launch.LaunchConfig(num_processes=2, command=("python",), gpus=("0",))
    with pytest.raises(ConfigError, match="one CUDA_VISIBLE_DEVICES per process"):
        launch.child_environments(cfg, PORT, {})


def test_jax_opens_every_gpu_of_each_childs_share(tmp_path: Path) -> None:
    """Under the launcher (also inside a Slurm allocation), each child's CUDA_VISIBLE_DEVICES picks its
    GPUs and jax opens all of them; before, jax's own Slurm detection narrowed that to [SLURM_LOCALID]."""
    slurm = gpu_task(1, 0, **ALL_FOUR)  # `srun --ntasks-per-node=1 --gpus-per-node=4 python -m job.launch -n 2`
    plain = children(["-n", "2"], {"PATH": "/usr/bin"}, devices(tmp_path, 4))
    inside = children(["-n", "2"], slurm, tmp_path / "absent")
    assert cuda_of(plain) == cuda_of(inside) == ["0,1", "2,3"]
    cases = [(env, mode) for env in [*plain, *inside] for mode in ("after", "before")]
    seen = effective_devices(cases)
    after = [s for s, (_, mode) in zip(seen, cases, strict=True) if mode == "after"]
    before = [s["jax"] for s, (_, mode) in zip(seen, cases, strict=True) if mode == "before"]
    assert [(s["kind"], s["ids"], s["started"]) for s in after] == [("local", None, True)] * 4
    assert [s["jax"] for s in after] == ["all"] * 4
    assert before == ["all", "all", "0", "0"]  # inside Slurm, jax alone took one of each child's two GPUs


def test_visible_gpus_of_a_child_are_its_share(tmp_path: Path) -> None:
    envs = children(["-n", "4"], {}, devices(tmp_path, 8))
    assert [visible_gpus(env) for env in envs] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
