"""5. Input pipeline: time spent assembling each global batch vs the train step.

    python -m bench.pipeline [--quick]

One process, 2 CPU devices, the lm task's default model and batch, stepped
with `job.train.steps.jit_train_step`. For each source (the synthetic `reverse`
task and a memory-mapped token file), interleaved in the same run:

- pre-built: the train step on batches built beforehand (no input work);
- per-row (before): rows drawn one by one, `np.random.default_rng([seed,
  split, step, row])` per row (the sources' code before vectorising, kept
  here as the baseline), built then stepped in the loop's thread;
- vectorised: the sources' `rows` (one `job.random.row_bits` hash for the
  block), built then stepped in the loop's thread;
- prefetch rows: host rows made by `job.train.batches.Prefetch` on a thread 2
  steps ahead, the transfer (`job.train.batches.to_global`, i.e.
  `jax.make_array_from_process_local_data`) in the loop's thread;
- prefetch rows + transfer: both on the thread, as `job.train.loop.run` does it.

Input stall = (variant - pre-built) / variant, per interleaved round, median
over rounds: the share of a step the loop waits for its input. Assembly / step is the cost if nothing overlapped.
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
from bench.timing import fmt_pct, fmt_s, fmt_x, interleave, median

NAME = "pipeline"
TITLE = "5. Input pipeline: global batch assembly vs step time"
TASK = "lm"
TOKENS = 1 << 21  # token file length


class _PerRow:
    """A source's rows drawn one `np.random.default_rng([seed, split, step, row])` at a time (the code before)."""

    def __init__(self, source) -> None:  # noqa: ANN001
        self.source = source

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        import numpy as np

        from job.task import SPLITS
        from job.tasks.lm.data import BOS, PAD, SEP, ReverseTask

        s, split_id = self.source, SPLITS.index(split)
        tokens = np.empty((stop - start, s.seq_len), np.int32)
        for i in range(stop - start):
            rng = np.random.default_rng([s.seed, split_id, step, start + i])
            if isinstance(s, ReverseTask):
                k = s.k
                x = rng.integers(3, s.vocab_size, size=k)
                row = np.full(s.seq_len, PAD, np.int32)
                row[0], row[1 + k] = BOS, SEP
                row[1:1 + k], row[2 + k:2 + 2 * k] = x, x[::-1]
            else:
                lo, hi = s.splits[split]
                offset = lo + int(rng.integers(0, hi - lo - s.seq_len + 1))
                row = np.asarray(s.tokens[offset:offset + s.seq_len])
            tokens[i] = row
        return {"tokens": tokens, "mask": np.repeat(s._mask[None, :], stop - start, axis=0)}


def worker(argv: list[str]) -> None:
    quick = "--quick" in argv
    reps, block = (3, 4) if quick else (31, 16)  # the stall is a few % of a 17 ms step: many rounds
    import jax
    import numpy as np
    from flax import nnx

    from job import sharding
    from job import task as tasks
    from job.train.batches import Prefetch, row_span, to_global
    from job.train.config import OptimConfig
    from job.train.steps import jit_train_step, make_optimizer

    task = tasks.load(TASK)
    cfg, dcfg = task.model_config(remat="none"), task.data_config()  # traced outside the loop: a policy
    mesh = sharding.make_mesh()
    batch_sharding = sharding.batch_sharding(mesh)
    size = dcfg.global_batch
    span = row_span(batch_sharding, size)
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
    def timed_variants(source) -> dict:  # noqa: ANN001
        """The timed variants of one source (a function, so that each source's closures keep their own state)."""
        counter = iter(range(10**9))
        per_row = _PerRow(source)

        def per_row_host(step: int) -> dict:
            return per_row.rows("train", step, *span)

        def host(step: int) -> dict:
            return source.rows("train", step, *span)

        def batch(step: int, rows=host) -> dict:  # noqa: ANN001
            return to_global(rows(step), batch_sharding, size)

        prebuilt = [batch(next(counter)) for _ in range(block)]

        def assembly(rows) -> float:  # noqa: ANN001
            start = time.perf_counter()
            batches = [batch(next(counter), rows) for _ in range(block)]
            jax.block_until_ready(batches)
            return (time.perf_counter() - start) / block

        def steps(make) -> float:  # noqa: ANN001
            start = time.perf_counter()
            with sharding.mesh_context(mesh):
                for i in range(block):
                    held["state"], metrics = train_step(held["state"], make(i))
                jax.block_until_ready(metrics)
            return (time.perf_counter() - start) / block

        def prefetched(transfer_in_thread: bool) -> float:
            first = next(counter)
            for _ in range(block - 1):
                next(counter)
            if transfer_in_thread:
                with Prefetch(batch, range(first, first + block)) as upcoming:
                    return steps(lambda i: upcoming.get(first + i))
            with Prefetch(host, range(first, first + block)) as upcoming:
                return steps(lambda i: to_global(upcoming.get(first + i), batch_sharding, size))

        return {
            "assembly per-row": lambda: assembly(per_row_host),
            "assembly vectorised": lambda: assembly(host),
            "pre-built": lambda: steps(lambda i: prebuilt[i]),
            "per-row (before)": lambda: steps(lambda i: batch(next(counter), per_row_host)),
            "vectorised": lambda: steps(lambda i: batch(next(counter))),
            "prefetch rows": lambda: prefetched(False),
            "prefetch rows + transfer": lambda: prefetched(True),
        }

    variants = {f"{name}|{variant}": fn for name, source in sources.items()
                for variant, fn in timed_variants(source).items()}
    # one interleave over both sources: a round times every variant of every source, so drift hits all alike
    print(f"[bench pipeline] {len(variants)} variants: {reps} x {block} steps each", file=sys.stderr, flush=True)
    times = interleave(variants, reps=reps, warmup=2)
    results = [{"source": name, "times": {key.split("|", 1)[1]: value for key, value in times.items()
                                          if key.split("|", 1)[0] == name}, "reps": reps, "block": block}
               for name in sources]
    del sources
    shutil.rmtree(tmp, ignore_errors=True)
    emit(dataclasses.asdict(section(results, dcfg.global_batch, cfg.seq_len)))


VARIANTS = ("per-row (before)", "vectorised", "prefetch rows", "prefetch rows + transfer")
LOOP = VARIANTS[-1]  # what job.train.loop.run does


def section(results: list[dict], global_batch: int, seq_len: int) -> Section:
    s = Section(NAME, TITLE, columns=["source", "assembly per-row / vectorised", "step (pre-built batches)",
                                      *(f"stall: {v}" for v in VARIANTS), "stall after / before"],
                data={"results": results})
    for r in results:
        t = r["times"]
        pre = median(t["pre-built"])
        # per interleaved round (variant and pre-built timed back to back), then the median: drift cancels
        stalls = {v: median([(a - b) / a for a, b in zip(t[v], t["pre-built"])]) for v in VARIANTS}
        r["stalls"] = stalls
        r["stall"] = after = stalls[LOOP]
        before = stalls["per-row (before)"]
        assembly = f"{fmt_s(median(t['assembly per-row']))} / {fmt_s(median(t['assembly vectorised']))}"
        s.rows.append([r["source"], assembly, fmt_s(pre), *(fmt_pct(stalls[v]) for v in VARIANTS),
                       fmt_x(after / before) if before > 0 else "n/a"])
        s.headline.append((f"input stall, {r['source']} (before -> after)",
                           f"{fmt_pct(before)} -> {fmt_pct(after)}", "<= 2%"))
    s.notes.append(f"Example model and global batch ({global_batch} x {seq_len} tokens), one process with 2 CPU "
                   f"devices; median over {results[0]['reps']} interleaved rounds (both sources in each round) of "
                   f"blocks of {results[0]['block']} steps. "
                   "A stall below the assembly / step share means assembly overlapped with the previous "
                   "step's (asynchronously dispatched) computation; a negative stall is noise (the loop with "
                   "input work happened to run faster).")
    s.notes.append("Before: one `np.random.default_rng` per row (tens of µs each). After: one splitmix64 hash "
                   "of (seed, split, step, row, position) over the process's whole block of rows "
                   "(`job.random.row_bits`), made 2 steps ahead with their transfer (one call for all fields) on "
                   f"`job.train.batches.Prefetch`'s thread (`{LOOP}`, what `job.train.loop.run` does). On CPU devices the "
                   "step computes on the same (here 2, shared) cores, so input work overlapped on a thread still "
                   "takes some of the step's time: the thread runs at nice 10 to fill the step's gaps instead. "
                   "Run-to-run noise is a few percent of a step.")
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.pipeline", ["--quick"] if quick else [], devices=2))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
