"""Which rows of a global batch this process's devices hold: the rows a process reads and makes.

    start, stop = row_span(sharding.batch_sharding(mesh), size=32)   # process 1 of 4: (8, 16)

Read from the sharding itself, so any device order works as long as each process's rows are one
contiguous block; processes of one model group (tensor parallelism across processes) get the same
rows. This module never imports jax: the sharding passed in brings it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from job.core.errors import ConfigError

if TYPE_CHECKING:
    from jax.sharding import Sharding


def row_span(sharding: Sharding, size: int) -> tuple[int, int]:
    """[start, stop) of the global rows this process's devices hold under `sharding`."""
    held = sharding.addressable_devices_indices_map((size,)).values()
    spans = sorted({idx[0].indices(size)[:2] for idx in held if idx is not None})  # None: a device holding none
    start, stop = spans[0][0], max(end for _, end in spans)
    if not all(a_end >= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)):
        raise ConfigError("batch sharding", expected="each process's rows in one contiguous block", found=spans,
                          fix="order the mesh's devices by process (job.sharding.make_mesh does)")
    return start, stop
