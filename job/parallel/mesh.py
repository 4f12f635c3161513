"""Meshes whose devices span several slices: GPU nodes, or TPU slices of a multislice job.

jax gives the devices of each GPU node (and of each TPU slice) their own
slice number, and `jax.make_mesh` refuses such a set. The number is
`partition_index` where jax has that name (its replacement for `slice_index`)
and `slice_index` before; `partition_of` reads whichever the device carries.
Here the mesh is built the way `mesh_utils.create_hybrid_device_mesh` builds
it, grouping by that number: the leading (data) axis runs across slices over
the slower network (DCN), the other axes stay inside one slice (NVLink / ICI).
Axis names, types and shape are those of the one-slice mesh.

Device order: slices in slice-number order, each slice laid out by jax
(GPU: by device id; TPU: by physical topology). The rows along the leading axis
are then stably sorted by their lowest process index, so every process's rows
form one block and the blocks follow process order, as the data loader expects
(a no-op whenever slice and id order already follow process order).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from job.core.errors import ConfigError

# The device attribute that numbers its slice: the new name first, so that reading it never touches the
# deprecated one where both exist (checked against jax 0.10.2 and 0.12.0.1; CPU devices carry neither).
_SLICE_ATTRIBUTES = ("partition_index", "slice_index")


def partition_of(device: jax.Device) -> int | None:
    """The slice (partition) number of `device`; None when it carries none (CPU devices)."""
    for name in _SLICE_ATTRIBUTES:
        value = getattr(device, name, None)
        if value is not None:
            return value
    return None


def slice_sizes(devices: Sequence[jax.Device]) -> dict[int | None, int]:
    """{slice number: device count}; devices without one count under None."""
    return dict(collections.Counter(partition_of(d) for d in devices))


def spans_slices(devices: Sequence[jax.Device]) -> bool:
    """True when the devices carry more than one distinct slice number."""
    return len(slice_sizes(devices)) > 1


def equal_slices(devices: Sequence[jax.Device], what: str) -> tuple[int, int]:
    """(devices per slice, slice count); ConfigError when the slices differ in size."""
    sizes = slice_sizes(devices)
    if len(set(sizes.values())) > 1:
        found = ", ".join(f"slice {k}: {v}" for k, v in sorted(sizes.items(), key=lambda kv: str(kv[0])))
        raise ConfigError(
            what, expected="the same number of devices in every slice (node or TPU slice)", found=found,
            fix="give every node the same number of GPUs (e.g. one --gpus-per-node for all), "
                "or pass devices= made of whole slices of equal size")
    return next(iter(sizes.values())), len(sizes)


def rows_by_process(array: np.ndarray) -> np.ndarray:
    """`array` with its leading-axis rows stably sorted by their lowest process index."""
    rows = array.reshape(array.shape[0], -1)
    order = sorted(range(len(rows)), key=lambda i: min(d.process_index for d in rows[i]))
    return array[np.asarray(order, dtype=int)]


def hybrid_mesh(devices: Sequence[jax.Device], shape: Sequence[int], axis_names: Sequence[str],
                what: str) -> Mesh:
    """A mesh of `shape` (leading axis across slices, the rest inside one) with Auto axes.

    `shape[0]` must be a multiple of the slice count and the product of
    `shape[1:]` must divide the devices of one slice (the callers check).
    """
    _, slices = equal_slices(devices, what)
    inner = (shape[0] // slices, *shape[1:])
    granules: dict[int | None, list[jax.Device]] = collections.defaultdict(list)
    for device in devices:
        granules[partition_of(device)].append(device)
    # one mesh per slice, stacked along the leading axis in slice order (create_hybrid_device_mesh with
    # dcn shape (slices, 1, ...), grouping by partition_of instead of by the slice_index attribute alone)
    blocks = [mesh_utils.create_device_mesh(inner, granules[key], allow_split_physical_axes=True)
              for key in sorted(granules, key=lambda k: -1 if k is None else k)]  # None: no slice number
    array = np.concatenate(blocks, axis=0)
    return Mesh(rows_by_process(array), tuple(axis_names),
                axis_types=(AxisType.Auto,) * len(shape))


__all__ = ["equal_slices", "hybrid_mesh", "partition_of", "rows_by_process",
           "slice_sizes", "spans_slices"]
