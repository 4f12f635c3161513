"""11. Input from ArrayRecord through grain: grain's multi-process workers vs the loop's prefetch thread.

    python -m bench.records [--quick]

One process, 2 CPU devices, the lm task's default model and batch, stepped with
`job.train.steps.jit_train_step`, on the same tokens: a text tokenized by `python -m
job tokenize` into an .arrayrecord file, read as the lm task reads it
(`job.tasks.lm.data.RecordFile`: grain's ArrayRecord data source, a window a
row, each epoch in its own order). Interleaved in the same run:

- pre-built: the train step on batches built beforehand (no input work);
- prefetch thread: this process's rows made 2 steps ahead by
  `job.train.batches.Prefetch` with their transfer, what `job.train.loop.run` does;
- grain workers: the same rows made by grain (`MapDataset.range(steps).map(rows)
  .to_iter_dataset().mp_prefetch(...)`, 2 worker processes), the transfer in
  the loop's thread.

Input stall = (variant - pre-built) / variant per interleaved round, median
over rounds. Throughput (no train step) is rows made per second of wall time
once the first batch is out (the workers started), and per CPU second spent
on them, start-up included (this process's and its workers' CPU time).
"""

from __future__ import annotations

import dataclasses
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_pct, fmt_s, fmt_x, interleave, median

NAME = "records"
TITLE = "11. Input from ArrayRecord through grain: multi-process workers vs the prefetch thread"
TEXT_BYTES = 1 << 22  # the tokenized text: 4 MiB of bytes, 4M tokens
WORKERS = 2


def _cpu() -> float:
    """CPU seconds of this process and of its reaped children (grain's workers once closed)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def worker(argv: list[str]) -> None:
    quick = "--quick" in argv
    reps, block = (3, 4) if quick else (15, 16)
    import grain
    import jax
    import numpy as np
    from flax import nnx

    from job import sharding
    from job import task as tasks
    from job.tasks.lm import data
    from job.train.batches import Prefetch, row_span, to_global
    from job.train.config import OptimConfig
    from job.train.steps import jit_train_step, make_optimizer

    task = tasks.load("lm")
    cfg = dataclasses.replace(task.model_config(remat="none"), vocab_size=data.BYTE_VOCAB)  # an explicit policy
    tmp = Path(tempfile.mkdtemp(prefix="bench-records-"))
    text = tmp / "text.txt"
    text.write_bytes(np.random.default_rng(0).integers(32, 127, TEXT_BYTES, dtype=np.uint8).tobytes())
    data.tokenize_text(text, tmp / "tokens.arrayrecord")
    dcfg = dataclasses.replace(task.data_config(), source=str(tmp / "tokens.arrayrecord"))
    source = task.source(dcfg, cfg)

    mesh = sharding.make_mesh()
    batch_sharding = sharding.batch_sharding(mesh)
    size = dcfg.global_batch
    span = row_span(batch_sharding, size)
    model = task.build(cfg, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_optimizer(OptimConfig(), 1000)[0], wrt=nnx.Param)
    sharding.shard_model(model, mesh)
    sharding.shard_model(optimizer, mesh)
    graphdef, state = nnx.split({"model": model, "optimizer": optimizer})
    train_step = jit_train_step(task.loss, graphdef, state)
    held = {"state": state}

    def host(step: int) -> dict:
        return source.rows("train", step, *span)

    def batch(step: int) -> dict:
        return to_global(host(step), batch_sharding, size)

    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags (defaults here)
        flags.FLAGS.mark_as_parsed()
    endless = range(10**7)
    thread = Prefetch(batch, endless)
    pipeline = (grain.MapDataset.range(10**7).map(host).to_iter_dataset()
                .mp_prefetch(grain.MultiprocessingOptions(num_workers=WORKERS)))
    workers = iter(pipeline)
    made = {"thread": 0, "grain": 0}
    prebuilt = [batch(10**8 + i) for i in range(block)]

    def steps(make) -> float:  # noqa: ANN001
        start = time.perf_counter()
        with sharding.mesh_context(mesh):
            for i in range(block):
                held["state"], metrics = train_step(held["state"], make(i))
            jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / block

    def from_thread(i: int) -> dict:
        made["thread"] += 1
        return thread.get(made["thread"] - 1)

    def from_grain(i: int) -> dict:
        made["grain"] += 1
        return to_global(next(workers), batch_sharding, size)

    print(f"[bench records] 3 variants: {reps} x {block} steps each", file=sys.stderr, flush=True)
    times = interleave({"pre-built": lambda: steps(lambda i: prebuilt[i]),
                        "prefetch thread": lambda: steps(from_thread),
                        f"grain workers ({WORKERS})": lambda: steps(from_grain)}, reps=reps, warmup=2)
    thread.close()
    workers.close()

    # throughput with no train step: rows a second, and rows a CPU second (workers' CPU time counted once reaped)
    count = 4 * block if quick else 24 * block
    rows = span[1] - span[0]
    throughput = {}
    for name in ("prefetch thread", f"grain workers ({WORKERS})"):
        cpu = _cpu()
        if name == "prefetch thread":
            with Prefetch(host, range(count + 1)) as upcoming:
                upcoming.get(0)
                wall = time.perf_counter()
                for s in range(1, count + 1):
                    upcoming.get(s)
                wall = time.perf_counter() - wall
        else:
            it = iter(grain.MapDataset.range(count + 1).map(host).to_iter_dataset()
                      .mp_prefetch(grain.MultiprocessingOptions(num_workers=WORKERS)))
            next(it)  # the workers started: what follows is their steady rate
            wall = time.perf_counter()
            for _ in range(count):
                next(it)
            wall = time.perf_counter() - wall
            it.close()
        cpu = _cpu() - cpu
        throughput[name] = {"rows_per_s": count * rows / wall, "rows_per_cpu_s": (count + 1) * rows / cpu,
                            "wall_s": wall, "cpu_s": cpu}
    shutil.rmtree(tmp, ignore_errors=True)
    emit(dataclasses.asdict(section({"times": times, "throughput": throughput, "reps": reps, "block": block,
                                     "rows": rows, "global_batch": size, "seq_len": cfg.seq_len})))


def section(r: dict) -> Section:
    t, pre = r["times"], r["times"]["pre-built"]
    grain_name = f"grain workers ({WORKERS})"
    stalls = {v: median([(a - b) / a for a, b in zip(t[v], pre)]) for v in ("prefetch thread", grain_name)}
    s = Section(NAME, TITLE, columns=["input", "step", "input stall", "rows / s (no step)", "rows / CPU s"],
                data=r)
    s.rows.append(["pre-built", fmt_s(median(pre)), "-", "-", "-"])
    for name, stall in stalls.items():
        tp = r["throughput"][name]
        s.rows.append([name, fmt_s(median(t[name])), fmt_pct(stall), f"{tp['rows_per_s']:.0f}",
                       f"{tp['rows_per_cpu_s']:.0f}"])
    thread, workers = r["throughput"]["prefetch thread"], r["throughput"][grain_name]
    s.headline += [
        ("input stall: prefetch thread / grain workers", f"{fmt_pct(stalls['prefetch thread'])} / "
         f"{fmt_pct(stalls[grain_name])}", "<= 2%"),
        ("rows / s, grain workers / prefetch thread", fmt_x(workers["rows_per_s"] / thread["rows_per_s"]), ""),
        ("rows / CPU s, grain workers / prefetch thread", fmt_x(workers["rows_per_cpu_s"] / thread["rows_per_cpu_s"]),
         ""),
    ]
    s.notes.append(f"The lm task's default model and global batch ({r['global_batch']} x {r['seq_len']} tokens, "
                   f"{r['rows']} rows a process), one process with 2 CPU devices, byte-level tokens of 4 MiB of "
                   "text in records of 1024 tokens; median over "
                   f"{r['reps']} interleaved rounds of blocks of {r['block']} steps. Both inputs make the very "
                   "same rows (the source's `rows`, a pure function of step and row), so the choice changes "
                   "speed, never the batches.")
    s.notes.append("Rows / CPU s counts this process's CPU time and, for grain, its worker processes' (read "
                   "once they exit), start-up included: each worker is a fresh Python process that imports the "
                   "task and opens the file, and hands every batch over through shared memory.")
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.records", ["--quick"] if quick else [], devices=2))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
