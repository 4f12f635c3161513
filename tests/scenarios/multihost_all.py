"""Every job.multihost function across real processes; each rank records what it saw.

Run under the launcher; writes $SCENARIO_OUT/rank<N>.json for the test to assert on.
"""

from __future__ import annotations

import json
import os
import time

import job

info = job.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from job import multihost  # noqa: E402

rank = jax.process_index()
out: dict[str, object] = {"info": [info.kind, info.process_id, info.num_processes]}


def error_of(fn, *args):  # noqa: ANN001, ANN202
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return None


# --- meshes and shardings
mesh = multihost.create_device_mesh()
out["mesh_cached"] = multihost.create_device_mesh() is mesh
out["mesh_axes"] = list(mesh.axis_names)
out["mesh_size"] = int(mesh.devices.size)
out["process_count"] = jax.process_count()
out["local_device_count"] = jax.local_device_count()
replicated = multihost.create_replicated_sharding(mesh)
out["replicated_spec"] = str(replicated.spec)
out["replicated_full"] = replicated.is_fully_replicated
dp = multihost.create_dp_sharding(mesh)
out["dp_spec"] = str(dp.spec)

# global batch from per-process data: each process holds rows rank*10 + (0, 1, 2, 3)
local_rows = np.stack([np.full((3,), rank * 10 + i, np.float32) for i in range(4)])
batch = jax.make_array_from_process_local_data(dp, local_rows)
out["batch_shape"] = list(batch.shape)
out["batch_local_shards"] = sorted(int(s.data[0, 0]) for s in batch.addressable_shards)
out["batch_sum"] = float(jax.jit(jnp.sum)(batch))
out["batch_gathered"] = np.asarray(multihost_utils.process_allgather(batch, tiled=True))[:, 0].tolist()
params = jax.device_put(jnp.arange(6.0), replicated)
out["params_sum_times_batch"] = float(jax.jit(lambda p, b: (b.sum(axis=1) * p.sum()).sum())(params, batch))

# --- sync_string
long_text = "héllo wörld ✓ 日本語 🚀 " * 5000
out["sync_long_ok"] = multihost.sync_string(long_text if rank == 0 else None) == long_text
out["sync_other_value_ignored"] = multihost.sync_string("zero" if rank == 0 else f"other{rank}")
out["sync_empty"] = multihost.sync_string("" if rank == 0 else None)
out["sync_none_error"] = error_of(multihost.sync_string, None)

# --- only_specific_processes
out["only_default"] = multihost.only_specific_processes()(lambda: f"ran on {rank}")()
out["only_list"] = multihost.only_specific_processes([1, 3])(lambda x: x * 2)(rank)
out["only_int"] = multihost.only_specific_processes(2)(lambda: "two")()

# --- assert_pytrees_match_across_hosts
tree = {"params": {"w": np.ones((2, 3), np.float32), "b": np.zeros(3)}, "step": np.int32(5), "nan": np.array([np.nan])}
out["match_same"] = error_of(multihost.assert_pytrees_match_across_hosts, tree)
out["match_replicated_global"] = error_of(multihost.assert_pytrees_match_across_hosts, {"p": params})
value_diff = {"params": {"w": np.ones((2, 3), np.float32) * (2.0 if rank == 2 else 1.0), "b": np.zeros(3)}}
out["match_value_diff"] = error_of(multihost.assert_pytrees_match_across_hosts, value_diff)
shape_diff = {"params": {"w": np.ones((2, 4 if rank == 1 else 3), np.float32)}, "extra": np.zeros(1)}
if rank == 3:
    shape_diff["only_on_3"] = np.zeros(1)
out["match_structure_diff"] = error_of(multihost.assert_pytrees_match_across_hosts, shape_diff)
out["local_match_error"] = error_of(multihost.assert_pytrees_match, {"a": np.ones(2)}, {"a": np.zeros(2)})

# --- named barriers
multihost.barrier("everyone")
if rank == 1:
    time.sleep(4)  # never reaches the next barrier in time
    out["barrier_timeout"] = None
else:
    try:
        multihost.barrier("lonely", timeout_s=1.5)
        out["barrier_timeout"] = None
    except multihost.BarrierTimeout as exc:
        out["barrier_timeout"] = str(exc)
multihost.barrier("together again")

# --- single_host_jax_and_orbax
import orbax.checkpoint as ocp  # noqa: E402

from job.core import internals  # noqa: E402

with multihost.single_host_jax_and_orbax():
    out["inside"] = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices_are_local": jax.devices() == jax.local_devices(),
        "orbax_skips_sync": internals.lookup(f"{internals.ORBAX_MULTIHOST}:should_skip_process_sync")(),
    }
    # each host writes a purely local checkpoint of its own, as single-host code would
    folder = os.path.join(os.environ["SCENARIO_OUT"], f"ckpt{rank}")
    local_tree = {"x": np.arange(4) + rank}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(folder, local_tree)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(folder)
    out["inside_ckpt_roundtrip"] = np.asarray(restored["x"]).tolist()
out["after"] = {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "devices_are_local": jax.devices() == jax.local_devices(),
}

with open(os.path.join(os.environ["SCENARIO_OUT"], f"rank{rank}.json"), "w") as fh:
    json.dump(out, fh)
multihost_utils.sync_global_devices("scenario done")
print(f"scenario done on rank {rank}", flush=True)
