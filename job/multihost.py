"""Host synchronisation and device meshes: a drop-in for mlip's ``multihost``, name for name.

The public face of `job.parallel.multihost` (where the code and its documentation live): import it
from here, `from job import multihost`; the library itself imports `job.parallel.multihost`.
"""

from job.parallel.multihost import (
    BARRIER_TIMEOUT,
    DATA_PARALLELISM_AXIS_NAME,
    BarrierTimeout,
    assert_pytrees_match,
    assert_pytrees_match_across_hosts,
    barrier,
    coordination_client,
    create_device_mesh,
    create_dp_sharding,
    create_replicated_sharding,
    on_process_zero,
    only_specific_processes,
    single_host_jax_and_orbax,
    sync_string,
    warn_on_process_zero,
)

__all__ = [
    "DATA_PARALLELISM_AXIS_NAME",
    "BARRIER_TIMEOUT",
    "BarrierTimeout",
    "create_device_mesh",
    "create_replicated_sharding",
    "create_dp_sharding",
    "only_specific_processes",
    "on_process_zero",
    "warn_on_process_zero",
    "sync_string",
    "single_host_jax_and_orbax",
    "coordination_client",
    "barrier",
    "assert_pytrees_match",
    "assert_pytrees_match_across_hosts",
]
