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
from collections.abc import Callable
from typing import Any

import jax
from etils import epath
from flax import nnx

import job
from job import config, provenance, resume, storage
from job.config import TrainConfig, to_dict, to_json
from job.errors import ConfigError
from job.goodput import Goodput, describe
from job.preemption import REQUEUE_EXIT_CODE, PreemptionGuard
from job.task import Task
from job.watchdog import Watchdog

log = logging.getLogger("job.train")


def count_params(model: nnx.Module) -> int:
    """Number of scalar entries over all `nnx.Param`s."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def run(cfg: TrainConfig, task: Task, argv: list[str] | None = None) -> int:
    """Train `task` to cfg.steps (resuming if possible). Returns 0, or REQUEUE_EXIT_CODE when preempted.

    `argv` is the command line that made `cfg` (`python -m job ARGV`), recorded for `python -m job rerun`."""
    config.validate(cfg, task)
    timer = Goodput()
    # from here on a SIGTERM (USR1, USR2) is heard in every phase: start-up, the first compilation,
    # evaluation and saves end with the last finished step saved and REQUEUE_EXIT_CODE
    # (after job.initialize: jax's own preemption notifier takes SIGTERM there, and this guard takes it back)
    info = job.initialize()
    with PreemptionGuard() as guard:
        return _run(cfg, task, argv, timer, info, guard)


def _run(cfg: TrainConfig, task: Task, argv: list[str] | None, timer: Goodput, info: job.ClusterInfo,
         guard: PreemptionGuard) -> int:
    from job import compile_cache

    cache_dir = compile_cache.enable(cfg.compile_cache)  # before the first compilation
    log.info("process %d of %d (%s) on %s", info.process_id, info.num_processes, info.kind,
             os.environ.get("SLURMD_NODENAME") or socket.gethostname())

    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from job import preflight, sharding
    from job import state as state_plan
    from job.batches import Prefetch, global_batch
    from job.checkpoint import Checkpointer
    from job.fingerprint import fingerprint
    from job.multihost import only_specific_processes
    from job.profile import StepProfiler
    from job.report import Reporter
    from job.steps import jit_eval_step, jit_train_step
    from job.stragglers import StragglerWatch

    run_dir = storage.run_path(cfg.run_dir)  # a local folder or gs://BUCKET/FOLDER (etils.epath)
    checked = preflight.check(to_dict(cfg), run_dir / "checkpoints")
    mesh = sharding.make_mesh(model_axis=cfg.model_axis)
    divisor = sharding.batch_size_divisor(mesh) * cfg.accum_steps  # every micro-batch over every data shard
    if cfg.data.global_batch % divisor:
        per = f" x --accum-steps {cfg.accum_steps}" if cfg.accum_steps > 1 else ""
        raise ConfigError(
            "--data.global-batch", expected=f"a multiple of the data-parallel size "
            f"{sharding.batch_size_divisor(mesh)}{per} = {divisor}", found=cfg.data.global_batch,
            fix=f"use --data.global-batch {divisor * max(1, -(-cfg.data.global_batch // divisor))}",
        )
    source = task.source(cfg.data, cfg.model)

    tx, schedule = _optimizer(task, cfg)
    # shapes and placement first, no array made; the state is then created as its shards, or restored into them
    planned = state_plan.plan(task, cfg, mesh, tx)
    params = planned.params

    moved = None if cfg.resume else resume.move_aside_for_fresh_start(run_dir / "checkpoints")
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg.ckpt)
    start, changed = 0, []
    newest = checkpoints.newest_specs() if cfg.resume else None
    if newest is not None:  # a state this run does not build stops it here, with nothing touched (exit 2)
        changed = resume.check(run_dir, to_dict(cfg), *newest, planned.abstract)
    only_specific_processes()(_save_config)(run_dir, cfg)
    only_specific_processes()(provenance.record)(run_dir, argv, _topology(info, mesh))
    if cfg.resume and checkpoints.all_steps():  # read back first: an unreadable newest step is set aside
        start, state = checkpoints.restore_newest(planned.abstract)
    else:
        if cfg.resume:  # never from step 0 over checkpoints that were set aside as unreadable
            resume.refuse_fresh_start_over_set_aside(checkpoints.directory)
        state = planned.init()
    if start >= cfg.steps:
        only_specific_processes()(log.info)("already complete at step %d; use a new --run-dir or raise --steps",
                                            start)
        checkpoints.close()
        return 0
    batch_sharding = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
    train_step = jit_train_step(task.loss, planned.graphdef, planned.shardings, accum_steps=cfg.accum_steps,
                                weight=task.weight, custom=task.train_step,
                                micro_sharding=NamedSharding(mesh, PartitionSpec(None, sharding.batch_axes(mesh))))
    eval_step = jit_eval_step(task.loss, planned.eval_graphdef, task.weight)

    def batch(split: str, step: int) -> dict[str, jax.Array]:
        return global_batch(source, batch_sharding, split=split, step=step, size=cfg.data.global_batch)

    def evaluate() -> dict[str, float] | None:
        return evaluate_batches(eval_step, state, lambda i: batch("eval", i), cfg.data.eval_batches, task.weight,
                                guard.should_stop)

    report = Reporter(run_dir, start_step=start, total_steps=cfg.steps, shown=task.shown, unit=task.unit,
                      items_per_step=cfg.data.global_batch * task.items_per_row(cfg.model),
                      wandb=cfg.wandb, config=to_dict(cfg))
    only_specific_processes()(timer.resume)(run_dir, start)
    profiler = StepProfiler(cfg.profile.steps, cfg.steps, run_dir, info.process_id)
    if start:
        report.message("resumed from step %d (%s)", start, run_dir / "checkpoints")
    if start and changed:
        report.message("changed since the saved run (the state is the same): %s", ", ".join(
            f"{resume.flag(name)} {old!r} -> {new!r}" for name, old, new in changed))
    if moved is not None:
        report.message("--no-resume: starting afresh; the earlier checkpoints are kept in %s", moved)
    report.message("%s", checked.line())
    report.message("%s; task %s; %d parameters; mesh %s; rule %s", info.summary(), task.name, params,
                   dict(mesh.shape), cfg.rule)
    began, last_saved, metrics, eval_metrics = time.perf_counter(), start, {}, {}
    watch = StragglerWatch(cfg.straggler_ratio)
    code = 0
    timer.started()
    if guard.should_stop():  # a signal during start-up (build, restore): no step since the last save
        report.message("preempted before the first step: nothing new to save; exiting with %d (requeue)",
                       REQUEUE_EXIT_CODE)
        report.flush()
        timer.flush()
        checkpoints.close()
        return REQUEUE_EXIT_CODE
    with contextlib.ExitStack() as stack, sharding.mesh_context(mesh):
        cache_events = stack.enter_context(compile_cache.CacheEvents())
        stack.callback(profiler.stop)
        # however the loop ends (an error, too), the records so far are written; a full disk there is
        # a warning, not an error over the one that ended the loop (a failed save's CheckpointError)
        stack.callback(_written, report.flush, "metrics")
        stack.callback(_written, timer.flush, "goodput record")
        # the next 2 batches (rows and transfer) are made on a thread while this step runs; it stops with the loop
        upcoming = stack.enter_context(Prefetch(lambda s: batch("train", s), range(start, cfg.steps)))
        dog = None
        for step in range(start, cfg.steps):
            done = step + 1
            logs = done % cfg.log_every == 0 or done == cfg.steps
            evaluates = cfg.data.eval_batches and (done % cfg.eval_every == 0 or done == cfg.steps)
            saves = done % cfg.ckpt.every == 0 or done == cfg.steps
            step_began = time.perf_counter()
            with timer.part("input_wait"):
                next_batch = upcoming.get(step)
            with profiler.step(done) as outputs, timer.step():  # starting and ending a trace is not a step
                state, metrics = train_step(state, next_batch)
                host_s = time.perf_counter() - step_began  # this host's own part: its batch and the dispatch
                outputs.append(metrics)
                if step == start or logs or evaluates or saves:  # what follows waits for it: time it here
                    jax.block_until_ready(metrics)
            if logs:
                with timer.part("logging"):
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    report.train(done, values, float(schedule(step)))
                    report.hosts(done, watch.share())  # one all-gather of one number, on log steps only
                    only_specific_processes()(timer.progress)(run_dir, done)
            interrupted = False  # by a preemption signal during the evaluation: save this step and stop
            if evaluates:
                with timer.part("eval"):
                    evaluated = evaluate()
                if evaluated is None:
                    interrupted = True
                else:
                    eval_metrics = evaluated
                    report.eval(done, eval_metrics)
            if saves and not interrupted:
                with timer.part("checkpoint"):
                    checkpoints.save(done, state)
                last_saved = done
            with timer.part("steps"):  # a collective every step: part of what a step costs
                stop = interrupted or guard.should_stop()
            if step != start and not (evaluates or saves):  # a step's time: no compilation, evaluation or save
                watch.add(host_s, time.perf_counter() - step_began)
            if stop:
                if last_saved != done:
                    with timer.part("checkpoint"):
                        checkpoints.save(done, state)
                    last_saved = done
                report.message("preempted: saved step %d; exiting with %d (requeue)", done, REQUEUE_EXIT_CODE)
                code = REQUEUE_EXIT_CODE
                break
            if dog is not None:
                dog.kick()
            elif cfg.watchdog_s > 0:  # armed after the first step: compilation may take long
                dog = stack.enter_context(Watchdog(cfg.watchdog_s))
    with timer.part("checkpoint"):
        checkpoints.wait()
        checkpoints.close()
    timer.seconds["profile"] = profiler.seconds
    split = {**timer.finish(), "compile_cache": {"dir": cache_dir, "hits": cache_events.hits,
                                                 "misses": cache_events.misses}}
    only_specific_processes()(timer.progress)(run_dir, last_saved, "end")
    report.message("%s", describe(split))
    final = jax.device_get(metrics)
    trained = nnx.state(nnx.merge(planned.graphdef, state)["model"], nnx.Param)
    report.close({
        "final_step": last_saved,
        "completed": code == 0,
        "task": task.name,
        "parameters": params,
        "train_loss": float(final["loss"]) if final else None,
        **{f"eval_{name}": eval_metrics.get(name) for name in task.shown},
        **{f"eval_ema_{name}": eval_metrics.get(f"ema_{name}") for name in task.shown if cfg.ema.decay},
        "seconds": round(time.perf_counter() - began, 3),
        # jitted: an eager norm of sharded leaves is a chain of cross-process additions that can
        # interleave differently on each process and hang (seen under fsdp on 2 processes)
        "params_norm": float(jax.jit(optax.tree.norm)(trained)),
        "params_sha256": fingerprint(trained),
        "slowest_hosts": watch.slowest(),  # the processes named as stragglers, each at its slowest
        "goodput": split,
    })
    return code


def evaluate_batches(eval_step: Callable[..., Any], state: Any, batch: Callable[[int], Any], batches: int,
                     weight: str | None, should_stop: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
    """Every metric averaged over eval batches 0..batches-1 (weighted by the task's weight metric); None
    when `should_stop` (the collective preemption check after each batch) says a signal came."""
    sums: dict[str, float] = {}
    total = 0.0
    for i in range(batches):
        metrics = {k: float(v) for k, v in jax.device_get(eval_step(state, batch(i))).items()}
        if should_stop():
            return None
        w = metrics.pop(weight) if weight else 1.0
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + value * w
        total += w
    return {name: value / total if total else 0.0 for name, value in sums.items()}


def evaluate_checkpoint(cfg: TrainConfig, task: Task, step: int | None = None) -> int:
    """`python -m job eval`: restore step `step` (default the newest) of cfg.run_dir on this topology and
    evaluate it as the run does; process 0 writes RUN_DIR/eval-STEP.json. Returns 0."""
    from jax.sharding import NamedSharding, PartitionSpec

    from job import sharding
    from job import state as state_plan
    from job.batches import global_batch
    from job.checkpoint import Checkpointer
    from job.multihost import only_specific_processes
    from job.steps import jit_eval_step

    job.initialize()
    run_dir = storage.run_path(cfg.run_dir)
    mesh = sharding.make_mesh(model_axis=cfg.model_axis)
    source = task.source(cfg.data, cfg.model)
    tx, _ = _optimizer(task, cfg)
    planned = state_plan.plan(task, cfg, mesh, tx)
    checkpoints = Checkpointer(run_dir / "checkpoints", cfg.ckpt)
    try:
        chosen = checkpoints.saved_step(step)
        restored = checkpoints.restore(chosen, planned.abstract)
    finally:
        checkpoints.close()
    batch_sharding = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
    eval_step = jit_eval_step(task.loss, planned.eval_graphdef, task.weight)
    with sharding.mesh_context(mesh):
        metrics = evaluate_batches(eval_step, restored, lambda i: global_batch(
            source, batch_sharding, split="eval", step=i, size=cfg.data.global_batch), cfg.data.eval_batches,
            task.weight)
    record = {"step": chosen, "split": "eval", "batches": cfg.data.eval_batches, **(metrics or {})}
    only_specific_processes()(_write_json)(run_dir / f"eval-{chosen}.json", record)
    only_specific_processes()(log.info)("eval of step %d: %s -> %s", chosen, ", ".join(
        f"{k} {v:.6g}" for k, v in (metrics or {}).items()), run_dir / f"eval-{chosen}.json")
    return 0


def _optimizer(task: Task, cfg: TrainConfig) -> tuple[Any, Any]:
    """(transformation, schedule): the task's own, else --optim.*."""
    from job.steps import make_optimizer

    return task.optimizer(cfg, cfg.steps) if task.optimizer else make_optimizer(cfg.optim, cfg.steps)


def _write_json(path: epath.Path, record: dict) -> None:
    import json

    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _written(flush: Callable[[], None], what: str) -> None:
    try:
        flush()
    except OSError as exc:
        log.warning("could not write the %s at the end of the run: %s", what, exc)


def _topology(info: job.ClusterInfo, mesh: jax.sharding.Mesh) -> dict:
    """Where the run ran, for its provenance record."""
    devices = jax.devices()
    return {"kind": info.kind, "processes": info.num_processes, "local_devices": jax.local_device_count(),
            "devices": len(devices), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "mesh": dict(mesh.shape), "hosts": len({d.process_index for d in devices})}


def _save_config(run_dir: epath.Path, cfg: TrainConfig) -> None:
    storage.make_dirs(run_dir)
    (run_dir / "config.json").write_text(to_json(cfg) + "\n")
