"""Whether a background save's on-device copy of the state fits beside it; asked again at every save.

A background save (`--ckpt.background`, job.runs.checkpoint) first copies the state on its
devices, so that the next step may donate it: while the save runs the state takes twice its
device memory. Before each such save this compares the bytes of that copy with what is free:

- a device whose backend reports its memory (GPU, TPU: `memory_stats()`): bytes_limit -
  bytes_in_use of that device, against the bytes the copy puts on it;
- a device that does not (CPU: its arrays live in host memory): what the host has available
  (MemAvailable, within the memory limit of this process's cgroup: job.runtime.host), against
  this process's copy times the processes of the run on this host, which all copy at the same moment.

What is free on a device is counted less what the train step's program reserves when it loads
again (the loop passes its compiled figure): a copy that fits between two steps but not beside the
next step's program would fail that step (`RuntimeProgramAllocationFailure`) with the save under way.
The copy is taken when it fits in HEADROOM of what is free everywhere, or when nothing says
what is free. The numbers are read between two steps; the functions here take them as
arguments, so the rule is tested without devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from job.runtime import device_memory
from job.runtime.cluster import environment
from job.runtime.host import host_available

# The copy must fit in 90% of what is free: the other 10% is slack for the allocator's
# fragmentation and what else allocates beside the save (the host's other users, the write's
# buffers). Free memory is read between two steps: a step whose own temporaries need more than
# that beside the copy is not covered (`--ckpt.no-background` is). A copy that does not fit is
# not made: the save is written from the live state on the loop's thread instead.
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class Room:
    """What is free for the copy on this process."""

    devices: Mapping[jax.Device, int | None]  # device -> bytes free on it; None: its backend does not say (CPU)
    host: int | None  # bytes the host has available for the devices that do not say; None: unknown
    processes_on_host: int  # processes of the run on this host, each copying its state at the same moment


@dataclasses.dataclass(frozen=True)
class Fit:
    """One process's answer, and the numbers behind it (the tightest place, for the log line)."""

    fits: bool
    needed: int  # bytes the copy needs there (per device; on the host: for all its processes)
    free: int | None  # bytes free there; None: unknown (the copy is taken)
    processes_on_host: int = 0  # 0: `needed` is per device; N: the host's share for its N processes

    def where(self) -> str:
        """'per device', or 'on the host for its N processes'."""
        if not self.processes_on_host:
            return "per device"
        count = self.processes_on_host
        return f"on the host for its {count} process{'es' if count > 1 else ''}"

    def row(self) -> np.ndarray:
        """(fits, needed, free or -1, processes_on_host), what the processes gather: float32, which travels
        as it is without jax's x64."""
        free = -1 if self.free is None else self.free
        return np.array([self.fits, self.needed, free, self.processes_on_host], np.float32)


def copy_bytes(tree: Any) -> dict[jax.Device, int]:
    """device -> bytes the on-device copy of every array leaf puts on it: a jax.Array's shards this process holds,
    and for a state planned but not made (ShapeDtypeStructs with their shardings, a compile ahead of time) the
    share each device would hold."""
    needed: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                needed[shard.device] = needed.get(shard.device, 0) + shard.data.nbytes
        elif isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            # the dtype's own itemsize: a PRNG key's too (key<fry>: 8), which numpy refuses
            size = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            for device in leaf.sharding.device_set:
                needed[device] = needed.get(device, 0) + size
    return needed


def largest_copy(tree: Any) -> int:
    """The bytes the on-device copy of `tree` puts on its most loaded device (`copy_bytes`): what a background
    save needs beside the train step."""
    return max(copy_bytes(tree).values(), default=0)


def processes_on_host(env: Mapping[str, str], process_count: int) -> int:
    """How many of the run's processes share this host (each copying its state at the same moment).

    The cluster environment says (job.runtime.cluster). Where it does not, every process of the run
    is assumed to be here: a save that needs no copy is slower, a copy that does not fit kills the run.
    """
    if process_count == 1:
        return 1
    return environment(env).processes_on_this_host(env) or process_count


def room(devices: Iterable[jax.Device]) -> Room:
    """What is free now on these devices (and, for those that do not say, on the host)."""
    free = {device: device_memory.free(device) for device in devices}
    host = host_available() if any(value is None for value in free.values()) else None
    return Room(free, host, processes_on_host(os.environ, jax.process_count()))


def beside_program(room: Room, reserved: int) -> Room:
    """`room` less `reserved` bytes on each device that says what is free: what the train step's program takes
    when it loads again (its temporaries, code and new outputs: `compiled.memory_analysis()`), not in use
    between two steps."""
    return dataclasses.replace(room, devices={device: None if free is None else max(0, free - reserved)
                                              for device, free in room.devices.items()})


def fits(needed: Mapping[jax.Device, int], room: Room, headroom: float = HEADROOM) -> Fit:
    """Whether a copy needing `needed` bytes per device fits in `headroom` of `room`; with the numbers of
    the tightest place (a device that says, or the host for the devices that do not)."""
    places = [Fit(True, size, room.devices[device]) for device, size in needed.items()
              if room.devices.get(device) is not None]
    on_host = sum(size for device, size in needed.items() if room.devices.get(device) is None)
    if on_host:
        places.append(Fit(True, on_host * room.processes_on_host, room.host, room.processes_on_host))
    known = [place for place in places if place.free is not None]
    if not known:  # nothing says what is free: the copy is taken, as before this check
        return max(places, key=lambda place: place.needed, default=Fit(True, 0, None))
    tightest = max(known, key=lambda place: place.needed / max(place.free or 0, 1))
    return dataclasses.replace(tightest, fits=tightest.needed <= headroom * (tightest.free or 0))


def size(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def saved_way(step: int, copying: bool, rows: np.ndarray) -> str:
    """The log line of a change of way, from every process's `Fit.row()`: the tightest process's numbers
    (of those without room, when the copy is not made)."""
    known = [i for i in range(len(rows)) if rows[i, 2] >= 0 and (copying or rows[i, 0] != 1)]
    if not known:
        return (f"checkpoint save {step}: copied on the devices and saved from a thread, the loop goes on "
                "(free memory is not reported here)")
    worst = max(known, key=lambda i: rows[i, 1] / max(rows[i, 2], 1))
    fit = Fit(bool(rows[worst, 0]), int(rows[worst, 1]), int(rows[worst, 2]), int(rows[worst, 3]))
    who = f"process {worst}: " if len(rows) > 1 else ""
    if copying:
        return (f"checkpoint save {step}: copied on the devices and saved from a thread, the loop goes on "
                f"({who}the copy needs {size(fit.needed)} {fit.where()}, {size(fit.free or 0)} free)")
    return (f"checkpoint save {step}: written from the live state on the loop's thread ({who}the on-device "
            f"copy needs {size(fit.needed)} {fit.where()}, more than {round(HEADROOM * 100)}% of the "
            f"{size(fit.free or 0)} free); the loop waits for it")
