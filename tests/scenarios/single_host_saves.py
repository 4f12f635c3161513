"""Every process saves and restores checkpoints of its own, at once, inside single_host_jax_and_orbax.

    single_host_saves.py ROUNDS

Orbax's async saves signal through a key-value store; the hosts must not share one
here (they would read and delete each other's signals, and a save would never end).
Writes $SCENARIO_OUT/saves<N>.json with the values each rank restored.
"""

from __future__ import annotations

import json
import os
import sys

import job

job.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from job import multihost  # noqa: E402

rank = jax.process_index()
out = os.environ["SCENARIO_OUT"]
restored = []
with multihost.single_host_jax_and_orbax():
    for i in range(int(sys.argv[1])):
        folder = os.path.join(out, f"rank{rank}-save{i}")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(folder, {"x": np.arange(3) + 100 * rank + i})
            checkpointer.wait_until_finished()
            restored.append(np.asarray(checkpointer.restore(folder)["x"]).tolist())
multihost.barrier("saves done", timeout_s=60)
with open(os.path.join(out, f"saves{rank}.json"), "w") as fh:
    json.dump(restored, fh)
print(f"saves done on rank {rank}", flush=True)
