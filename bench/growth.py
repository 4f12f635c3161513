"""7. Cost as the work grows: step and checkpoint time vs model size and vs process count.

    python -m bench.growth [--quick]

What the training loop runs (`job.train.loop.run`), for the lm task: `job.task.load("lm")`,
the model and its `nnx.Optimizer` (`job.train.steps.make_optimizer`, default OptimConfig)
placed by `sharding.shard_model`, `nnx.split({"model": ..., "optimizer": ...})` once,
`job.train.steps.jit_train_step` (state donated) on batches from `job.train.batches.global_batch`,
and `job.runs.checkpoint.Checkpointer` (async orbax) saving that state. Two axes:

- model size: one process, 1 CPU device; 3 sizes of the example LM (the lm task's
  default 104,768 parameters, ~860k, ~6.4M) on the same 8 x 32-token batch. Sizes
  alternate (A B C A B C ...) within the one process; each a ratio to the smallest;
- process count (weak scaling): 1, 2, 4 and 8 processes started by `job.launch`,
  1 CPU device each, the default model, 8 rows per process (global batch 8 x N),
  data-parallel over all of them, one shared checkpoint folder. Each a ratio to
  1 process; process 0's figures (the step's all-reduce and the save's barriers
  keep the ranks in step).

A step figure is the time of a block of steps / its length, blocking on the last
step's output; a checkpoint figure is `save` (the part that blocks the loop) and
`save` + `wait` (the whole write), to the page cache (no fsync).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import emit, launch_template, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, fmt_x, interleave, median, ratio

NAME = "growth"
TITLE = "7. Cost as the work grows: step and checkpoint time vs model size and process count"

TASK = "lm"
ROWS = 8  # rows per process (the global batch is ROWS x processes)
SEQ = 32  # the lm task's default sequence length, for every size
STEPS = 1000  # the schedule's length: only its shape within the first steps matters
# name -> (ModelConfig kwargs, steps per timed block)
SIZES = {
    "example": ({}, 8),  # the lm task's defaults: 104,768 parameters
    "medium": ({"vocab_size": 256, "dim": 128, "heads": 4, "layers": 4, "mlp_dim": 512}, 4),  # ~860k
    "large": ({"vocab_size": 256, "dim": 256, "heads": 4, "layers": 8, "mlp_dim": 1024}, 1),  # ~6.4M
}
COUNTS = (1, 2, 4, 8)
PROCESS_SIZE = "example"


class Trainer:
    """One model's train state, step, batches and checkpointer, as `job.train.loop.run` builds them."""

    def __init__(self, size: str, ckpt_dir: Path) -> None:
        import jax
        from flax import nnx

        from job import sharding
        from job import task as tasks
        from job.runs.checkpoint import Checkpointer
        from job.train.batches import global_batch
        from job.train.config import CheckpointConfig, OptimConfig
        from job.train.state import count_params
        from job.train.steps import jit_train_step, make_optimizer

        task = tasks.load(TASK)
        overrides, self.block = SIZES[size]
        cfg = task.model_config(**{"seq_len": SEQ, "remat": "none", **overrides})  # traced outside the loop: a policy
        self.mesh = sharding.make_mesh()
        self.rows = ROWS * jax.process_count()
        model = task.build(cfg, nnx.Rngs(0))
        tx, _ = make_optimizer(OptimConfig(), STEPS)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        sharding.shard_model(model, self.mesh)
        sharding.shard_model(optimizer, self.mesh)
        self.params = count_params(model)
        graphdef, self.state = nnx.split({"model": model, "optimizer": optimizer})
        del model, optimizer
        self.nbytes = sum(x.nbytes for x in jax.tree.leaves(self.state))
        self.train_step = jit_train_step(task.loss, graphdef, self.state)
        source = task.source(task.data_config(global_batch=self.rows), cfg)
        place = sharding.batch_sharding(self.mesh)
        self.batches = [global_batch(source, place, split="train", step=s, size=self.rows) for s in range(4)]
        self.ckpt = Checkpointer(ckpt_dir, CheckpointConfig(every=1, keep=2, async_save=True))
        self.saves = 0
        self.blocked: list[float] = []  # seconds each timed save held the loop

    def steps(self) -> float:
        """Seconds per step over one block of steps."""
        import jax

        from job import sharding

        with sharding.mesh_context(self.mesh):
            start = time.perf_counter()
            for i in range(self.block):
                self.state, metrics = self.train_step(self.state, self.batches[i % len(self.batches)])
            jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / self.block

    def save(self) -> float:
        """Seconds for save + wait (the whole write); the blocking part goes to `self.blocked`."""
        self.saves += 1
        start = time.perf_counter()
        self.ckpt.save(self.saves, self.state)
        self.blocked.append(time.perf_counter() - start)
        self.ckpt.wait()
        return time.perf_counter() - start

    def close(self) -> None:
        self.ckpt.close()


def _result(t: Trainer, steps: list[float], saves: list[float], warmup: int) -> dict:
    return {"params": t.params, "bytes": t.nbytes, "rows": t.rows, "block": t.block,
            "step": steps, "save": saves, "blocked": t.blocked[warmup:]}


def worker(argv: list[str]) -> None:
    """The model-size axis: every size in this one process, interleaved."""
    reps = 2 if "--quick" in argv else 5
    root = Path(tempfile.mkdtemp(prefix="bench-growth-"))
    try:
        trainers = {size: Trainer(size, root / size) for size in SIZES}
        for size, t in trainers.items():
            print(f"[bench growth] {size}: {t.params:,} parameters, {t.nbytes / 2**20:.1f} MiB train state",
                  file=sys.stderr, flush=True)
        variants = {}
        for size, t in trainers.items():
            variants[f"{size} step"] = t.steps
            variants[f"{size} save"] = t.save
        times = interleave(variants, reps=reps, warmup=1)
        sizes = {size: _result(t, times[f"{size} step"], times[f"{size} save"], 1) for size, t in trainers.items()}
        for t in trainers.values():
            t.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit({"reps": reps, "sizes": sizes})


def child(argv: list[str]) -> None:
    """The process-count axis: one rank of a `job.launch` cluster."""
    reps, ckpt_dir = int(argv[0]), Path(argv[1])
    import job

    job.initialize()
    import jax

    t = Trainer(PROCESS_SIZE, ckpt_dir)
    times = interleave({"step": t.steps, "save": t.save}, reps=reps, warmup=1)
    out = _result(t, times["step"], times["save"], 1)
    t.close()
    emit({"rank": jax.process_index(), "n": jax.process_count(), **out})


def run(quick: bool = False) -> Section:
    reps = 2 if quick else 5
    print("[bench growth] model sizes, 1 process ...", file=sys.stderr, flush=True)
    by_size = run_worker("bench.growth", ["--quick"] if quick else [], devices=1)
    by_count = []
    for n in COUNTS:
        print(f"[bench growth] {n} process(es) x 1 CPU device ...", file=sys.stderr, flush=True)
        root = Path(tempfile.mkdtemp(prefix="bench-growth-"))
        try:
            cluster = launch_template(n, ["bench.growth", "child", str(reps), str(root / "ckpt")])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        by_count.append(cluster.ranks[0] | {"wall_s": cluster.wall_s})
    return section(by_size, by_count)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _row(label: list[str], r: dict, base: dict) -> list[str]:
    def vs_base(key: str) -> str:
        return "1x (baseline)" if r is base else fmt_ratio(r[key], base[key])

    return [*label, _mib(r["bytes"]), fmt_s(median(r["step"])), vs_base("step"),
            fmt_s(median(r["blocked"])), fmt_s(median(r["save"])), vs_base("save")]


def section(by_size: dict, by_count: list[dict]) -> Section:
    cols = ["step", "step ratio", "save (blocks loop)", "save + wait", "save + wait ratio"]
    s = Section(NAME, TITLE, columns=["axis", "work", "params", "train state", *cols],
                data={"sizes": by_size, "counts": by_count})
    sizes = by_size["sizes"]
    small = sizes[next(iter(SIZES))]
    for size, r in sizes.items():
        s.rows.append(_row(["model size", f"{size}, 1 process, {r['rows']} x {SEQ}", f"{r['params']:,}"],
                           r, small))
    one = by_count[0]
    for r in by_count:
        s.rows.append(_row(["processes", f"{r['n']} x 1 device, global {r['rows']} x {SEQ}", f"{r['params']:,}"],
                           r, one))
    big, many = sizes[list(SIZES)[-1]], by_count[-1]
    s.headline += [
        (f"step time, {big['params'] / small['params']:.0f}x the parameters", fmt_x(ratio(big["step"], small["step"])),
         "report"),
        (f"checkpoint time, {big['params'] / small['params']:.0f}x the parameters",
         fmt_x(ratio(big["save"], small["save"])), "report"),
        (f"step time, {many['n']} processes / 1 (weak scaling)", fmt_x(ratio(many["step"], one["step"])), "report"),
        (f"checkpoint time, {many['n']} processes / 1", fmt_x(ratio(many["save"], one["save"])), "report"),
    ]
    s.notes.append(f"Ratios: of medians, to the smallest model / to 1 process (in brackets: the interquartile "
                   f"range of the per-repetition ratios). Model sizes: {by_size['reps']} interleaved repetitions "
                   f"in one process; process counts: {len(one['step'])} "
                   "repetitions in each of 4 separate launches (process 0's figures), so that axis is not "
                   "interleaved and drifting load lands on it unevenly.")
    s.notes.append(f"Step: a block of steps ({', '.join(str(b) for _, b in SIZES.values())} for the three sizes; "
                   f"{SIZES[PROCESS_SIZE][1]} for the process counts) timed to the last output, per step. "
                   "Save: `Checkpointer.save` returns once orbax's async save has copied the state to host "
                   "memory (the part that blocks the loop); save + wait is "
                   "the whole write, including the barriers every "
                   "process meets and orbax's fixed cost per checkpoint (see section 4), which dominates "
                   "for small states.")
    s.notes.append(f"Weak scaling on this machine: every process does the same work on its own {ROWS} rows, so "
                   "on an ideal cluster the step ratio stays at 1x apart from the all-reduce. Here all "
                   "processes share the same CPU cores: once the processes outnumber the cores, the step "
                   "time grows with the process count for that reason alone. Launch wall time (start to "
                   "exit, including init and compilation): "
                   + ", ".join(f"{r['n']}: {r['wall_s']:.0f} s" for r in by_count) + ".")
    return s


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker, child))
