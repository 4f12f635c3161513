"""What the training loop needs from a task, and how a task is found by name.

A task is one folder, `job/tasks/NAME/`, whose `task.py` defines
`TASK = Task(...)`; `python -m job train --task NAME` runs it (default `lm`).
A fork keeps its tasks in its own package instead: `--task mytasks.minigpt:TASK`
loads the Task object TASK of the importable module mytasks.minigpt.
The loop, checkpoints, reporting and benchmarks see only this interface:

    TASK = Task(
        name="mine",
        model_config=ModelConfig,          # frozen dataclass: the --model.* flags
        data_config=DataConfig,            # frozen dataclass: the --data.* flags (global_batch, eval_batches)
        build=lambda model_cfg, rngs: Net(model_cfg, rngs=rngs),
        loss=loss,                         # (model, batch) -> (scalar loss, {"loss": ..., other metrics})
        source=lambda data_cfg, model_cfg: MyRows(...),  # .rows(split, step, start, stop) -> {name: array}
    )

`rows` must be a pure function of (split, step, row range): every topology
then sees the same global batches, and a resumed run the very batches an
uninterrupted one would.

Evaluation covers every split in `eval_splits` (default: "eval"), each reported
under its own name (`eval_loss`, `test_loss`, ...). A split the source gives a
size (`split_size(split)` -> rows, None for no end) is finite: each evaluation is one
full pass over it, reading `rows(split, 0, start, stop)` with row numbers of the
whole split (job/train/evaluation.py); other splits get --data.eval-batches batches.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

from job.core import flags
from job.core.errors import ConfigError

if TYPE_CHECKING:
    from flax import nnx

TASKS_PACKAGE = "job.tasks"
DEFAULT_TASK = "lm"
SPLITS = ("train", "eval")  # eval batches are numbered from 0 like steps


class Rows(Protocol):
    def rows(self, split: str, step: int, start: int, stop: int) -> Mapping[str, Any]:
        """Global rows [start, stop) of batch `step` of `split`: arrays with a leading row axis.
        A source may also define `split_size(split) -> int | None`: the rows of a finite split (a name of
        its own, so that `size`, such as an image side, stays the source's; job/train/evaluation.py)."""
        ...


def _no_checks(model_cfg: Any, data_cfg: Any, *, rule: str, model_axis: int) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # the folder under job/tasks/, and the value of --task
    model_config: type  # frozen dataclass of the model's sizes: --model.* flags
    data_config: type  # frozen dataclass with at least global_batch and eval_batches: --data.* flags
    build: Callable[[Any, nnx.Rngs], nnx.Module]  # (model config, its random keys) -> the model to train
    loss: Callable[[Any, Mapping[str, Any]], tuple[Any, dict[str, Any]]]  # (model, batch) -> (loss, metrics)
    source: Callable[[Any, Any], Rows]  # (data config, model config) -> the batches, by row
    validate: Callable[..., None] = _no_checks  # (model cfg, data cfg, rule=, model_axis=): ConfigError if bad
    shown: Sequence[str] = ("loss",)  # the metrics the progress line shows, in order
    weight: str | None = None  # metric that weighs eval batches (e.g. "tokens"); None: equal weights
    items_per_row: Callable[[Any], int] = lambda model_cfg: 1  # throughput unit per row (tokens for an LM)
    unit: str = "samples"  # what items_per_row counts, for the progress line (tok, samples)
    commands: Mapping[str, Callable[[list[str]], int]] = dataclasses.field(default_factory=dict)  # python -m job X
    # (TrainConfig, steps) -> (optax transformation, schedule), seeing the task's own config; steps: the horizon
    # its schedule spans (--optim.decay-steps, else --steps); None: --optim.*
    optimizer: Callable[[Any, int], tuple[Any, Any]] | None = None
    # the task's own logical axis names, merged with job.sharding's: {name: {rule: "data", "model" or None}},
    # e.g. {"experts": {"tensor": "model"}}; a rule a name does not mention keeps that dimension whole
    logical_axes: Mapping[str, Mapping[str, str | None]] = dataclasses.field(default_factory=dict)
    # (TrainConfig, model) -> {name: nnx graph node}: more train state (an EMA, a second model, counters),
    # created, placed by its annotations, checkpointed and restored with the model and optimizer
    extra_state: Callable[[Any, Any], Mapping[str, Any]] | None = None
    # --preset NAME: {name: () -> (model config, data config[, {TrainConfig field: value}])}, each a named
    # experiment whose docstring gives the exact command that runs it; the optional mapping sets the run's
    # own fields, nested ones as {"optim": {"lr": 6e-4}} (job/tasks/lm/presets.py)
    presets: Mapping[str, Callable[[], tuple[Any, ...]]] = dataclasses.field(default_factory=dict)
    # the held-out splits evaluated every --eval-every steps, each under its own name in every record
    eval_splits: Sequence[str] = ("eval",)
    # (nodes, batch, default) -> metrics: the body of the jitted train step, for what one loss cannot say;
    # nodes = {"model", "optimizer", extra state...}, default(nodes, batch) is the usual gradient step
    train_step: Callable[[Mapping[str, Any], Mapping[str, Any], Callable[..., Any]], Mapping[str, Any]] | None = None


def names() -> list[str]:
    """The tasks under job/tasks/."""
    package = importlib.import_module(TASKS_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)


def load(name: str) -> Task:
    """The TASK of job/tasks/NAME/, or the Task at MODULE:ATTR in any importable module (a fork's own
    package); one clear error when there is none."""
    if ":" in name:
        return _load_from_module(name)
    if name not in names():
        raise ConfigError("--task", expected=f"one of {', '.join(names())} (folders under job/tasks/), or MODULE:ATTR",
                          found=name, fix=_unknown_task_fix(name))
    try:
        module = importlib.import_module(f"{TASKS_PACKAGE}.{name}.task")
    except ModuleNotFoundError as exc:
        if exc.name != f"{TASKS_PACKAGE}.{name}.task":
            raise
        module = None
    task = getattr(module, "TASK", None)
    if not isinstance(task, Task):
        raise ConfigError(f"job/tasks/{name}/task.py", expected="a module-level TASK = job.task.Task(...)",
                          found=type(task).__name__, fix="define TASK there (see job/tasks/lm/task.py)")
    return task


def _unknown_task_fix(name: str) -> str:
    """A path or a dotted module: the MODULE:ATTR form; a typo: the nearest task; else how to add one."""
    if "/" in name or "." in name:
        module = name.removesuffix(".py").replace("/", ".").strip(".")
        return f"pass --task {module}:TASK (MODULE:ATTR: an importable module, and the name of its job.task.Task)"
    near = difflib.get_close_matches(name, names(), n=1, cutoff=0.6)
    if near:
        return f"pass --task {near[0]} (did you mean {near[0]}?)"
    return (f"pass --task {DEFAULT_TASK}, or --task MODULE:ATTR for a task in your own package, or add the folder "
            f"job/tasks/{name}/ with a TASK")


def _load_from_module(spec: str) -> Task:
    """`--task mytasks.minigpt:TASK`: the Task object ATTR of MODULE."""
    module_name, _, attr = spec.partition(":")
    fix = "pass --task PACKAGE.MODULE:ATTR with the module importable (installed, or on PYTHONPATH)"
    if not module_name or not attr.isidentifier():
        raise ConfigError("--task", expected="NAME (a folder under job/tasks/) or MODULE:ATTR", found=spec, fix=fix)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("--task", expected=f"an importable module {module_name}", found=f"{spec} ({exc})",
                          fix=fix) from exc
    task = getattr(module, attr, None)
    if not isinstance(task, Task):
        tasks = sorted(name for name, value in vars(module).items() if isinstance(value, Task))
        found = f"no {attr} in {module_name}" if task is None else f"{attr} is a {type(task).__name__}"
        fix = (f"pass --task {module_name}:{tasks[0]}" + (f" (its Tasks: {', '.join(tasks)})" if len(tasks) > 1 else "")
               if tasks else f"define {attr} = job.task.Task(...) in {module_name}")
        raise ConfigError("--task", expected=f"{module_name}.{attr} to be a job.task.Task", found=found, fix=fix)
    return task


@overload
def task_name(args: Sequence[str], default: str = DEFAULT_TASK) -> str: ...
@overload
def task_name(args: Sequence[str], default: None) -> str | None: ...


def task_name(args: Sequence[str], default: str | None = DEFAULT_TASK) -> str | None:
    """The value of --task in a command line (the last one given, as the config's parser takes it), else `default`."""
    return flags.value(args, "--task", default)


def without_task(args: Sequence[str]) -> list[str]:
    """`args` without its --task flags (what a task's own command gets)."""
    return flags.without(args, "--task")


__all__ = ["DEFAULT_TASK", "Rows", "SPLITS", "Task", "load", "names", "task_name", "without_task"]
