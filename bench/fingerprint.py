"""The run summary's parameter fingerprint vs the digest it replaced (gather every leaf, sha256).

    python -m bench.fingerprint [--quick]

Processes x 1 CPU device hold a parameter-like tree sharded along its first
axis (FSDP: no process holds a whole leaf). The template's
`job.parallel.fingerprint.fingerprint` reduces each leaf where it lives to four 32-bit
sums; the baseline is the digest the summary used before: `process_allgather`
of every leaf to every process, then sha256 of the bytes. Both are timed on
process 0, interleaved, after one warm-up call each (compilation).
"""

from __future__ import annotations

import hashlib
import sys
import time
from typing import Any

from bench.procs import emit, launch_template
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, fmt_x, median, ratio

NAME = "fingerprint"
TITLE = "9. Parameter fingerprint: reduced where it lives vs gathered to every process"

COUNTS = (2, 4)
LEAVES = 24  # about 100 MiB of float32 in 24 leaves of 1024 x 1024 (the size of bench.ckpt's state)
ROWS, COLS = 1024, 1024


def _gathered_digest(tree: Any) -> str:
    """The digest the summary used before: every leaf gathered to every process, then hashed."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = leaf if leaf.is_fully_addressable else multihost_utils.process_allgather(leaf, tiled=True)
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(value)).tobytes())
    return digest.hexdigest()


def child(argv: list[str]) -> None:
    reps = int(argv[0])
    import job

    job.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from job import multihost
    from job.parallel.fingerprint import fingerprint

    mesh = Mesh(jax.devices(), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    make = jax.jit(lambda i: jax.random.normal(jax.random.key(i), (ROWS, COLS), jnp.float32),
                   static_argnums=0, out_shardings=sharding)
    tree = {f"layer_{i:02d}": {"kernel": make(i)} for i in range(LEAVES)}
    jax.block_until_ready(tree)
    variants = {"template": lambda: fingerprint(tree), "gathered": lambda: _gathered_digest(tree)}
    times: dict[str, list[float]] = {kind: [] for kind in variants}
    for i in range(1 + reps):  # one warm-up round (compilation), then the timed ones
        for kind, fn in variants.items():
            multihost.barrier(f"bench-fingerprint-{i}-{kind}")
            start = time.perf_counter()
            fn()
            if i:
                times[kind].append(time.perf_counter() - start)
    emit({"rank": jax.process_index(), "n": jax.process_count(), "times": times,
          "leaves": LEAVES, "bytes": LEAVES * ROWS * COLS * 4})


def run(quick: bool = False) -> Section:
    reps = 2 if quick else 5
    results = []
    for n in COUNTS:
        print(f"[bench fingerprint] {n} processes x 1 CPU device: {reps} repetitions", file=sys.stderr, flush=True)
        cluster = launch_template(n, ["bench.fingerprint", "child", str(reps)])
        results.append({"n": n, "reps": reps, **cluster.ranks[0]})
    return section(results)


def section(results: list[dict]) -> Section:
    s = Section(NAME, TITLE, columns=["processes", "fingerprint (template)", "gathered sha256 (before)", "ratio",
                                      "received per process: template / before"], data={"results": results})
    for r in results:
        t = r["times"]
        received_before = r["bytes"] * (r["n"] - 1) / r["n"]  # every other process's shards of every leaf
        # the template all-reduces 4 x uint32 per leaf: at most (n - 1) x 16 bytes per leaf arrive anywhere
        received_now = r["leaves"] * 16 * (r["n"] - 1)
        s.rows.append([str(r["n"]), fmt_s(median(t["template"])), fmt_s(median(t["gathered"])),
                       fmt_ratio(t["template"], t["gathered"]),
                       f"{received_now:,} B / {received_before / 2**20:.0f} MiB"])
    last = results[-1]
    s.headline.append((f"fingerprint time, {last['n']} processes, template / gathered digest",
                       fmt_x(ratio(last["times"]["template"], last["times"]["gathered"])), "report"))
    s.notes.append(f"A tree of {last['leaves']} float32 leaves of {ROWS} x {COLS} ({last['bytes'] / 2**20:.0f} MiB), "
                   "each sharded along its first axis over every process; process 0's time per call, median of "
                   f"{last['reps']} interleaved repetitions (ratio of medians; in brackets the interquartile range "
                   "of the per-repetition ratios).")
    s.notes.append("Before, every process received every other process's shards of every leaf (the whole "
                   "model in host memory on each host: an out-of-memory crash for a multi-billion-parameter "
                   "FSDP run); the template moves four 32-bit sums per leaf between devices. Received bytes are "
                   "computed from the shapes, not measured.")
    return s


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, child=child))
