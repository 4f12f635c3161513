"""A user's task, written as the docs show (docs/training.md): a small NNX network fitting sin(x), its own config
and data, trained with the template's loop on every worker.

    make tpu-pod ... ARGS='train --task mypkg.tasks:TASK --run-dir gs://my-bucket/sine'
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import job.task


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    width: int = 16


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 8
    eval_batches: int = 1


class Sine(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.inner = nnx.Linear(1, cfg.width, rngs=rngs)
        self.outer = nnx.Linear(cfg.width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.outer(jnp.tanh(self.inner(x[:, None])))[:, 0]


def squared_error(model: Sine, batch: dict) -> tuple[jax.Array, dict]:
    error = jnp.mean((model(batch["x"]) - jnp.sin(batch["x"])) ** 2)
    return error, {"loss": error}


class Points:
    """x in [-pi, pi], each row drawn from its own seed: a pure function of (split, step, row)."""

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        x = [np.random.default_rng([split == "eval", step, row]).uniform(-np.pi, np.pi) for row in range(start, stop)]
        return {"x": np.asarray(x, np.float32)}


TASK = job.task.Task(name="sine", model_config=ModelConfig, data_config=DataConfig,
                     build=lambda cfg, rngs: Sine(cfg, rngs=rngs), loss=squared_error, source=lambda data, model: Points())
