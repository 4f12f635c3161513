"""A run after training: its config, its model on one host, an evaluation of a checkpoint, an export.

    from job.train import trained
    model, cfg = trained.load_model("runs/example")            # newest step; the optimizer is not read
    model, cfg = trained.load_model("runs/example", ema=True)  # the EMA's parameters (--ema.decay runs)

    python -m job eval --run-dir runs/example [--step N]       # any topology: RUN_DIR/eval-STEP.json
    python -m job eval --run-dir runs/example --model-axis 1   # this tensor-parallel run's model axis here
    python -m job export --run-dir runs/example OUT [--step N] # the model's state alone, an orbax checkpoint

The model comes back in eval mode (dropout off), whole on this host's devices, its remat `auto` replaced by the
policy the run chose (RUN_DIR/remat.json: `auto` is the training loop's choice, an error outside it); `eval`
traces its steps under that policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from job.core import rundir, storage, values
from job.core.errors import BAD_INPUT_EXIT_CODE, ConfigError
from job.kernels import rematerialize
from job.observe import process_log
from job.parallel import mesh_flag, sharding
from job.parallel.mesh import slice_sizes
from job.parallel.multihost import on_process_zero
from job.runs import resume
from job.runs.checkpoint import Checkpointer
from job.runtime.distributed import initialize
from job.train import config, entry, memory, plan, remat_cache, state
from job.train import task as tasks
from job.train.config import TrainConfig
from job.train.task import Task

log = logging.getLogger("job.train.trained")


def saved_config(run_dir: str) -> tuple[TrainConfig, Task]:
    """(TrainConfig, Task) of a run dir, from its config.json."""
    path = storage.run_path(run_dir)
    saved = resume.saved_config(path)
    if saved is None:
        raise ConfigError("--run-dir", expected="a run dir with the config.json its training wrote",
                          found=f"{run_dir} (no readable config.json)", fix="pass the --run-dir a training ran in")
    chosen = tasks.load(saved.get("task", tasks.DEFAULT_TASK))
    return config.from_dict(saved, chosen), chosen


def load_model(run_dir: str, step: int | None = None, *, ema: bool = False) -> tuple[nnx.Module, TrainConfig]:
    """(the trained model in eval mode, its TrainConfig), from one step (default: the newest) of a run
    dir; only the model's own state is read (with `ema`, the EMA's copy of it), onto this host's
    devices, replicated. One process (it reads the checkpoint alone). A model config's remat `auto` is
    replaced by what the run chose for it (`_ran_remat`), so the model is called as it is, outside the loop."""
    cfg, chosen = saved_config(run_dir)
    cfg = dataclasses.replace(cfg, model=_explicit_remat(cfg.model, _ran_remat(run_dir)))
    if ema and not cfg.ema.decay:
        raise ConfigError("ema=True", expected="a run trained with --ema.decay", found=f"{run_dir} (no EMA)",
                          fix="load its model with ema=False")
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(lambda: chosen.build(cfg.model, nnx.Rngs(cfg.seed)))
    graphdef, abstract_state = nnx.split(abstract_model)
    mesh = sharding.make_mesh(devices=jax.local_devices())
    like = state.placed(abstract_state, sharding.placement(abstract_state, mesh, "replicated")[0])
    target = {"ema": {"model": like}} if ema else {"model": like}
    checkpoints = Checkpointer(rundir.checkpoints(storage.run_path(run_dir)), cfg.ckpt)
    try:
        restored = checkpoints.restore(checkpoints.saved_step(step), target, partial=True)
    finally:
        checkpoints.close()
    model = nnx.merge(graphdef, restored["ema"]["model"] if ema else restored["model"])
    model.eval()
    return model, cfg


SAVED_STEP = "pass one of the run's saved steps (its folders in RUN_DIR/checkpoints), or none for the newest"


def run_dir_parser(prog: str) -> argparse.ArgumentParser:
    """`python -m job PROG --run-dir D [--step N]`, for the commands that read a trained run (eval, export,
    a task's own, such as the lm task's sample)."""
    p = argparse.ArgumentParser(prog=f"python -m job {prog}")
    p.add_argument("--run-dir", required=True, help="the run dir a training wrote")
    p.add_argument("--step", type=values.for_argparse(values.whole, fix=SAVED_STEP), default=None,
                   help="a saved step (default: the newest)")
    return p


def eval_command(argv: list[str]) -> int:
    """`python -m job eval --run-dir D [--step N] [--model-axis M]`: restore a checkpoint on this topology,
    evaluate it as the run does (--data.eval-batches batches of each split), write D/eval-STEP.json on
    process 0."""
    p = run_dir_parser("eval")
    p.add_argument("--model-axis", type=values.for_argparse(values.whole, fix="pass --model-axis 1", minimum=1),
                   default=None, help="the model axis here (default: the run's, else the largest that divides both "
                                      "it and this job's devices)")
    with entry.parsing():  # a usage error: printed by process 0 only
        args = p.parse_args(argv)
    try:
        cfg, chosen = saved_config(args.run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    return evaluate_checkpoint(cfg, chosen, args.step, model_axis=args.model_axis)


def eval_mesh(cfg: TrainConfig, given: int | None = None) -> tuple[jax.sharding.Mesh, TrainConfig]:
    """(the mesh an evaluation runs on, the run's config on it): `given` (eval's --model-axis; an error names
    it), else the run's own mesh (--mesh, or its --model-axis) where it fits this job's devices, else the
    largest model axis that divides both the run's and them (said in the log: the checkpoint is resharded as
    it is restored, as an elastic resume does)."""
    if given is not None:
        return plan.run_mesh(given), dataclasses.replace(cfg, model_axis=given, mesh="")
    try:
        return plan.run_mesh(cfg.model_axis, mesh=cfg.mesh), cfg
    except ConfigError:
        saved = mesh_flag.model_size(mesh_flag.run_axes(cfg.mesh, cfg.model_axis))
        n = jax.device_count()
        here = math.gcd(saved, n // len(slice_sizes(jax.devices())))  # a model group stays inside one slice
        on_process_zero(log.info, "the run's %s does not fit this job's %d device(s): evaluating with a model "
                        "axis of %d (the checkpoint is resharded as it is restored; eval's --model-axis chooses "
                        "another)", mesh_flag.flag_text(cfg.mesh, saved), n, here)
        return plan.run_mesh(here), dataclasses.replace(cfg, model_axis=here, mesh="")


def evaluate_checkpoint(cfg: TrainConfig, task: Task, step: int | None = None, *,
                        model_axis: int | None = None) -> int:
    """`python -m job eval`: restore step `step` (default the newest) of cfg.run_dir on this topology (its
    model axis `model_axis`, else as `eval_mesh` picks) and evaluate every eval split as the run does;
    process 0 writes RUN_DIR/eval-STEP.json. Every node of the state but the optimizer is read. Each process's
    output is also appended to its file in RUN_DIR/logs, as a run's is. Returns 0."""
    info = initialize()
    with process_log.teed(cfg.run_dir, info.process_id):
        return _evaluate(cfg, task, step, model_axis)


def _evaluate(cfg: TrainConfig, task: Task, step: int | None, model_axis: int | None) -> int:
    run_dir = storage.run_path(cfg.run_dir)
    mesh, cfg = eval_mesh(cfg, model_axis)
    run_plan = plan.plan_run(cfg, task, mesh, evaluating=True)
    evaluator = run_plan.evaluator
    checkpoints = Checkpointer(rundir.checkpoints(run_dir), cfg.ckpt)
    try:
        chosen = checkpoints.saved_step(step)
        restored = checkpoints.restore(chosen, run_plan.planned.abstract, partial=True)  # no optimizer state
    finally:
        checkpoints.close()
    with sharding.mesh_context(mesh, plan.run_rules(cfg, task)), rematerialize.choosing(_ran_remat(cfg.run_dir)):
        results = evaluator.run(restored) or {}
    record = {"step": chosen, "splits": {split: {"rows": evaluator.rows(split), "batches": len(evaluator.plan[split]),
                                                 **metrics} for split, metrics in results.items()}}
    on_process_zero(_write_json, rundir.evaluation(run_dir, chosen), record)
    for split, metrics in results.items():
        on_process_zero(log.info, "eval of step %d on %s: %s", chosen, split, ", ".join(
            f"{k} {v:.6g}" for k, v in metrics.items()))
    on_process_zero(log.info, "wrote %s", rundir.evaluation(run_dir, chosen))
    return 0


def _ran_remat(run_dir: str) -> str:
    """The policy remat `auto` stood for in the run (RUN_DIR/remat.json, job/train/remat_cache.py); none for a run
    that did not record one (before the record was kept): an evaluation runs forward only, where every policy
    computes the same (a policy says what the backward pass keeps)."""
    return remat_cache.ran(storage.run_path(run_dir)) or "none"


def _explicit_remat(model_cfg: Any, policy: str) -> Any:
    """`model_cfg` with its remat field (job/train/memory.py's REMAT_FIELD) `policy` where it says auto."""
    fields = {f.name for f in dataclasses.fields(model_cfg)} if dataclasses.is_dataclass(model_cfg) else set()
    value = getattr(model_cfg, memory.REMAT_FIELD, None)
    if memory.REMAT_FIELD not in fields or not isinstance(value, (str, bool)) or rematerialize.name(value) != "auto":
        return model_cfg
    return dataclasses.replace(model_cfg, **{memory.REMAT_FIELD: policy})


def _write_json(path: epath.Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def export_command(argv: list[str]) -> int:
    """`python -m job export --run-dir D OUT [--step N]`: the model's state alone (no optimizer), as an
    orbax checkpoint at OUT that `orbax.checkpoint.StandardCheckpointer().restore(OUT)` reads."""
    p = run_dir_parser("export")
    p.add_argument("out", help="the folder to write (must not exist)")
    with entry.parsing():  # a usage error: printed by process 0 only
        args = p.parse_args(argv)
    try:
        model, cfg = load_model(args.run_dir, args.step)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    out = epath.Path(args.out).absolute() if "://" not in args.out else epath.Path(args.out)
    if out.exists():
        print(f"error: export OUT: expected a path that does not exist, found {out}. Fix: pass a new folder",
              file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    with ocp.StandardCheckpointer() as writer:
        writer.save(out, nnx.state(model))
    (out.parent / f"{out.name}.config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    print(f"wrote the {cfg.task} model's state to {out} (and its config to {out.name}.config.json)")
    return 0


__all__ = ["eval_command", "evaluate_checkpoint", "export_command", "load_model", "run_dir_parser", "saved_config"]
