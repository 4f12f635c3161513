"""The TPU tier: what only a real chip shows. Not part of `make test-local` (CI has no TPU): on a TPU VM,

    JOB_TESTS_CHIP=1 python -m pytest tests/chip -p no:xdist -v

One program at a time holds the chip (libtpu's lockfile refuses a second), so the pytest process itself never
opens it: every test runs its jax in a process of its own, one after another. Without a TPU every test skips,
saying so (tests/chip/probe.py reads the PCI devices; no jax is started to ask)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.chip.probe import tpu_chips


@pytest.fixture(scope="session", autouse=True)
def on_a_tpu() -> None:
    if not tpu_chips():
        pytest.skip("no TPU (no TPU chip among the PCI devices in /sys/bus/pci/devices): the chip tier runs on a "
                    "TPU VM")
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("no libtpu in this Python, though a TPU chip is there: install jax[tpu] (the tpu lock)")
