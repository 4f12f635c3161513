"""A user's task in the style of the flax NNX tutorials, outside job/: its own model, data, config and
optimizer (SGD with Nesterov momentum and a step-decay schedule built from its own config).

    python -m job train --task tests.user_tasks.regression:TASK --model.hidden 32 --model.lr 0.05
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import job.task


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    features: int = 4
    hidden: int = 16
    lr: float = 0.05  # the user's own learning-rate flag: their optimizer reads it
    momentum: float = 0.9
    decay_at: int = 10  # the learning rate halves at this step


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 16
    eval_batches: int = 1


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(cfg.features, cfg.hidden, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def loss(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
    error = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return error, {"loss": error}


class Rows:
    """y = sum(x) for x drawn from the row's own seed: a pure function of (split, step, row)."""

    def __init__(self, features: int) -> None:
        self.features = features

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        x = np.stack([np.random.default_rng([split == "eval", step, r]).normal(size=self.features)
                      for r in range(start, stop)]).astype(np.float32)
        return {"x": x, "y": x.sum(axis=1)}


def optimizer(cfg, steps: int):  # noqa: ANN001, ANN201 - the user's code: (TrainConfig, steps) -> (tx, schedule)
    schedule = optax.piecewise_constant_schedule(cfg.model.lr, {cfg.model.decay_at: 0.5})
    return optax.sgd(schedule, momentum=cfg.model.momentum, nesterov=True), schedule


TASK = job.task.Task(
    name="regression",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: MLP(cfg, rngs=rngs),
    loss=loss,
    source=lambda data_cfg, model_cfg: Rows(model_cfg.features),
    optimizer=optimizer,
    commands={"echo": lambda args: print("echo", *args) or 0},
)
