"""A job that runs collectives until told otherwise, for launcher failure tests.

    hold.py MODE [RANK [ARG]]

MODE: hold (loop forever), raise (RANK raises), exit (RANK dies at once with
code ARG, as a crash would; a lone sys.exit would wait in jax's shutdown barrier),
term (every rank saves a marker in ARG on SIGTERM and exits 42; it runs no collective
once ready, so that no rank waits in one for a peer that has already exited and misses
its own handler: a Python handler runs only once the main thread is back in Python).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import job

info = job.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from job import multihost  # noqa: E402

mode = sys.argv[1]
target = int(sys.argv[2]) if len(sys.argv) > 2 else -1
rank = info.process_id

if mode == "term":
    def on_term(signum: int, _frame: object) -> None:
        with open(os.path.join(sys.argv[3], f"term{rank}"), "w") as fh:
            fh.write(str(signum))
        os._exit(42)

    signal.signal(signal.SIGTERM, on_term)

mesh = multihost.create_device_mesh()
sharding = multihost.create_dp_sharding(mesh)
total = jax.jit(jnp.sum)
print(f"ready pid={os.getpid()}", flush=True)
while mode == "term":
    time.sleep(0.05)
step = 0
while True:
    x = jax.make_array_from_process_local_data(sharding, np.ones((jax.local_device_count(),), np.float32))
    assert float(total(x)) == jax.device_count()
    step += 1
    if step == 3 and rank == target:
        if mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        if mode == "exit":
            os._exit(int(sys.argv[3]))
    time.sleep(0.05)
