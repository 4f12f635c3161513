"""The optimizer and its learning-rate schedule, by name (`--optim.name`, `--optim.schedule`).

    python -m job train --optim.name lion --optim.lr 3e-4 --optim.schedule warmup-stable-decay
    python -m job train --optim.name sgd --optim.b1 0.9 --optim.clip-norm 0     # momentum 0.9, no clipping

Every schedule warms up linearly from 0 to `--optim.lr` over `--optim.warmup-steps`, then:
cosine decays to lr x min_lr_ratio at the last step; linear does the same in a straight line;
constant stays at lr; warmup-stable-decay stays at lr and decays linearly to lr x min_lr_ratio over
the last `--optim.decay-fraction` of the steps. A task with its own idea of training gives
`Task(optimizer=...)`: `(TrainConfig, steps) -> (transformation, schedule)`, which sees the task's
own model and data config (job/train/task.py).
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from job.train.config import OPTIMIZER_NAMES, OptimConfig


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


__all__ = ["OPTIMIZERS", "make_optimizer", "make_schedule"]
