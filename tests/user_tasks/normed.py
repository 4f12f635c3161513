"""A user's model as a flax tutorial writes it, without a sharding annotation: the regression task's MLP
(tests/user_tasks/regression.py) with an nnx.LayerNorm after its hidden layer. Under --rule fsdp nothing of
it can split, and the run's one warning shows where each of its layers takes its annotation.

    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.normed:TASK --rule fsdp
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from tests.user_tasks import regression


class NormedMLP(nnx.Module):
    def __init__(self, cfg: regression.ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(cfg.features, cfg.hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.norm(self.hidden(x))))[:, 0]


TASK = dataclasses.replace(regression.TASK, name="normed", build=lambda cfg, rngs: NormedMLP(cfg, rngs=rngs))
