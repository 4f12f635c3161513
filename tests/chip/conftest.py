"""The TPU tier: what only a real chip shows. Not part of `make test-local` (CI has no TPU): on a TPU VM,

    JOB_TESTS_CHIP=1 python -m pytest tests/chip -p no:xdist -v

One process at a time holds the chip: the tests run in one pytest process, each training command in turn.
Without a TPU every test skips, saying so."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def on_a_tpu() -> None:
    import jax

    if jax.default_backend() != "tpu":
        pytest.skip(f"no TPU (jax backend: {jax.default_backend()}): the chip tier runs on a TPU VM")
