"""The TPU tier: what only a real chip shows. Not part of `make test-local` (CI has no TPU): on a TPU VM,

    JOB_TESTS_CHIP=1 python -m pytest tests/chip -p no:xdist -v

One program at a time holds the chip (libtpu's lockfile refuses a second), so the pytest process itself never
opens it: every test runs its jax in a process of its own, one after another. Without a TPU every test skips,
saying so."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def on_a_tpu() -> None:
    asked = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           capture_output=True, text=True, timeout=300, check=False)
    backend = asked.stdout.strip() or f"none ({(asked.stderr.strip().splitlines() or ['no output'])[-1]})"
    if backend != "tpu":
        pytest.skip(f"no TPU (jax backend: {backend}): the chip tier runs on a TPU VM")
