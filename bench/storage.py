"""Checkpoints in Cloud Storage: `job.runs.checkpoint.Checkpointer` on gs:// (an emulator) vs a local disk.

    python -m bench.storage [--quick]

One process, 2 CPU devices, the train state of bench.ckpt.save (the lm-task transformer and
its AdamW state, replicated). The same Checkpointer saves and restores it on a local
temporary folder and on gs://BUCKET/bench in fake-gcs-server (tests/gcs_emulator.py: in
memory, on loopback), interleaved: the time `save` blocks the loop, the whole write
(save + wait: arrays through tensorstore, metadata and the commit marker through gcsfs,
the keep-N deletion through google-cloud-storage), and a restore. The emulator has no
network latency and no bandwidth limit: its figures are each client's own cost per
request, a floor for a real bucket, not a forecast.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.ckpt.save import BATCH, loop_state
from bench.procs import cpu_env, emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_mb, fmt_ratio, fmt_s, fmt_x, interleave, median, ratio

NAME = "storage"
TITLE = "Checkpoints in Cloud Storage (emulator) vs a local disk"
BUCKET = "bench"


def worker(argv: list[str]) -> None:
    quick = "--quick" in argv
    reps = 2 if quick else 5
    import jax
    import numpy as np

    from job.runs.checkpoint import Checkpointer
    from job.train.config import CheckpointConfig

    _, _, _, params, _, state = loop_state(quick)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    print(f"[bench storage] train state: {params:,} parameters, {nbytes / 2**20:.0f} MiB in {len(leaves)} arrays; "
          f"{reps} repetitions", file=sys.stderr, flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    options = CheckpointConfig(every=1, keep=2, async_save=True)
    places = {"local": Checkpointer(root / "checkpoints", options),
              "gs://": Checkpointer(f"gs://{BUCKET}/bench/checkpoints", options)}
    counter = iter(range(1, 1_000_000))
    saved: dict[str, list[int]] = {name: [] for name in places}

    def blocking(name: str):  # noqa: ANN202
        def timed() -> float:
            step = next(counter)
            start = time.perf_counter()
            places[name].save(step, state)
            blocked = time.perf_counter() - start
            places[name].wait()
            saved[name].append(step)
            return blocked
        return timed

    def whole(name: str):  # noqa: ANN202
        def timed() -> float:
            step = next(counter)
            start = time.perf_counter()
            places[name].save(step, state)
            places[name].wait()
            saved[name].append(step)
            return time.perf_counter() - start
        return timed

    def restore(name: str):  # noqa: ANN202
        def timed() -> float:
            start = time.perf_counter()
            jax.block_until_ready(places[name].restore(saved[name][-1], state))
            return time.perf_counter() - start
        return timed

    blocks = interleave({name: blocking(name) for name in places}, reps=reps, warmup=1)
    writes = interleave({name: whole(name) for name in places}, reps=reps, warmup=1)
    restores = interleave({name: restore(name) for name in places}, reps=reps, warmup=1)
    back = places["gs://"].restore(saved["gs://"][-1], state)
    exact = all(np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(back), leaves, strict=True))
    for checkpointer in places.values():
        checkpointer.close()
    shutil.rmtree(root, ignore_errors=True)
    result = {"params": params, "bytes": nbytes, "arrays": len(leaves), "reps": reps, "batch": BATCH,
              "blocking": blocks, "writes": writes, "restores": restores, "restore_exact": exact}
    emit(dataclasses.asdict(section(result)))


def section(r: dict) -> Section:
    b, w, rs = r["blocking"], r["writes"], r["restores"]
    mib = r["bytes"] / 2**20
    s = Section(NAME, TITLE, columns=["figure", "gs:// (emulator)", "local disk", "ratio"], data=r)
    s.rows = [
        ["save: time the loop is blocked", fmt_s(median(b["gs://"])), fmt_s(median(b["local"])),
         fmt_ratio(b["gs://"], b["local"])],
        ["save, whole write (save + wait)", fmt_s(median(w["gs://"])), fmt_s(median(w["local"])),
         fmt_ratio(w["gs://"], w["local"])],
        ["save throughput", f"{mib / median(w['gs://']):.0f} MiB/s", f"{mib / median(w['local']):.0f} MiB/s",
         fmt_x(median(w["local"]) / median(w["gs://"]))],
        ["restore", fmt_s(median(rs["gs://"])), fmt_s(median(rs["local"])), fmt_ratio(rs["gs://"], rs["local"])],
    ]
    s.headline += [
        ("save time, gs:// (emulator) / local", fmt_x(ratio(w["gs://"], w["local"])), "report"),
        ("restore time, gs:// (emulator) / local", fmt_x(ratio(rs["gs://"], rs["local"])), "report"),
    ]
    s.notes.append(f"Train state of a {r['params']:,}-parameter model with its AdamW state: {fmt_mb(r['bytes'])} in "
                   f"{r['arrays']} arrays; median of {r['reps']} interleaved repetitions; ratio = gs:// / local "
                   f"(for throughput: local time / gs:// time). Restored from gs:// equal to the saved values: "
                   f"{r['restore_exact']}.")
    return s


def run(quick: bool = False) -> Section:
    from tests.gcs_emulator import emulator

    with emulator(BUCKET) as gcs:
        return Section.from_dict(run_worker("bench.storage", ["--quick"] if quick else [], devices=2,
                                            env=cpu_env(2, **gcs.env)))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
