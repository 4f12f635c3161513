"""1. Step overhead: the loop's train step vs a hand-written `jax.jit` step.

    python -m bench.step [--quick]

One process, 2 CPU devices, mesh ("data": 2, "model": 1), the lm task. Both
sides start from the same model (same init), use the same optimizer
(`job.train.steps.make_optimizer` with the default OptimConfig) and take the same
steps on the same batches, interleaved:

- template: what `job.train.loop.run` runs: the state planned and created as its
  shards (`job.train.state.plan`: model and optimizer, replicated here),
  `job.train.steps.jit_train_step` (a `jax.jit` over the split state, donated, with
  its shardings as out_shardings), batches from `job.train.batches.global_batch`,
  called as `state, metrics = step(state, batch)` under `mesh_context`;
- baseline: `nnx.split(model)` once, then a hand-written `jax.jit` of a pure
  function over (params, optax state, batch) with params and optax state
  donated, both replicated by `jax.device_put`, the batch split over "data".

A repetition times a block of steps and blocks on the last step's output;
the host time of a call is how long it takes to return (dispatch).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

from bench.procs import emit, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, fmt_x, interleave, median, ratio

NAME = "step"
TITLE = "1. Step overhead: template train step vs hand-written jax.jit"
TASK = "lm"
STEPS = 1000  # the schedule's length: only its shape within the first steps matters

# name -> (ModelConfig kwargs, global batch, steps per block)
SIZES = {
    "example": ({}, 32, 6),  # the lm task's defaults: 104,768 parameters, 32 x 32 tokens
    "medium": ({"vocab_size": 256, "seq_len": 64, "dim": 128, "heads": 4, "layers": 4, "mlp_dim": 512},
               32, 2),  # 861,312 parameters, 32 x 64 tokens
}


def handwritten_step(graphdef, loss, tx):  # noqa: ANN001, ANN201 - nnx graphdef, task loss, optax transform
    """The baseline: a plain `jax.jit` step over (params, optax state, batch); params and optax state donated."""
    import jax
    import optax
    from flax import nnx

    def objective(p, batch):  # noqa: ANN001, ANN202
        return loss(nnx.merge(graphdef, p), batch)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, batch):  # noqa: ANN001, ANN202
        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, metrics

    return step


def measure(size: str, reps: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from job import sharding
    from job import task as tasks
    from job.train import config
    from job.train import state as state_plan
    from job.train.batches import global_batch
    from job.train.config import OptimConfig
    from job.train.steps import jit_train_step, make_optimizer

    task = tasks.load(TASK)
    overrides, size_rows, block = SIZES[size]
    cfg = task.model_config(**{"remat": "none", **overrides})  # traced outside the loop: an explicit policy
    source = task.source(task.data_config(global_batch=size_rows), cfg)
    mesh = sharding.make_mesh()
    batch_sharding = sharding.batch_sharding(mesh)
    tx, _ = make_optimizer(OptimConfig(), STEPS)
    host: dict[str, list[float]] = {"template": [], "baseline": []}

    # ---- template: job.train.loop.run's state (planned, created as its shards), step and batches
    run_cfg = dataclasses.replace(config.defaults(task), model=cfg)
    planned = state_plan.plan(task, run_cfg, mesh, tx)
    params = planned.params
    graphdef, state = planned.graphdef, planned.init()
    train_step = jit_train_step(task.loss, graphdef, planned.shardings, weight=task.weight)
    batches_t = [global_batch(source, batch_sharding, split="train", step=s, size=size_rows) for s in range(4)]
    template = {"state": state}

    def run_template() -> float:
        state = template["state"]
        with sharding.mesh_context(mesh):
            start = time.perf_counter()
            for i in range(block):
                t0 = time.perf_counter()
                state, metrics = train_step(state, batches_t[i % len(batches_t)])
                host["template"].append(time.perf_counter() - t0)
            jax.block_until_ready(metrics)
        template["state"] = state
        return (time.perf_counter() - start) / block

    # ---- baseline: nnx.split once, a hand-written jax.jit over pure pytrees
    graphdef_b, params_b = nnx.split(task.build(cfg, nnx.Rngs(0)))
    replicated = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec("data"))
    baseline = {"params": jax.device_put(params_b, replicated)}
    baseline["opt"] = jax.device_put(tx.init(baseline["params"]), replicated)
    batches_b = [{k: jax.device_put(np.asarray(v), split) for k, v in source.rows("train", s, 0, size_rows).items()}
                 for s in range(4)]
    step = handwritten_step(graphdef_b, task.loss, tx)

    def run_baseline() -> float:
        p, s = baseline["params"], baseline["opt"]
        start = time.perf_counter()
        for i in range(block):
            t0 = time.perf_counter()
            p, s, metrics = step(p, s, batches_b[i % len(batches_b)])
            host["baseline"].append(time.perf_counter() - t0)
        jax.block_until_ready(metrics)
        baseline["params"], baseline["opt"] = p, s
        return (time.perf_counter() - start) / block

    compile_start = time.perf_counter()
    times = interleave({"template": run_template, "baseline": run_baseline}, reps=reps, warmup=1)
    host = {k: v[block:] for k, v in host.items()}  # drop the warmup block (compilation)
    # both sides took the same steps on the same batches: the parameters should agree
    final_t = nnx.state(nnx.merge(graphdef, template["state"])["model"], nnx.Param)
    final_b = nnx.state(nnx.merge(graphdef_b, baseline["params"]), nnx.Param)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(final_t), jax.tree.leaves(final_b), strict=True))
    return {
        "size": size, "params": params, "global_batch": size_rows, "seq_len": cfg.seq_len, "block": block,
        "reps": reps, "times": times, "host": host, "max_param_diff": diff,
        "total_s": time.perf_counter() - compile_start,
    }


def worker(argv: list[str]) -> None:
    quick = "--quick" in argv
    reps = 3 if quick else 13
    results = []
    for size in SIZES:
        print(f"[bench step] {size}: {reps} interleaved repetitions ...", file=sys.stderr, flush=True)
        results.append(measure(size, reps))
    emit(dataclasses.asdict(section(results)))


def section(results: list[dict]) -> Section:
    s = Section(NAME, TITLE, columns=[
        "model", "params", "batch x seq", "template step", "hand-written jax.jit", "ratio",
        "host time per call: template / jax.jit",
    ])
    for r in results:
        t, h = r["times"], r["host"]
        s.rows.append([
            r["size"], f"{r['params']:,}", f"{r['global_batch']} x {r['seq_len']}",
            fmt_s(median(t["template"])), fmt_s(median(t["baseline"])),
            fmt_ratio(t["template"], t["baseline"]),
            f"{fmt_s(median(h['template']))} / {fmt_s(median(h['baseline']))}",
        ])
        s.headline.append((f"step time ratio, {r['size']} model ({r['params']:,} params)",
                           fmt_x(ratio(t["template"], t["baseline"])), "<= 1.03"))
        s.notes.append(f"{r['size']}: ratios of medians (in brackets: the interquartile range of the "
                       f"per-repetition ratios), median of {r['reps']} repetitions of {r['block']} steps each; "
                       f"largest parameter difference template vs baseline after the run: "
                       f"{r['max_param_diff']:.2g}")
        s.data[r["size"]] = {k: v for k, v in r.items() if k not in ("times", "host")} | {
            "median_s": {k: median(v) for k, v in t.items()},
            "host_median_s": {k: median(v) for k, v in h.items()},
        }
    ex = results[0]
    extra_host = median(ex["host"]["template"]) - median(ex["host"]["baseline"])
    s.notes.append(
        "One process, 2 CPU devices, replicated parameters, batch split over 'data'. Both sides ran the same "
        "steps on the same batches with the same optax transform. The template step is "
        "`job.train.steps.jit_train_step`: a `jax.jit` over the split model + optimizer state (donated, its "
        "shardings given as out_shardings); `nnx.merge` runs only while tracing, so a call flattens one "
        "`nnx.State` pytree where the hand-written step flattens its params (also an `nnx.State`) and optax "
        "state. 'Host time per call' is how long the Python call takes to return (dispatch, and any wait "
        f"for the runtime before it returns): for the {ex['size']} model the template's call returns "
        f"{fmt_s(abs(extra_host))} {'later' if extra_host >= 0 else 'sooner'} than the hand-written one's.")
    return s


def run(quick: bool = False) -> Section:
    return Section.from_dict(run_worker("bench.step", ["--quick"] if quick else [], devices=2))


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run, worker))
