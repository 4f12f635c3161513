"""The container tier: the real CPU image, built and run with podman.

Needs root, podman (with runc) and mmdebstrap: the Dockerfile's default base
is made locally (`standin.py`), since no registry is reachable. Without them
the image tests skip with the reason (CI's JOB_REQUIRE_ALL_TIERS=1 makes that
a failure). podman reads `containers.conf` from this folder unless
CONTAINERS_CONF is already set.

Figures (stand-in, build, code-only rebuild, run) are printed at the end of
the session. The session fixtures `podman_env`, `base_image` and `cpu_image`
are in tests/conftest.py: the Slurm tier submits the same image.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.site.sitecustomize import without_fast_compile

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TAG = "localhost/jax-cluster-job-test:cpu"
FIGURES = pytest.StashKey[dict[str, float]]()


@dataclasses.dataclass(frozen=True)
class Built:
    tag: str
    seconds: float
    log: str


def engine_env() -> dict[str, str]:
    """The environment every podman (and docker/*.sh) call of these tests runs with."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(HERE / "containers.conf"))
    env["CONTAINER_ENGINE"] = "podman"
    env["PYTHONPATH"] = str(ROOT)
    # A container compiles as XLA does by default: the fast compile of the tests' own processes
    # (tests/site/sitecustomize.py) reaches it only through XLA_FLAGS, which the ranks pass on; a host run
    # compared with one in containers passes JOB_TESTS_COMPILE=default.
    env["XLA_FLAGS"] = without_fast_compile(env.get("XLA_FLAGS", ""))
    env["JOB_TESTS_COMPILE"] = "default"
    return env


def figure(config: pytest.Config, name: str, seconds: float) -> None:
    config.stash.setdefault(FIGURES, {})[name] = seconds


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, {})
    if figures:
        terminalreporter.section("container tier figures")
        for name, seconds in figures.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")


def build_image(context: Path, tag: str, base: str, env: dict[str, str], timeout: float = 600) -> Built:
    """docker/build.sh of `context` (a repository root), CPU flavour, offline base."""
    argv = ["bash", str(context / "docker" / "build.sh"), "cpu", tag, "--pull=never", f"--build-arg=BASE={base}"]
    began = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - began
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"image build failed (exit {proc.returncode}):\n{log[-6000:]}"
    return Built(tag, seconds, log)


def podman(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout)
