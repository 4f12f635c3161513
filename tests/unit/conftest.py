"""Fixtures shared by the unit tier's files."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import Mesh

from job import sharding as sh


@pytest.fixture(scope="module")
def mesh42() -> Mesh:
    """The ("data", "model") mesh of the 8 CPU devices (tests/conftest.py), data 4 x model 2."""
    assert jax.device_count() == 8, "needs 8 devices: tests/conftest.py sets XLA_FLAGS"
    return sh.make_mesh(model_axis=2)
