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

import subprocess

import pytest

from tests.container.engine import HERE, ROOT, TAG, Built, build_image, engine_env

__all__ = ["HERE", "ROOT", "TAG", "Built", "build_image", "engine_env", "figure", "podman"]

FIGURES = pytest.StashKey[dict[str, float]]()


def figure(config: pytest.Config, name: str, seconds: float) -> None:
    config.stash.setdefault(FIGURES, {})[name] = seconds


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, {})
    if figures:
        terminalreporter.section("container tier figures")
        for name, seconds in figures.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")


def podman(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout)
