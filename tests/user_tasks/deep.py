"""A user's deep model, kept outside job/: an unrolled stack of many small residual layers (a Python loop
over an `nnx.List`, no scan), so its compile time grows with its depth.

    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.deep:TASK --model.layers 96 --steps 2

With DEEP_TRACE_DELAY_S=S in the environment, process 1 sleeps S seconds the first time the loss is traced
(the start of its first compilation), as a host that compiles S seconds slower than process 0 would.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import job.task

TRACE_DELAY = "DEEP_TRACE_DELAY_S"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    features: int = 8
    width: int = 16
    layers: int = 48


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 16
    eval_batches: int = 1


class Layer(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.dense = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nnx.gelu(self.dense(self.norm(x)))


class Deep(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(cfg.features, cfg.width, rngs=rngs)
        self.layers = nnx.List([Layer(cfg.width, rngs=rngs) for _ in range(cfg.layers)])
        self.out = nnx.Linear(cfg.width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)[:, 0]


class SlowFirstTrace:
    """Process 1 sleeps $DEEP_TRACE_DELAY_S seconds once, when the loss is first traced."""

    def __init__(self) -> None:
        self.pending = True

    def __call__(self) -> None:
        if self.pending and jax.process_index() == 1:
            self.pending = False
            time.sleep(float(os.environ.get(TRACE_DELAY, "0") or 0))


slow_first_trace = SlowFirstTrace()


def loss(model: Deep, batch: dict) -> tuple[jax.Array, dict]:
    slow_first_trace()
    error = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return error, {"loss": error}


class Rows:
    """y = mean(sin(x)) for x drawn from the row's own seed: a pure function of (split, step, row)."""

    def __init__(self, features: int) -> None:
        self.features = features

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        x = np.stack([np.random.default_rng([split == "eval", step, r]).normal(size=self.features)
                      for r in range(start, stop)]).astype(np.float32)
        return {"x": x, "y": np.sin(x).mean(axis=1)}


TASK = job.task.Task(
    name="deep",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: Deep(cfg, rngs=rngs),
    loss=loss,
    source=lambda data_cfg, model_cfg: Rows(model_cfg.features),
)
