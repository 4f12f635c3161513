"""The optimizer and its learning-rate schedule, by name (`--optim.name`, `--optim.schedule`).

    python -m job train --optim.name lion --optim.lr 3e-4 --optim.schedule warmup-stable-decay
    python -m job train --optim.name sgd --optim.b1 0.9 --optim.clip-norm 0     # momentum 0.9, no clipping

Every schedule warms up linearly from 0 to `--optim.lr` over `--optim.warmup-steps`, then:
cosine decays to lr x min_lr_ratio at the last step; linear does the same in a straight line;
constant stays at lr; warmup-stable-decay stays at lr and decays linearly to lr x min_lr_ratio over
the last `--optim.decay-fraction` of the steps. The schedule spans `--optim.decay-steps` steps,
else `--steps`: a resume that raises `--steps` stretches it (the run says so, with the learning rate
before and after: `schedule_change`), unless `--optim.decay-steps` keeps the saved run's horizon.
A task with its own idea of training gives `Task(optimizer=...)`: `(TrainConfig, steps) ->
(transformation, schedule)`, which sees the task's own model and data config (job/train/task.py)
and the same horizon as `steps`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import optax

from job.core.errors import ConfigError
from job.train.config import OPTIMIZER_NAMES, OptimConfig, TrainConfig, from_dict, to_dict
from job.train.task import Task

if TYPE_CHECKING:  # resume brings orbax: the sweep checks import this module for for_task alone
    from job.runs.resume import Change

PROBES = 8  # schedule_change compares the two schedules at about this many steps past the resumed one


def _adamw(o: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)


def _adam(o: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adam(lr, b1=o.b1, b2=o.b2)


def _sgd(o: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=o.b1 or None)


def _lion(o: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.lion(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)


def _adafactor(o: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adafactor(lr, weight_decay_rate=o.weight_decay or None)


# --optim.name -> its transformation (b1/b2: Adam's and Lion's betas, SGD's momentum)
OPTIMIZERS: dict[str, Callable[[OptimConfig, optax.Schedule], optax.GradientTransformation]] = {
    "adamw": _adamw, "adam": _adam, "sgd": _sgd, "lion": _lion, "adafactor": _adafactor,
}
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "job.train.config.OPTIMIZER_NAMES lists the optimizers above"


def make_schedule(o: OptimConfig, steps: int) -> optax.Schedule:
    """Linear warmup to `o.lr`, then `o.schedule` until `steps` (see the module docstring)."""
    warmup = min(o.warmup_steps, max(steps - 1, 0))
    rest = max(steps - warmup, 1)
    low = o.lr * o.min_lr_ratio
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, max(steps, o.warmup_steps + 1),
                                                  end_value=low)
    if o.schedule == "constant":
        after = optax.constant_schedule(o.lr)
    elif o.schedule == "linear":
        after = optax.linear_schedule(o.lr, low, rest)
    else:  # warmup-stable-decay
        decay = max(int(round(rest * o.decay_fraction)), 1)
        after = optax.join_schedules([optax.constant_schedule(o.lr), optax.linear_schedule(o.lr, low, decay)],
                                     [rest - decay])
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), after], [warmup])


def make_optimizer(o: OptimConfig, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`o.name` with `o.schedule`, after global-norm clipping at `o.clip_norm` (0: no clipping)."""
    schedule = make_schedule(o, steps)
    tx = OPTIMIZERS[o.name](o, schedule)
    return (optax.chain(optax.clip_by_global_norm(o.clip_norm), tx) if o.clip_norm > 0 else tx), schedule


def horizon(cfg: TrainConfig) -> int:
    """The steps the learning-rate schedule spans: --optim.decay-steps, else --steps."""
    return cfg.optim.decay_steps or cfg.steps


class _Reads:
    """`cfg.optim` as a task's own optimizer sees it: each field it reads is noted."""

    def __init__(self, optim: OptimConfig) -> None:
        object.__setattr__(self, "_optim", optim)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._optim, name)


def for_task(task: Task, cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, schedule) of a run: the task's own, else --optim.*, over `horizon(cfg)` steps. A task's
    own optimizer that does not read an --optim.* value the run was given stops the run here (exit 2): the flag
    would change nothing (a sweep over it would train the same run again and again)."""
    steps = horizon(cfg)
    if not task.optimizer:
        return make_optimizer(cfg.optim, steps)
    seen = _Reads(cfg.optim)
    # the proxy answers every field as cfg.optim does, noting which are read
    built = task.optimizer(dataclasses.replace(cfg, optim=cast(OptimConfig, seen)), steps)
    defaults = type(cfg.optim)()
    # decay_steps is the loop's (the horizon it passes as `steps`), read whether or not the task reads it
    given = [f.name for f in dataclasses.fields(cfg.optim) if f.name != "decay_steps"
             and getattr(cfg.optim, f.name) != getattr(defaults, f.name)]
    unread = [name for name in given if name not in seen.read]
    if unread:
        flag = f"--optim.{unread[0].replace('_', '-')}"
        raise ConfigError(flag, expected=f"only --optim.* flags task {task.name}'s own optimizer reads (Task.optimizer "
                          f"builds it and reads no cfg.optim.{unread[0]})",
                          found=" ".join(f"--optim.{n.replace('_', '-')} {getattr(cfg.optim, n)}" for n in unread),
                          fix=f"drop {flag} (set it where the task's optimizer takes its values, e.g. its --model.* "
                              f"config), or read cfg.optim.{unread[0]} in Task.optimizer")
    return built


def schedule_change(task: Task, cfg: TrainConfig, changes: Sequence[Change], step: int) -> str | None:
    """What resuming from `step` with `changes` (as job.runs.resume.check lists them) does to the learning
    rate: None when the schedule is the same, else a sentence with the rate of both schedules at the first
    step where they differ (from the resumed one on, numbered as the progress line numbers them) and, when
    the horizon moved, the flag that keeps it."""
    saved = saved_config(cfg, changes, task)
    before, after = for_task(task, saved)[1], for_task(task, cfg)[1]
    end = max(cfg.steps, saved.steps, horizon(cfg), horizon(saved))
    first = max(step - 1, 0)  # the schedule's index of the resumed step (step N runs at schedule(N - 1))
    probes = sorted({*range(first, end, max(1, (end - first) // PROBES)), end - 1})
    for i in probes:
        old, new = float(before(i)), float(after(i))
        if not math.isclose(old, new, rel_tol=1e-6, abs_tol=1e-12):
            break
    else:
        return None
    line = (f"the learning-rate schedule changes: at step {i + 1} the saved run's gives lr {old:.3e}, "
            f"this run's {new:.3e}")
    if horizon(saved) != horizon(cfg):
        line += (f" (it spans --optim.decay-steps, else --steps: {horizon(saved)} -> {horizon(cfg)}; pass "
                 f"--optim.decay-steps {horizon(saved)} to keep the saved one)")
    return line


def saved_config(cfg: TrainConfig, changes: Sequence[Change], task: Task) -> TrainConfig:
    """The saved run's config: `cfg` with every changed field's saved value. A field the saved run
    lacked (saved value None) takes its default; one this code lacks is left out."""
    values = to_dict(cfg)
    for name, old, _ in changes:
        *path, last = name.split(".")
        node: object = values
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            continue
        if old is None:
            del node[last]
        else:
            node[last] = old
    return from_dict(values, task)


__all__ = ["OPTIMIZERS", "PROBES", "for_task", "horizon", "make_optimizer", "make_schedule", "saved_config",
           "schedule_change"]
