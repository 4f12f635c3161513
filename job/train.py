"""The example training job: a small transformer LM, trained data-parallel.

    python -m job.launch -n 4 --devices-per-process 2 -- python -m job train --steps 200

Fork point: replace `job.model` (the model and its loss) and `job.data` (the
per-host input) with yours; this loop, the checkpoints and the preemption
protocol stay as they are.
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
from job import config, model
from job.config import TrainConfig, to_dict, to_json
from job.errors import ConfigError
from job.preemption import REQUEUE_EXIT_CODE, PreemptionGuard
from job.watchdog import Watchdog

log = logging.getLogger("job.train")


def train_step_fn(m: model.Transformer, opt: nnx.Optimizer, tokens: jax.Array, mask: jax.Array) -> dict:
    """One optimizer step over the global batch; returns the batch's metrics. `train_step` is its jit."""
    (_, metrics), grads = nnx.value_and_grad(model.loss_fn, has_aux=True)(m, tokens, mask)
    opt.update(m, grads)
    return metrics


train_step = nnx.jit(train_step_fn)


@nnx.jit
def eval_step(m: model.Transformer, tokens: jax.Array, mask: jax.Array) -> dict:
    return model.loss_fn(m, tokens, mask)[1]


def validate(cfg: TrainConfig) -> None:
    """Checks that need no devices: run before anything starts."""
    config.validate(cfg)


def run(cfg: TrainConfig) -> int:
    """Train to cfg.steps (resuming if possible). Returns 0, or REQUEUE_EXIT_CODE when preempted."""
    validate(cfg)
    info = job.initialize()
    log.info("process %d of %d (%s) on %s", info.process_id, info.num_processes, info.kind,
             os.environ.get("SLURMD_NODENAME") or socket.gethostname())

    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from job import data, preflight, sharding
    from job.checkpoint import Checkpointer
    from job.fingerprint import fingerprint
    from job.multihost import only_specific_processes
    from job.report import Reporter

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
    source = data.make_source(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    only_specific_processes()(_save_config)(run_dir, cfg)

    lm = model.Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.optim.lr, cfg.optim.warmup_steps, max(cfg.steps, cfg.optim.warmup_steps + 1),
        end_value=cfg.optim.lr * cfg.optim.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.optim.clip_norm),
        optax.adamw(schedule, b1=cfg.optim.b1, b2=cfg.optim.b2, weight_decay=cfg.optim.weight_decay),
    )
    optimizer = nnx.Optimizer(lm, tx, wrt=nnx.Param)
    sharding.shard_model(lm, mesh, rule=cfg.rule)
    sharding.shard_model(optimizer, mesh, rule=cfg.rule)

    checkpoints = Checkpointer(run_dir / "checkpoints", cfg.ckpt)
    start = 0
    if cfg.resume and checkpoints.all_steps():
        start, restored = checkpoints.restore_newest({"model": nnx.state(lm), "optimizer": nnx.state(optimizer)})
        nnx.update(lm, restored["model"])
        nnx.update(optimizer, restored["optimizer"])

    batch_sharding = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))

    def global_batch(split: str, step: int) -> dict[str, jax.Array]:
        # rows from the sharding: processes of one model group (tensor parallelism across
        # processes, e.g. one process per GPU) hold the same rows
        return data.global_batch_array(source, batch_sharding, split=split, step=step,
                                       global_batch=cfg.data.global_batch)

    def evaluate() -> dict[str, float]:
        totals = {"loss": 0.0, "accuracy": 0.0, "tokens": 0.0}
        for i in range(cfg.data.eval_batches):
            batch = global_batch("eval", i)
            metrics = jax.device_get(eval_step(lm, batch["tokens"], batch["mask"]))
            weight = float(metrics["tokens"])
            totals["loss"] += float(metrics["loss"]) * weight
            totals["accuracy"] += float(metrics["accuracy"]) * weight
            totals["tokens"] += weight
        weight = max(totals["tokens"], 1.0)
        return {"loss": totals["loss"] / weight, "accuracy": totals["accuracy"] / weight}

    tokens_per_step = cfg.data.global_batch * cfg.model.seq_len
    report = Reporter(run_dir, start_step=start, total_steps=cfg.steps, tokens_per_step=tokens_per_step)
    if start:
        report.message("resumed from step %d (%s)", start, run_dir / "checkpoints")
    report.message("%s", checked.line())
    report.message("%s; %d parameters; mesh %s; rule %s", info.summary(), model.count_params(lm),
                   dict(mesh.shape), cfg.rule)
    state = lambda: {"model": nnx.state(lm), "optimizer": nnx.state(optimizer)}  # noqa: E731
    began, last_saved, metrics, eval_metrics = time.perf_counter(), start, {}, {}
    code = 0
    with contextlib.ExitStack() as stack, sharding.mesh_context(mesh), PreemptionGuard() as guard:
        dog = None
        for step in range(start, cfg.steps):
            batch = global_batch("train", step)
            metrics = train_step(lm, optimizer, batch["tokens"], batch["mask"])
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                report.train(done, values, float(schedule(step)))
            if cfg.data.eval_batches and (done % cfg.eval_every == 0 or done == cfg.steps):
                eval_metrics = evaluate()
                report.eval(done, eval_metrics)
            if done % cfg.ckpt.every == 0 or done == cfg.steps:
                checkpoints.save(done, state())
                last_saved = done
            if guard.should_stop():
                if last_saved != done:
                    checkpoints.save(done, state())
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
    report.close({
        "final_step": last_saved,
        "completed": code == 0,
        "train_loss": float(final["loss"]) if final else None,
        "eval_loss": eval_metrics.get("loss"),
        "eval_accuracy": eval_metrics.get("accuracy"),
        "seconds": round(time.perf_counter() - began, 3),
        "params_norm": float(optax.global_norm(nnx.state(lm, nnx.Param))),
        "params_sha256": fingerprint(nnx.state(lm, nnx.Param)),
    })
    return code


def _save_config(run_dir: Path, cfg: TrainConfig) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(to_json(cfg) + "\n")
