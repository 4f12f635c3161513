"""Fixtures of the Cloud TPU tier: a fresh simulated cloud per test (never skipped: it needs no engine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tpu import fake_gcloud
from tests.tpu.fake_gcloud import ssh as fake_ssh
from tests.tpu.harness import Cloud


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this tier carries the `tpu` marker (`pytest -m "not tpu"` leaves the tier out)."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.tpu)


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    simulated = Cloud(state=tmp_path / "cloud", local=tmp_path / "local")
    yield simulated
    fake_gcloud.kill_leftovers(simulated.state)
    fake_ssh.kill_vms(simulated.state)  # what a test left running detached on the simulated VMs
