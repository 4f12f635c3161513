"""A smoke test of the library on a cluster: initialisation, both meshes, batches and sharding.

    python -m job.launch -n 4 --devices-per-process 2 -- python -m job demo

Every process joins the cluster, builds both meshes, assembles a global batch
from its own rows, runs a data- and tensor-parallel layer, and checks the
global result against the closed form. Process 0 prints the summary.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from job.parallel import multihost, sharding
from job.parallel.rows import row_span
from job.runtime.cluster import ClusterInfo
from job.runtime.distributed import initialize

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    rows_per_device: int = 4  # rows of the global batch each device holds
    width: int = 8  # input features ("embed")
    hidden: int = 16  # output features ("mlp"), split over the model axis
    model_axis: int = 2  # devices per tensor-parallel group (must divide the device count)
    scale: float = 0.01  # every kernel entry; makes the expected result closed-form


def run(cfg: DemoConfig) -> float:
    info = initialize()
    flat_mesh = multihost.create_device_mesh()
    model_axis = cfg.model_axis if jax.device_count() % cfg.model_axis == 0 else 1
    mesh = sharding.make_mesh(model_axis=model_axis)

    # Each process builds only the rows its devices hold (value = global row index); processes of
    # one model group (the model axis across processes) build the same rows.
    rows_sharding = sharding.batch_sharding(mesh)
    size = cfg.rows_per_device * jax.device_count()
    start, stop = row_span(rows_sharding, size)
    local = np.repeat(np.arange(start, stop, dtype=np.float32)[:, None], cfg.width, axis=1)
    batch = jax.make_array_from_process_local_data(rows_sharding, local, (size, cfg.width))

    layer = nnx.Linear(
        cfg.width, cfg.hidden, rngs=nnx.Rngs(0),
        kernel_init=nnx.initializers.constant(cfg.scale),
        kernel_metadata=sharding.axes("embed", "mlp"), bias_metadata=sharding.axes("mlp"),
    )
    with warnings.catch_warnings():  # the demo opts into the tensor rule on purpose
        warnings.filterwarnings("ignore", message="sharding rule .* is experimental")
        sharding.shard_model(layer, mesh, rule="replicated" if model_axis == 1 else "tensor")
    multihost.assert_pytrees_match_across_hosts(nnx.state(layer))

    @nnx.jit
    def forward_sum(model: nnx.Linear, x: jax.Array) -> jax.Array:
        return model(x).sum()

    total = float(forward_sum(layer, batch))
    rows = batch.shape[0]
    expected = cfg.scale * cfg.width * cfg.hidden * rows * (rows - 1) / 2
    if not np.isclose(total, expected, rtol=1e-5):
        raise AssertionError(f"process {info.process_id}: global result {total} != expected {expected}")
    dp_sum = float(jax.jit(jnp.sum)(jax.device_put(batch, multihost.create_dp_sharding(flat_mesh))))
    run_id = multihost.sync_string(f"demo-{info.num_processes}x{jax.local_device_count()}"
                                   if info.is_coordinator else None)
    _report(info, mesh, run_id, total, dp_sum)
    return total


@multihost.only_specific_processes()
def _report(info: ClusterInfo, mesh: jax.sharding.Mesh, run_id: str, total: float, dp_sum: float) -> None:
    print(f"[{run_id}] {info.summary()}")
    print(f"  devices: {jax.device_count()} global, {jax.local_device_count()} per process, "
          f"platform {jax.devices()[0].platform}")
    print(f"  mesh: {dict(mesh.shape)}; flat mesh: {dict(multihost.create_device_mesh().shape)}")
    print(f"  tensor-parallel layer over the global batch: {total:.4f} (checked on every process)")
    print(f"  data-parallel sum of the global batch: {dp_sum:.1f}")
    print("demo OK")
