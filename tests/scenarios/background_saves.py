"""Checkpointer saves from the live state, written in the background while the loop runs collectives, on every
process.

    background_saves.py ROUNDS

Each round: save a state sharded over every process, then at once (the write still running
on orbax's threads) update the state in place (donated) and run a cross-process all-reduce, as
the next train step would. Records which device collectives (jax.experimental.multihost_utils)
ran on which thread: the write's threads must run none, or one could pair with the step's.
Writes $SCENARIO_OUT/rank<N>.json: the rounds restored, the threads of device collectives.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import job

job.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from job import sharding  # noqa: E402
from job.runs.checkpoint import Checkpointer, abstract  # noqa: E402
from job.runs.config import CheckpointConfig  # noqa: E402

collectives: list[str] = []  # "function on thread" for every device collective called


def recording(name: str):  # noqa: ANN201
    real = getattr(multihost_utils, name)

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        collectives.append(f"{name} on {threading.current_thread().name}")
        return real(*args, **kwargs)

    return call


for fn in ("sync_global_devices", "broadcast_one_to_all", "process_allgather"):
    setattr(multihost_utils, fn, recording(fn))

rank = jax.process_index()
rounds = int(sys.argv[1])
mesh = sharding.make_mesh()
rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
total = NamedSharding(mesh, PartitionSpec())


def make_state(i: int) -> dict[str, jax.Array]:
    w = jax.make_array_from_callback((16, 4), rows, lambda idx: (np.arange(64.0).reshape(16, 4) + 1000 * i)[idx])
    return {"w": w, "step": jax.device_put(np.int32(i), total)}


# the next step: donates the state, adds one everywhere, and all-reduces across processes
step = jax.jit(lambda s: ({"w": s["w"] + 1, "step": s["step"] + 1}, jnp.sum(s["w"])), donate_argnums=0)

checkpoints = Checkpointer(Path(os.environ["SCENARIO_OUT"]) / "ck", CheckpointConfig(keep=rounds),
                           like=abstract(make_state(0)))
sums = []
for i in range(1, rounds + 1):
    state = make_state(i)
    checkpoints.save(i, state)
    for _ in range(3):  # steps while the save is written
        state, total_sum = step(state)
        sums.append(float(total_sum))
checkpoints.wait()
like = make_state(0)
restored = []
for i in checkpoints.all_steps():
    back = checkpoints.restore(i, like)
    expected = make_state(i)
    restored.append([i, bool(np.array_equal(multihost_utils.process_allgather(back["w"], tiled=True),
                                            multihost_utils.process_allgather(expected["w"], tiled=True))),
                     int(back["step"])])
checkpoints.close()
with open(os.path.join(os.environ["SCENARIO_OUT"], f"rank{rank}.json"), "w") as fh:
    json.dump({"restored": restored, "sums": sums, "collectives": collectives}, fh)
print(f"background saves done on rank {rank}", flush=True)
