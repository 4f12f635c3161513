"""The training loop, for any task: resume, train, evaluate, checkpoint, stop cleanly on preemption.

    python -m job.launch -n 4 --devices-per-process 2 -- python -m job train --steps 200
    python -m job train --task classify --run-dir runs/classify

The task (job/tasks/NAME/, see job/task.py) gives the model, its loss and the
rows of each batch; this loop, the checkpoints and the preemption protocol
are the same for every task.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path

import jax
from flax import nnx

import job
from job import config
from job.config import TrainConfig, to_dict, to_json
from job.errors import ConfigError
from job.preemption import REQUEUE_EXIT_CODE, PreemptionGuard
from job.task import Task
from job.watchdog import Watchdog

log = logging.getLogger("job.train")


def count_params(model: nnx.Module) -> int:
    """Number of scalar entries over all `nnx.Param`s."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def run(cfg: TrainConfig, task: Task) -> int:
    """Train `task` to cfg.steps (resuming if possible). Returns 0, or REQUEUE_EXIT_CODE when preempted."""
    config.validate(cfg, task)
    info = job.initialize()
    log.info("process %d of %d (%s) on %s", info.process_id, info.num_processes, info.kind,
             os.environ.get("SLURMD_NODENAME") or socket.gethostname())

    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from job import preflight, sharding
    from job.batches import Prefetch, global_batch
    from job.checkpoint import Checkpointer
    from job.fingerprint import fingerprint
    from job.multihost import only_specific_processes
    from job.report import Reporter
    from job.steps import jit_eval_step, jit_train_step, make_optimizer

    run_dir = Path(cfg.run_dir)
    checked = preflight.check(to_dict(cfg), run_dir / "checkpoints")
    mesh = sharding.make_mesh(model_axis=cfg.model_axis)
    divisor = sharding.batch_size_divisor(mesh)
    if cfg.data.global_batch % divisor:
        raise ConfigError(
            "--data.global-batch", expected=f"a multiple of the data-parallel size {divisor}",
            found=cfg.data.global_batch,
            fix=f"use --data.global-batch {divisor * max(1, -(-cfg.data.global_batch // divisor))}",
        )
    source = task.source(cfg.data, cfg.model)
    only_specific_processes()(_save_config)(run_dir, cfg)

    model = task.build(cfg.model, nnx.Rngs(cfg.seed))
    tx, schedule = make_optimizer(cfg.optim, cfg.steps)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sharding.shard_model(model, mesh, rule=cfg.rule)
    sharding.shard_model(optimizer, mesh, rule=cfg.rule)
    params = count_params(model)
    graphdef, state = nnx.split({"model": model, "optimizer": optimizer})
    del model, optimizer  # from here on `state` is the one copy; the steps donate it

    checkpoints = Checkpointer(run_dir / "checkpoints", cfg.ckpt)
    start = 0
    if cfg.resume and checkpoints.all_steps():
        start, state = checkpoints.restore_newest(state)
    train_step, eval_step = jit_train_step(task.loss, graphdef, state), jit_eval_step(task.loss, graphdef)

    batch_sharding = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))

    def batch(split: str, step: int) -> dict[str, jax.Array]:
        return global_batch(source, batch_sharding, split=split, step=step, size=cfg.data.global_batch)

    def evaluate() -> dict[str, float]:
        """Every metric averaged over the eval batches (weighted by the task's weight metric)."""
        sums: dict[str, float] = {}
        total = 0.0
        for i in range(cfg.data.eval_batches):
            metrics = {k: float(v) for k, v in jax.device_get(eval_step(state, batch("eval", i))).items()}
            weight = metrics.pop(task.weight) if task.weight else 1.0
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value * weight
            total += weight
        return {name: value / total if total else 0.0 for name, value in sums.items()}

    report = Reporter(run_dir, start_step=start, total_steps=cfg.steps, shown=task.shown, unit=task.unit,
                      items_per_step=cfg.data.global_batch * task.items_per_row(cfg.model))
    if start:
        report.message("resumed from step %d (%s)", start, run_dir / "checkpoints")
    report.message("%s", checked.line())
    report.message("%s; task %s; %d parameters; mesh %s; rule %s", info.summary(), task.name, params,
                   dict(mesh.shape), cfg.rule)
    began, last_saved, metrics, eval_metrics = time.perf_counter(), start, {}, {}
    code = 0
    with contextlib.ExitStack() as stack, sharding.mesh_context(mesh), PreemptionGuard() as guard:
        # the next 2 batches (rows and transfer) are made on a thread while this step runs; it stops with the loop
        upcoming = stack.enter_context(Prefetch(lambda s: batch("train", s), range(start, cfg.steps)))
        dog = None
        for step in range(start, cfg.steps):
            state, metrics = train_step(state, upcoming.get(step))
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                report.train(done, values, float(schedule(step)))
            if cfg.data.eval_batches and (done % cfg.eval_every == 0 or done == cfg.steps):
                eval_metrics = evaluate()
                report.eval(done, eval_metrics)
            if done % cfg.ckpt.every == 0 or done == cfg.steps:
                checkpoints.save(done, state)
                last_saved = done
            if guard.should_stop():
                if last_saved != done:
                    checkpoints.save(done, state)
                    last_saved = done
                report.message("preempted: saved step %d; exiting with %d (requeue)", done, REQUEUE_EXIT_CODE)
                code = REQUEUE_EXIT_CODE
                break
            if dog is not None:
                dog.kick()
            elif cfg.watchdog_s > 0:  # armed after the first step: compilation may take long
                dog = stack.enter_context(Watchdog(cfg.watchdog_s))
    checkpoints.wait()
    checkpoints.close()
    final = jax.device_get(metrics)
    trained = nnx.state(nnx.merge(graphdef, state)["model"], nnx.Param)
    report.close({
        "final_step": last_saved,
        "completed": code == 0,
        "task": task.name,
        "train_loss": float(final["loss"]) if final else None,
        **{f"eval_{name}": eval_metrics.get(name) for name in task.shown},
        "seconds": round(time.perf_counter() - began, 3),
        "params_norm": float(optax.global_norm(trained)),
        "params_sha256": fingerprint(trained),
    })
    return code


def _save_config(run_dir: Path, cfg: TrainConfig) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(to_json(cfg) + "\n")
