"""16. The preemption check's cost per step: a collective every step against the coordination service's sync point.

    python -m bench.preemption [--quick]

Four processes x 1 CPU device (`job.launch`) run a data-parallel step (a 512 x 512 layer whose gradient is
all-reduced across the processes, a few milliseconds a step), in blocks of steps, each block after a
coordination service barrier, the three ways below interleaved:

| way | after each step |
|---|---|
| none | nothing: the steps are dispatched ahead, as jax does, and the block waits once at its end |
| collective | `process_allgather` of each process's flag, what the loop did every step before: the host waits for the step to finish, then for a device collective |
| sync point | `multihost_utils.reached_preemption_sync_point(step)`, the coordination service's preemption sync point (job.runtime.preemption's check in a multi-process run): local until a notice comes |

Figures are process 0's time per step, the median of the blocks, and each way's overhead against none.
"""

from __future__ import annotations

import itertools
import sys
import time

from bench.procs import emit, launch_template
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, fmt_x, median, ratio

NAME = "preemption"
TITLE = "16. The preemption check per step: a collective against the coordination service's sync point"

PROCESSES = 4
WAYS = ("none", "collective", "sync point")
WIDTH, ROWS = 512, 256  # the layer and each process's rows: a few ms a step on one CPU core
BARRIER_TIMEOUT_MS = 120_000


def child(argv: list[str]) -> None:
    reps, per_block = int(argv[0]), int(argv[1])
    import job

    job.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from job.core import internals

    client = internals.coordination_client()
    rank, count = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((count,), ("data",), devices=jax.devices())
    whole = NamedSharding(mesh, PartitionSpec())
    local = np.random.default_rng(rank).standard_normal((ROWS, WIDTH), np.float32)
    x = multihost_utils.host_local_array_to_global_array(local, mesh, PartitionSpec("data"))
    w = jax.device_put(jnp.eye(WIDTH, dtype=jnp.float32) * 0.5, whole)

    @jax.jit
    def step(w, x):  # noqa: ANN001, ANN202 - one SGD step; its gradient is all-reduced across the processes
        grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return jax.lax.with_sharding_constraint(w - 0.01 * grad, whole)

    steps = itertools.count(1)  # the sync point's step ids: the same on every process, rising by one a call

    def collective() -> None:
        flag = np.int32(0)
        every = np.asarray(multihost_utils.process_allgather(flag))
        assert not every.any()

    def sync_point() -> None:
        assert not multihost_utils.reached_preemption_sync_point(next(steps))

    checks = {"none": None, "collective": collective, "sync point": sync_point}
    names = (f"bench-preemption-{i}" for i in itertools.count())
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(2 + reps):  # two warmup rounds (compilation), then the timed ones
        for way in WAYS:
            check = checks[way]
            client.wait_at_barrier(next(names), BARRIER_TIMEOUT_MS)
            start = time.perf_counter()
            for _ in range(per_block):
                w = step(w, x)
                if check is not None:
                    check()
            jax.block_until_ready(w)
            if i >= 2:
                times[way].append((time.perf_counter() - start) / per_block)
    emit({"rank": rank, "n": count, "times": times})


def run(quick: bool = False) -> Section:
    reps, per_block = (3, 20) if quick else (9, 50)
    print(f"[bench preemption] {PROCESSES} processes: {reps} blocks of {per_block} steps per way",
          file=sys.stderr, flush=True)
    cluster = launch_template(PROCESSES, ["bench.preemption", "child", str(reps), str(per_block)], timeout_s=600)
    return section({"n": PROCESSES, "reps": reps, "per_block": per_block, "times": cluster.ranks[0]["times"]})


def section(result: dict) -> Section:
    t = result["times"]
    s = Section(NAME, TITLE, columns=["check after each step", "time per step", "against none"],
                data={"result": result})
    for way in WAYS:
        s.rows.append([way, fmt_s(median(t[way])), fmt_ratio(t[way], t["none"]) if way != "none" else "1.00x"])
    s.headline.append((f"collective / sync point, {result['n']} processes", fmt_x(ratio(t["collective"],
                                                                                          t["sync point"])), "report"))
    s.notes.append(f"Process 0's time per step, median of {result['reps']} blocks of {result['per_block']} steps "
                   f"(in brackets the interquartile range of the per-block ratios); {result['n']} processes x 1 CPU "
                   "device, gloo over loopback. The sync point's cost is a lock and a comparison until a notice "
                   "comes; the collective's is the wait for the step to end (no step is dispatched ahead) and a "
                   "device all-gather, on every host, every step.")
    return s


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, child=child))
