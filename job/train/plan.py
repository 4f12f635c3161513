"""The plan of a run's step, for any task: its mesh, rules, rows, state and jitted step, built before any array
of the state exists; and the policy remat `auto` stands for, chosen by compiling that step.

    mesh = run_mesh(cfg.model_axis, cfg.mesh)                  # --mesh's axes, else ("data", "model")
    run_plan = plan_run(cfg, task, mesh)                       # rows, learning rate, the state's plan, evaluator
    step = train_step_of(cfg, task, run_plan.planned, mesh)    # jitted; compile it inside
    with sharding.mesh_context(mesh, run_rules(cfg, task)): ...

The training loop (job/train/loop.py) builds its run with `build_run` and runs it; the fit check
(job/train/fit.py) compiles the same step for a TPU slice's devices ahead of time, and an evaluation of a
checkpoint (job/train/trained.py) plans the same state on its own mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import optax
from etils import epath
from flax import nnx

from job.core import rundir, storage
from job.core.errors import ConfigError
from job.kernels.rematerialize import choosing
from job.parallel import mesh_flag, sharding
from job.parallel.mesh import equal_slices
from job.parallel.multihost import barrier, on_process_zero
from job.parallel.rows import row_span
from job.runs import local_tier, resume
from job.runs.checkpoint import saved_steps
from job.runs.tiers import Origin
from job.runtime import compile_cache, device_memory, preflight
from job.runtime.cluster import ClusterInfo, node_name
from job.train import aside, memory, optimizers, remat_auto, remat_cache
from job.train import state as state_plan
from job.train.batches import impurity, to_global
from job.train.config import TrainConfig, to_dict
from job.train.evaluation import Evaluator
from job.train.steps import jit_eval_step, jit_train_step, leaked_tracer_note
from job.train.task import Rows, Task

log = logging.getLogger("job.train")


def run_rules(cfg: TrainConfig, task: Task) -> dict[str, sharding.MeshAxes]:
    """The run's rule table (--rule and the task's own logical axes): how the state is placed, and how a
    model's `job.sharding.constrain` lays its activations out while its steps are traced."""
    return sharding.rule_table(cfg.rule, getattr(task, "logical_axes", None))


def run_mesh(model_axis: int, mesh: str = "", devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The run's mesh over every device of the job (or `devices`: a TPU slice's compiled for ahead of time,
    job/train/fit.py): the axes `mesh_flag.run_shape` gives for them (--mesh's `mesh`, else ("data", "model")
    of `model_axis`), each error naming the user's flag, not the function that builds the mesh."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_flag.run_shape(mesh, model_axis, *equal_slices(devices, "the job's devices"))
    return sharding.make_mesh(devices, axes=shape)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run and an evaluation of its checkpoint both build on a mesh (`plan_run`); no array is made."""

    source: Rows  # the task's rows
    schedule: optax.Schedule  # the learning rate by step
    planned: state_plan.Plan  # shapes, shardings and the init of the state
    evaluator: Evaluator  # over the task's eval splits


def plan_run(cfg: TrainConfig, task: Task, mesh: jax.sharding.Mesh, *, evaluating: bool = False) -> RunPlan:
    """The task's rows, the learning rate, the state's plan and the Evaluator of a run of `task` on `mesh`
    (`evaluating`: for `python -m job eval`, which warns only about the model's placement)."""
    source = task.source(cfg.data, cfg.model)
    tx, schedule = optimizers.for_task(task, cfg)
    planned = state_plan.plan(task, cfg, mesh, tx, evaluating=evaluating)
    evaluator = Evaluator(jit_eval_step(task.loss, planned.eval_graphdef, task.weight), source, mesh,
                          splits=task.eval_splits, global_batch=cfg.data.global_batch,
                          batches=cfg.data.eval_batches, full=cfg.eval_full, weight=task.weight)
    return RunPlan(source=source, schedule=schedule, planned=planned, evaluator=evaluator)


def train_step_of(cfg: TrainConfig, task: Task, planned: state_plan.Plan, mesh: jax.sharding.Mesh) -> jax.stages.Wrapped:
    """The run's jitted train step on `mesh`: the loop's, and what the fit check compiles for a TPU slice
    ahead of time (job/train/fit.py). Compile it inside `sharding.mesh_context(mesh, run_rules(cfg, task))`."""
    micro = sharding.batch_sharding(mesh, whole=1)  # K micro-batches stacked on a leading axis
    return jit_train_step(task.loss, planned.graphdef, planned.shardings, accum_steps=cfg.accum_steps,
                          weight=task.weight, custom=task.train_step, micro_sharding=micro)


@dataclasses.dataclass
class Built:
    """What `build_run` makes for the loop before any array of the train state exists."""

    run_dir: epath.Path
    mesh: jax.sharding.Mesh
    source: Rows  # the task's rows
    planned: state_plan.Plan  # shapes, shardings and the init of the state
    schedule: optax.Schedule  # the learning rate by step
    train_step: jax.stages.Wrapped  # (state, batch) -> (state, metrics), jitted
    evaluator: Evaluator  # over the task's eval splits
    batch_sharding: jax.sharding.Sharding  # how a train batch is laid out
    checked: preflight.Summary  # the preflight's findings
    cache_dir: str | None  # the compilation cache's folder; None: off


def build_run(cfg: TrainConfig, task: Task, info: ClusterInfo) -> Built:
    """The loop's first phase: the mesh, the task's rows, the optimizer, the state's plan (no array made) and
    the jitted steps, after the compilation cache is on and the preflight has run."""
    cache_dir = compile_cache.enable(cfg.compile_cache, run_dir=cfg.run_dir)  # before the first compilation
    log.info("process %d of %d (%s) on %s", info.process_id, info.num_processes, info.kind, node_name())
    run_dir = storage.run_path(cfg.run_dir)  # a local folder or gs://BUCKET/FOLDER (etils.epath)
    checked = preflight.check(to_dict(cfg), rundir.checkpoints(run_dir))
    mesh = run_mesh(cfg.model_axis, mesh=cfg.mesh)
    sharding.check_global_batch(cfg.data.global_batch, cfg.accum_steps, mesh)
    # shapes and placement first, no array made; the state is then created as its shards, or restored into them
    run_plan = plan_run(cfg, task, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    train_step = train_step_of(cfg, task, run_plan.planned, mesh)
    return Built(run_dir=run_dir, mesh=mesh, source=run_plan.source, planned=run_plan.planned,
                 schedule=run_plan.schedule, train_step=train_step, evaluator=run_plan.evaluator,
                 batch_sharding=batch_sharding, checked=checked, cache_dir=cache_dir)


def first_batch(source: Rows, batch_sharding: jax.sharding.Sharding, *, step: int, size: int) -> dict[str, jax.Array]:
    """The batch of the first step, its rows asked for twice first: a source whose answers differ (an unseeded
    rng, a stream read on) stops every process with one error (exit 2) before any step, instead of training
    on with resume and topology invariance silently lost."""
    start, stop = row_span(batch_sharding, size)
    rows, problem = impurity(source, "train", step, start, stop)
    found = preflight.problems_of_all("pure_rows", problem)
    if found:
        process, said = next(iter(found.items()))
        error = ConfigError("the task's rows", expected="rows(split, step, start, stop) a pure function of its "
                            "arguments: the same rows every time a batch is asked for", found=f"process {process}: {said}",
                            fix="draw the rows' randomness from job.random (row_bits, uniform, below: keyed by seed, "
                                "split, step and row), not from an unseeded np.random.default_rng(), random or a stream "
                                "read on; an iterator-style pipeline: index a dataset by (step * global batch + row) "
                                "(docs/your-model.md)")
        preflight.raise_together(error, "pure_rows")
    return to_global(rows, batch_sharding, size)


@dataclasses.dataclass(frozen=True)
class RematAsk:
    """What remat `auto`'s choice is for (the step, its devices and their memory: the record's key), the `limit`
    of bytes a device, and what an earlier run chose for it (`recall_remat`)."""

    chosen_for: dict[str, Any]
    limit: int | None
    earlier: remat_auto.Remembered | None

    @property
    def first(self) -> str:
        """The policy remat auto compiles first."""
        return remat_auto.order_of(self.earlier)[0]


def recall_remat(cfg: TrainConfig, built: Built) -> RematAsk:
    """What remat auto's choice is for, and the earlier run's choice for the same step on the same devices
    (job/train/remat_cache.py), process 0's on every process: a collective."""
    devices = list(built.mesh.devices.flat)
    limit = device_memory.limit(devices[0])
    chosen_for = {"task": cfg.task, "model": to_dict(cfg)["model"], "global_batch": cfg.data.global_batch,
                  "rule": cfg.rule, "accum_steps": cfg.accum_steps, "mesh": dict(built.mesh.shape),
                  "devices": memory.describe(devices), "limit": limit, "jax": jax.__version__,
                  "compiler": getattr(devices[0].client, "platform_version", "")}
    return RematAsk(chosen_for, limit, remat_cache.recall(built.run_dir, built.cache_dir, chosen_for))


def choose_remat(cfg: TrainConfig, task: Task, built: Built, args: tuple[Any, ...], ask: RematAsk) -> str:
    """The policy remat `auto` stands for in this run: the fastest whose compiled train step fits the device
    (job/train/remat_auto.py), the one an earlier run chose for the same step compiled first (`ask`,
    `recall_remat`); `built.train_step` becomes the step compiled under it, for `args` (the state and a batch,
    or their abstract shapes). One error with the bytes and the flags where nothing fits. Called inside the
    run's mesh context, as the loop compiles."""
    compile_under = remat_auto.compiling(lambda: train_step_of(cfg, task, built.planned, built.mesh), args,
                                         ask.limit)
    choice = remat_auto.choose(compile_under, limit=ask.limit, first=ask.earlier)
    if not choice.fits:  # as XLA's own out-of-memory: one error, the bytes, the flags that may fit
        memory.raise_out_of_memory(cfg, task, built.mesh, choice.need, "compiling the train step")
    on_process_zero(log.info, "%s", choice.line())
    on_process_zero(remat_cache.remember, built.run_dir, built.cache_dir, ask.chosen_for, choice)
    built.train_step = choice.step
    return choice.policy


def expected_start(cfg: TrainConfig, run_dir: epath.Path) -> int:
    """The step the restore is expected to start from, before it runs: the node-local tier's step where the
    restore will take it (`local_expected`), else the newest step saved in the run dir (a folder named by its
    number), else 0 (--no-resume too). The restore decides (an unreadable step set aside, a node-local file that
    fails its checksum); where it decides otherwise, what was made for this guess is made again. Collective with
    --ckpt.local-every and --resume."""
    if not cfg.resume:
        return 0
    folder = rundir.checkpoints(run_dir)
    try:
        persistent = max(saved_steps(folder), default=None) if folder.exists() else None
    except OSError:  # unreadable here: the restore says so
        persistent = None
    local = local_expected(cfg, run_dir, persistent) if cfg.ckpt.local_every else None
    return local if local is not None else persistent or 0


def local_expected(cfg: TrainConfig, run_dir: epath.Path, persistent: int | None,
                   group: local_tier.Group | None = None) -> int | None:
    """The node-local step the restore will take (as `Checkpoints` chooses it: the newest step whose every
    process's file some node holds, newer than every process's newest persistent step), else None; read only:
    nothing is made, fetched or read back. Every process gets process 0's decision from every process's listing
    (one exchange through the coordination service's key-value store, as the tier's own restore). Collective."""
    group = local_tier.Group.of_this_run() if group is None else group
    folder = local_tier.run_folder(cfg.ckpt.local_dir, str(run_dir))
    try:
        held = tuple(local_tier.held(folder))
    except OSError:  # unreadable here: the tier's restore says so
        held = ()
    mine = local_tier.Listing(node_name(), held, persistent)
    decided = group.decided(f"{local_tier.KEY}expected", mine.to_json(), lambda said: local_tier.plan_restore(
        [local_tier.Listing.from_json(x) for x in said]).to_json())
    return local_tier.RestorePlan.from_json(decided).step


def compile_step(cfg: TrainConfig, task: Task, built: Built, step: int) -> tuple[
        dict[str, jax.Array], str, float, aside.EvalAside | aside.NoEvalAside]:
    """Before the state exists: the batch of `step` (its rows asked for twice: `first_batch`), the earlier run's
    remat choice recalled (`recall_remat`), the eval step traced under the policy remat auto compiles first and
    compiling on a thread (`aside.eval_aside`), and the train step compiled for the batch and the state's
    abstract shapes, remat `auto` chosen so (`choose_remat`); then every process meets at the barrier "step
    compiled", as after the eval step (`compile_ahead`): one still compiling makes the others wait there, not
    in a collective before it (both collectives come before the first trace). (the batch, the policy, this
    process's seconds, the eval step compiling aside: settled here where this raises)."""
    with sharding.mesh_context(built.mesh, run_rules(cfg, task)), leaked_tracer_note():  # as steps are called
        began = time.perf_counter()
        batch = first_batch(built.source, built.batch_sharding, step=step, size=cfg.data.global_batch)
        ask = recall_remat(cfg, built)
        evals = aside.eval_aside(task, built.evaluator, built.planned, ask.first)
        try:
            remat = choose_remat(cfg, task, built, (built.planned.abstract, batch), ask)
            seconds = time.perf_counter() - began
            barrier("step compiled", cfg.compile_timeout_s, fix=_compile_fix(cfg))
        except BaseException:
            evals.settle()
            raise
    return batch, remat, seconds, evals


def _compile_fix(cfg: TrainConfig) -> str:
    return (f"read those processes' logs: still compiling after --compile-timeout-s {cfg.compile_timeout_s:g}"
            " (pass a larger one), or they died or hung")


def compile_ahead(cfg: TrainConfig, task: Task, built: Built, state: nnx.State, remat: str,
                  evals: aside.EvalAside | aside.NoEvalAside) -> float:
    """The eval step compiled for `state` under `remat` (the train step is compiled already: `compile_step`): the
    one `evals` compiled aside where it is that policy's program, else compiled now; then every process waits at
    the barrier "compiled": the first step's call finds its program compiled, and a process that loaded its
    programs from the cache waits here for one that compiles, not in the first collective (whose CPU transport,
    gloo, gives up after 30 s). This process's seconds compiling (waiting for the aside's compile included)."""
    with sharding.mesh_context(built.mesh, run_rules(cfg, task)), leaked_tracer_note():  # as steps are called
        began = time.perf_counter()
        if not evals.take(built.evaluator, state, remat):
            with choosing(remat):
                built.evaluator.compile(state)
        seconds = time.perf_counter() - began
        barrier("compiled", cfg.compile_timeout_s, fix=_compile_fix(cfg))
    return seconds


def opening_lines(cfg: TrainConfig, task: Task, info: ClusterInfo, built: Built, start: int, origin: Origin,
                  changed: Sequence[resume.Change], moved: epath.Path | None) -> list[str]:
    """The run's opening lines: where its state came from (`origin`), the flags `changed` since the saved run
    (and what that does to the learning rate), the checkpoints --no-resume `moved` aside (None: none), the
    preflight's findings, and what `build_run` built (the cluster, the task, the parameters, mesh and rule,
    each eval split)."""
    resumed = origin.said()
    lines = [] if resumed is None else [resumed]
    if start and changed:
        lr_note = optimizers.schedule_change(task, cfg, changed, start)  # None: the same schedule
        listed = ", ".join(f"{resume.flag(name)} {old!r} -> {new!r}" for name, old, new in changed)
        lines.append(f"changed since the saved run (the state is the same): {listed}"
                     + (f"; {lr_note}" if lr_note else ""))
    if moved is not None:
        lines.append(f"--no-resume: starting afresh; the earlier checkpoints are kept in {moved}")
    lines.append(built.checked.line())
    lines.append(f"{info.summary()}; task {task.name}; {built.planned.params} parameters; mesh "
                 f"{dict(built.mesh.shape)}; rule {cfg.rule}")
    return lines + [f"eval split {split}: {built.evaluator.rows(split)} rows in {len(batches)} batches"
                    for split, batches in built.evaluator.plan.items()]


__all__ = ["Built", "RematAsk", "RunPlan", "build_run", "choose_remat", "compile_ahead", "compile_step",
           "expected_start", "first_batch", "local_expected", "opening_lines", "plan_run", "recall_remat",
           "run_mesh", "run_rules", "train_step_of"]
