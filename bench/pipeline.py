"""5. Input pipeline: time spent assembling each global batch vs the train step.

    python -m bench.pipeline [--quick]

One process, 2 CPU devices, the lm task's default model and batch. The
batch is assembled as `job.loop.run` does it: `job.batches.global_batch`
(the task's `source.rows` for this process's rows, then
`jax.make_array_from_process_local_data` per field), and stepped with
`job.steps.jit_train_step`. For each source (the synthetic `reverse` task
and a memory-mapped token file), interleaved:

- assembly only: building a block of batches, per batch;
- pre-built: the train step on batches built beforehand (no input work);
- in loop: build the batch, then step, as the loop does.

Input stall = (in loop - pre-built) / in loop: the share of a step the loop
waits for its input. Assembly / step is the cost if nothing overlapped.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_pct, fmt_s, interleave, median

NAME = "pipeline"
TITLE = "5. Input pipeline: global batch assembly vs step time"
TASK = "lm"
TOKENS = 1 << 21  # token file length


def worker(argv: list[str]) -> None:
    quick = "--quick" in argv
    reps, block = (3, 4) if quick else (9, 8)
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from job import sharding, task as tasks
    from job.batches import global_batch
    from job.config import OptimConfig
    from job.steps import jit_train_step, make_optimizer

    task = tasks.load(TASK)
    cfg, dcfg = task.model_config(), task.data_config()
    mesh = sharding.make_mesh()
    batch_sharding = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
    model = task.build(cfg, nnx.Rngs(0))
    tx, _ = make_optimizer(OptimConfig(), 1000)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sharding.shard_model(model, mesh)
    sharding.shard_model(optimizer, mesh)
    graphdef, state = nnx.split({"model": model, "optimizer": optimizer})
    del model, optimizer
    train_step = jit_train_step(task.loss, graphdef, state)
    held = {"state": state}

    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    token_file = tmp / "tokens.npy"
    np.save(token_file, np.random.default_rng(0).integers(0, cfg.vocab_size, TOKENS, dtype=np.uint16))
    sources = {
        "reverse (synthetic)": task.source(dcfg, cfg),
        "token file (.npy, memory-mapped)": task.source(dataclasses.replace(dcfg, source=str(token_file)), cfg),
    }
    results = []
    for name, source in sources.items():
        counter = iter(range(10**9))

        def batch(step: int, source=source) -> dict:  # noqa: ANN001
            return global_batch(source, batch_sharding, split="train", step=step, size=dcfg.global_batch)

        prebuilt = [batch(next(counter)) for _ in range(block)]

        def assembly() -> float:
            start = time.perf_counter()
            batches = [batch(next(counter)) for _ in range(block)]
            jax.block_until_ready(batches)
            return (time.perf_counter() - start) / block

        def steps(make) -> float:  # noqa: ANN001
            start = time.perf_counter()
            with sharding.mesh_context(mesh):
                for i in range(block):
                    held["state"], metrics = train_step(held["state"], make(i))
                jax.block_until_ready(metrics)
            return (time.perf_counter() - start) / block

        print(f"[bench pipeline] {name}: {reps} x {block} steps", file=sys.stderr, flush=True)
        times = interleave({
            "assembly": assembly,
            "pre-built": lambda: steps(lambda i: prebuilt[i]),
            "in loop": lambda: steps(lambda i: batch(next(counter))),
        }, reps=reps, warmup=1)
        results.append({"source": name, "times": times, "reps": reps, "block": block})
    del sources
    shutil.rmtree(tmp, ignore_errors=True)
    emit(dataclasses.asdict(section(results, dcfg.global_batch, cfg.seq_len)))


def section(results: list[dict], global_batch: int, seq_len: int) -> Section:
    s = Section(NAME, TITLE, columns=["source", "assembly per batch", "step (pre-built batches)",
                                      "step (assembled in loop)", "assembly / step", "input stall"],
                data={"results": results})
    for r in results:
        t = r["times"]
        a, pre, loop = median(t["assembly"]), median(t["pre-built"]), median(t["in loop"])
        stall = (loop - pre) / loop
        r["stall"] = stall
        s.rows.append([r["source"], fmt_s(a), fmt_s(pre), fmt_s(loop), fmt_pct(a / pre), fmt_pct(stall)])
        s.headline.append((f"input stall, {r['source']}", fmt_pct(stall), "small"))
    s.notes.append(f"Example model and global batch ({global_batch} x {seq_len} tokens), one process with 2 CPU "
                   f"devices; median of {results[0]['reps']} interleaved blocks of {results[0]['block']} steps. "
                   "A stall below the assembly / step share means assembly overlapped with the previous "
                   "step's (asynchronously dispatched) computation; a negative stall is noise (the loop with "
                   "input work happened to run faster).")
    s.notes.append("Rows are drawn one by one (`np.random.default_rng([seed, split, step, row])` per row), "
                   "so assembly grows linearly with the rows per process.")
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.pipeline", ["--quick"] if quick else [], devices=2))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
