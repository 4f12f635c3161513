"""3. Host sync latency: `job.multihost` helpers vs the raw `jax.experimental.multihost_utils` calls.

    python -m bench.hostsync [--quick]

One cluster per process count (4 and 16 processes x 1 CPU device, started by
`job.launch`); inside it, each pair below is timed alternately (template,
raw, template, raw, ...), every timed block starting from a coordination
service barrier so that no rank's lateness is charged to the next block:

| operation | template | raw |
|---|---|---|
| sync_string | `multihost.sync_string(s)` (length, then bytes) | `broadcast_one_to_all(bytes)` (length known) |
| pytree check (1 MiB) | `multihost.assert_pytrees_match_across_hosts(tree)` | `multihost_utils.assert_equal(tree)` |
| named barrier | `multihost.barrier(name)` | `multihost_utils.sync_global_devices(name)` |

`multihost.barrier` waits at the distributed runtime's named barrier
(the coordination client's `wait_at_barrier`, with a timeout; `job.core.internals.coordination_client`);
where a `job.multihost` has no `barrier`, the benchmark calls that client
itself. The raw barrier is what user code calls otherwise: a device collective.
Figures are process 0's, per call.
"""

from __future__ import annotations

import itertools
import sys
import time

from bench.procs import emit, launch_template
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, fmt_x, median, ratio

NAME = "hostsync"
TITLE = "3. Host sync latency: job.multihost vs raw multihost_utils"

COUNTS = (4, 16)
OPS = ("sync_string", "pytree check (1 MiB)", "named barrier")
BARRIER_TIMEOUT_MS = 120_000
STRING = "runs/bench-" + "x" * 52 + "-é"  # 64 characters, 65 UTF-8 bytes: a typical run name


def _tree():  # noqa: ANN202
    """1 MiB of float32/int32 leaves in a nested dict (a config/params-like tree)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "params": {"w": rng.standard_normal((128, 1024), np.float32),  # 512 KiB
                   "b": rng.standard_normal((64, 1024), np.float32)},  # 256 KiB
        "step": np.arange(64 * 1024, dtype=np.int32).reshape(64, 1024),  # 256 KiB
    }


def child(argv: list[str]) -> None:
    reps, per_block = int(argv[0]), int(argv[1])
    import job

    job.initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from job import multihost
    from job.core import internals

    client = internals.coordination_client()
    rank = jax.process_index()
    names = (f"bench-{i}" for i in itertools.count())
    tree = _tree()
    encoded = np.frombuffer(STRING.encode("utf-8"), np.uint8)

    def check_string() -> None:
        assert multihost.sync_string(STRING if rank == 0 else None) == STRING

    def raw_string() -> None:
        out = multihost_utils.broadcast_one_to_all(encoded)
        assert np.asarray(out, np.uint8).tobytes().decode("utf-8") == STRING

    def template_barrier(name: str) -> None:
        if hasattr(multihost, "barrier"):
            multihost.barrier(name)
        else:
            client.wait_at_barrier(name, BARRIER_TIMEOUT_MS)

    variants = {
        "sync_string": (check_string, raw_string),
        "pytree check (1 MiB)": (lambda: multihost.assert_pytrees_match_across_hosts(tree),
                                 lambda: multihost_utils.assert_equal(tree)),
        "named barrier": (lambda: template_barrier(next(names)),
                          lambda: multihost_utils.sync_global_devices(next(names))),
    }
    times: dict[str, dict[str, list[float]]] = {}
    for op, pair in variants.items():
        times[op] = {"template": [], "raw": []}
        for i in range(2 + reps):  # two warmup rounds (compilation), then the timed ones
            for kind, fn in zip(("template", "raw"), pair):
                client.wait_at_barrier(f"align-{next(names)}", BARRIER_TIMEOUT_MS)
                start = time.perf_counter()
                for _ in range(per_block):
                    fn()
                if i >= 2:
                    times[op][kind].append((time.perf_counter() - start) / per_block)
    emit({"rank": rank, "n": jax.process_count(), "times": times})


def run(quick: bool = False) -> Section:
    reps, per_block = (2, 2) if quick else (7, 3)
    results = []
    for n in COUNTS:
        print(f"[bench hostsync] {n} processes: {reps} x {per_block} calls per operation",
              file=sys.stderr, flush=True)
        cluster = launch_template(n, ["bench.hostsync", "child", str(reps), str(per_block)])
        results.append({"n": n, "reps": reps, "per_block": per_block, "times": cluster.ranks[0]["times"]})
    return section(results)


def section(results: list[dict]) -> Section:
    s = Section(NAME, TITLE, columns=["operation", "processes", "template", "raw multihost_utils", "ratio"],
                data={"results": results})
    for op in OPS:
        for r in results:
            t = r["times"][op]
            s.rows.append([op, str(r["n"]), fmt_s(median(t["template"])), fmt_s(median(t["raw"])),
                           fmt_ratio(t["template"], t["raw"])])
    biggest = results[-1]
    for op in OPS:
        t = biggest["times"][op]
        s.headline.append((f"{op}, {biggest['n']} processes, template / raw", fmt_x(ratio(t["template"], t["raw"])),
                           "report"))
    r0 = results[0]
    s.notes.append(f"Process 0's time per call, median of {r0['reps']} blocks of {r0['per_block']} calls "
                   "(ratio: of the medians; in brackets the interquartile range of the per-block ratios); "
                   "4 and 16 processes x 1 CPU device, gloo over loopback.")
    s.notes.append("sync_string: the template waits at a named barrier (so a missing peer is an error, not "
                   "a hang), broadcasts the length (any length, any Unicode), then the bytes: three round "
                   "trips where the raw call, whose length every process knows, needs one.")
    s.notes.append("pytree check: the template waits at a named barrier, sends process 0's structure "
                   "(sync_string of a JSON signature), all-gathers a flag, broadcasts the values and all-gathers "
                   "the verdict (so every rank raises, naming the differing ranks); raw `assert_equal` is one "
                   "all-gather of the whole tree (N x 1 MiB to every process) and raises only where the "
                   "values differ.")
    s.notes.append("named barrier: the template's is a coordination-service RPC (no device work, with a "
                   "timeout); `sync_global_devices` all-gathers a hash of the name through a jitted device "
                   "computation, with no timeout.")
    return s


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, child=child))
