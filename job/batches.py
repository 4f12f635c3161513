"""Global batches from a task's rows: every process makes only the rows its devices hold.

    batch = global_batch(source, NamedSharding(mesh, P("data")), split="train", step=s, size=32)

The rows a process needs come from the sharding itself, so any device order
works as long as each process's rows are one contiguous block, and processes
of one model group (tensor parallelism across processes) make the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from job.errors import ConfigError
from job.task import Rows


def row_span(sharding: Any, size: int) -> tuple[int, int]:
    """[start, stop) of the global rows this process's devices hold under `sharding`."""
    spans = sorted({idx[0].indices(size)[:2] for idx in sharding.addressable_devices_indices_map((size,)).values()})
    start, stop = spans[0][0], max(end for _, end in spans)
    if not all(a_end >= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
        raise ConfigError("batch sharding", expected="each process's rows in one contiguous block", found=spans,
                          fix="order the mesh's devices by process (job.sharding.make_mesh does)")
    return start, stop


def global_batch(source: Rows, sharding: Any, *, split: str, step: int, size: int) -> dict[str, jax.Array]:
    """Batch `step` of `split` as jax.Arrays of `size` rows laid out by `sharding`."""
    start, stop = row_span(sharding, size)
    rows: Mapping[str, Any] = source.rows(split, step, start, stop)
    return {name: jax.make_array_from_process_local_data(sharding, np.asarray(value),
                                                         (size, *np.shape(value)[1:]))
            for name, value in rows.items()}


__all__ = ["global_batch", "row_span"]
