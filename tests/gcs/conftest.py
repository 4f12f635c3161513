"""The Cloud Storage tier: an emulator per test (the fixture `gcs`, tests/conftest.py); skips when it is not installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from job.core import storage
from tests.gcs_emulator import BUCKET, Emulator


@pytest.fixture
def gcs_here(gcs: Emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    """The emulator, used by this test process's own clients (gcsfs through etils.epath)."""
    for name, value in gcs.env.items():
        monkeypatch.setenv(name, value)
    import gcsfs

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:  # chosen when gcsfs was first imported
        pytest.fail("gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set (tests/conftest.py "
                    "sets it first)")
    # etils.epath keeps one gcsfs client per process (it reads the emulator's URL from the environment on
    # every request) with its cached listings: those of an earlier test's emulator must go
    storage.forget_listings(storage.run_path(f"gs://{BUCKET}/"))
    yield gcs
    storage.forget_listings(storage.run_path(f"gs://{BUCKET}/"))

