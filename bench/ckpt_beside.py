"""Train steps beside a save of fresh device arrays (never read to the host), by device-to-host mechanism.

    python -m bench.ckpt_beside OUT_DIR [--small]       # on a TPU VM; --small: a CPU-sized dry run

One process, a 1.9 GB state shaped like gpt2-small's train state, a ~60 ms matmul step. Two saves each of: the
template's Checkpointer (a device copy, orbax's save on a thread at nice 19), the same at nice 0, and a device copy
saved by orbax on the loop's thread with its device-to-host copy blocking, or asynchronous in batches of 1 GB and
0.25 GB (`save_device_host_concurrent_gb`); every step taken until the write ends, timed. Then a restore's time
(and a cProfile of one, OUT_DIR/restore-profile.txt) against device_put of the same host arrays. Figures go to
OUT_DIR/probe2.json and the console (bench/RESULTS-tpu.md section 6).
"""

import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import threading
import time
from pathlib import Path

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-ckpt-out")
OUT.mkdir(parents=True, exist_ok=True)
ROOT = OUT / "folders"
shutil.rmtree(ROOT, ignore_errors=True)
ROOT.mkdir(parents=True)
SMALL = bool("--small" in sys.argv)
results: dict = {}


def say(*a):
    print(*a, flush=True)


def save_results():
    (OUT / "probe2.json").write_text(json.dumps(results, indent=1, default=str))


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import job.runs.checkpoint as jc  # noqa: E402
from bench.ckpt_chip import Stepper, handler, manager, train_state  # noqa: E402
from job.runs.checkpoint import Checkpointer, abstract, snapshot  # noqa: E402
from job.runs.config import CheckpointConfig  # noqa: E402

state = train_state(SMALL)
bump = jax.jit(lambda t: jax.tree.map(lambda x: x * 1.0001, t))


def fresh():
    """New device buffers, never read to the host (jax keeps a host copy of an array once read)."""
    global state
    state = bump(state)
    jax.block_until_ready(state)
    return state


fresh()
nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
say("state MiB", nbytes / 2**20)
stepper = Stepper(SMALL)
one = stepper.one

results["plain"] = [one() for _ in range(10)]
say("plain", [round(x, 4) for x in results["plain"]])


def beside(name, start, busy, finish, saves=2):
    out = []
    for _ in range(saves):
        item = fresh()
        t0 = time.perf_counter()
        start(item)
        blocked = time.perf_counter() - t0
        steps = []
        while busy() and len(steps) < 300 and time.perf_counter() - t0 < 20:
            steps.append(one())
        finish()
        out.append({"blocked": blocked, "steps": steps, "whole": time.perf_counter() - t0})
    results.setdefault("beside", {})[name] = out
    for o in out:
        s = o["steps"]
        say(name, "blocked", round(o["blocked"], 3), "n", len(s), "first", [round(x, 3) for x in s[:5]],
            "mean", round(sum(s) / len(s), 4) if s else None, "max", round(max(s), 3) if s else None,
            "whole", round(o["whole"], 2))
    save_results()


counter = iter(range(1, 100000))

# A. the template as it is: device copy, a thread at nice 19, tensorstore's threads at nice 19
c = Checkpointer(ROOT / "a", CheckpointConfig(every=1, keep=1), training=True)
beside("A template (copy, thread, nice 19)", lambda it: c.save(next(counter), it), c._busy, c.wait)
c.close()
# B. the same at nice 0
jc.WRITER_NICE = 0
c = Checkpointer(ROOT / "b", CheckpointConfig(every=1, keep=1), training=True)
beside("B template at nice 0", lambda it: c.save(next(counter), it), c._busy, c.wait)
c.close()
# C-E. a device copy, orbax's own async save on the loop's thread
for name, kw in [("C copy + orbax on the loop (d2h blocking)", {}),
                 ("D copy + orbax on the loop, d2h async 1 GB", {"save_device_host_concurrent_gb": 1.0}),
                 ("E copy + orbax on the loop, d2h async 0.25 GB", {"save_device_host_concurrent_gb": 0.25})]:
    m = manager(ROOT / name[0], **kw)
    beside(name, lambda it, m=m: m.save(next(counter), args=ocp.args.PyTreeSave(snapshot(it)), force=True),
           m.is_saving_in_progress, m.wait_until_finished)
    m.close()

# restore: where the time goes
m = manager(ROOT / "r")
m.save(1, args=ocp.args.PyTreeSave(fresh()), force=True)
m.wait_until_finished()
like = abstract(state)


def restore(mgr):
    t = time.perf_counter()
    got = mgr.restore(1, args=ocp.args.PyTreeRestore(item=like, restore_args=ocp.checkpoint_utils.construct_restore_args(like)))
    jax.block_until_ready(got)
    return time.perf_counter() - t


rs = {"default": [restore(m) for _ in range(2)]}
prof = cProfile.Profile()
prof.enable()
restore(m)
prof.disable()
buf = io.StringIO()
pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
(OUT / "restore-profile.txt").write_text(buf.getvalue())
m.close()
for name, kw in [("restore_concurrent_gb 8", {"restore_concurrent_gb": 8}),
                 ("no replica-parallel handler, ocdbt cache", {})]:
    try:
        mm = ocp.CheckpointManager(ROOT / "r", item_handlers=handler(**kw))
        rs[name] = [restore(mm) for _ in range(2)]
        mm.close()
    except Exception as exc:  # noqa: BLE001
        rs[name] = str(exc)[:300]
flat = jax.tree.leaves(like)
host = [np.asarray(x) for x in jax.tree.leaves(state)]


def np_put():
    t = time.perf_counter()
    jax.block_until_ready([jax.device_put(h, x.sharding) for h, x in zip(host, flat)])
    return time.perf_counter() - t


rs["device_put of host arrays alone"] = [np_put() for _ in range(2)]
results["restore"] = rs
say(rs)
save_results()
say("done")
