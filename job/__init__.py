"""A cluster job template for JAX.

    import job
    info = job.initialize()     # local launcher, Slurm, TPU pod, or one process
    mesh = job.multihost.create_device_mesh()

`job.multihost` and `job.sharding` are drop-ins for mlip's multihost utils and
GenSBI's sharding helpers. They load on first use, so `python -m job.launch`
starts without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from job.core.errors import ConfigError, InitOrderError, JobError
from job.runtime.cluster import ClusterInfo
from job.runtime.distributed import Timeouts, initialize

if TYPE_CHECKING:
    from job import multihost, sharding

__version__ = "0.1.0"

_LAZY = ("multihost", "sharding")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"job.{name}")
    raise AttributeError(f"module 'job' has no attribute {name!r}")


__all__ = [
    "ClusterInfo",
    "ConfigError",
    "InitOrderError",
    "JobError",
    "Timeouts",
    "initialize",
    "multihost",
    "sharding",
    "__version__",
]
