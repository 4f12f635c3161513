"""What a save needs of the host, and nothing of the devices: its copy of the state in host memory.

A save copies this process's shards from the live arrays to host memory and writes from there
(job.runs.checkpoint): no copy is made on a device, so no device memory is held for it. The host
holds, until the write has them, the shards each process writes (one replica of each array: orbax's
`use_replica_parallel=False`), and every process of the run on the host copies at the same moment.
On CPU devices the arrays are host memory already: the copy is a view, but the step after the save
cannot reuse (donate) the state's buffers while the write reads them, so the same bytes are counted.

That need is weighed once per run, from the state's plan, against what the host has available
(MemAvailable within this process's cgroup: job.runtime.host). Where it fits in HOST_SHARE of it, a
save copies everything at once and the loop waits only for that copy; where it does not, orbax
copies in batches that fit (`save_device_host_concurrent_gb`, each array marked for orbax's batched copies:
job.runs.checkpoint's `_Transfers`), each batch written before the next is copied, and the loop waits
until the last batch is copied. Where nothing says what is available, the copy goes at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax

from job.runtime.cluster import environment
from job.runtime.host import host_available

# The host's copies must fit in 90% of what it has available: the rest is slack for the write's own
# buffers and whatever else runs on the host beside the save.
HOST_SHARE = 0.9
GB = 10**9  # orbax's unit for its device-to-host batches


@dataclasses.dataclass(frozen=True)
class HostFit:
    """What a save holds in this host's memory, against what the host has available."""

    needed: int  # bytes: this process's share, times the processes of the run on this host
    available: int | None  # bytes the host has available; None: unknown (the copy goes at once)
    processes_on_host: int  # processes of the run on this host, each copying its share at the same moment

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= HOST_SHARE * self.available

    def batch_gb(self) -> float:
        """Orbax's bound on one process's device-to-host copies in flight, in GB: the processes on this host together
        within HOST_SHARE of what it has available (an array larger than the bound is copied alone)."""
        return HOST_SHARE * (self.available or 0) / max(self.processes_on_host, 1) / GB

    def line(self) -> str:
        """The run's log line for a host copy that does not fit at once."""
        count = self.processes_on_host
        return (f"checkpoint: a save's copy of the state needs {size(self.needed)} of host memory for the "
                f"{count} process{'es' if count > 1 else ''} on this host, more than {round(HOST_SHARE * 100)}% of "
                f"the {size(self.available or 0)} available; the state goes to the host in batches of "
                f"{self.batch_gb():.2f} GB a process, each written before the next is copied, the loop waiting "
                "for the last copy")


def host_bytes(tree: Any) -> int:
    """The bytes this process copies to host memory to save `tree`: the shards of replica 0 on its devices, for
    arrays and for a state planned but not made (ShapeDtypeStructs with their shardings) alike."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(shard.data.nbytes for shard in leaf.addressable_shards if shard.replica_id == 0)
        elif isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            # the dtype's own itemsize: a PRNG key's too (key<fry>: 8), which numpy refuses
            size_of = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            total += size_of * len(_replica_zero_here(leaf.sharding, leaf.shape))
    return total


def _replica_zero_here(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[jax.Device]:
    """The devices of this process that hold replica 0 of their index (the first device holding it, in the
    sharding's device order, as jax numbers replicas)."""
    first: dict[str, jax.Device] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        first.setdefault(repr(index), device)
    return [device for device in first.values() if device.process_index == jax.process_index()]


def processes_on_host(env: Mapping[str, str], process_count: int) -> int:
    """How many of the run's processes share this host (each copying its state at the same moment).

    The cluster environment says (job.runtime.cluster). Where it does not, every process of the run
    is assumed to be here: a save in batches is slower, a host out of memory kills the run.
    """
    if process_count == 1:
        return 1
    return environment(env).processes_on_this_host(env) or process_count


def weigh(needed: int, available: int | None, processes: int) -> HostFit:
    """A save whose one process copies `needed` bytes, on a host with `available` bytes and `processes` of the run."""
    return HostFit(needed * processes, available, processes)


def host_fit(like: Any) -> HostFit:
    """How a save of `like` (the state or its plan) weighs on this host now."""
    return weigh(host_bytes(like), host_available(), processes_on_host(os.environ, jax.process_count()))


def size(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
