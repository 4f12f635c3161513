"""A user's task built from the public names alone (docs/api.md, "What a fork may import"): striped
images of one of four frequencies, drawn from `job.random`, classified by an MLP annotated with
`job.sharding.axes`, checked with `job.errors.require`, its optimizer typed with `TrainConfig`.

Its source keeps the image side in `self.size`, as image tutorials do: that is its own attribute,
not the finite-split method (`split_size`), which gives its held-out "test" split 40 rows.

    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.textures:TASK --steps 4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from job.errors import ConfigError, require
from job.random import below, row_bits, uniform
from job.sharding import axes, partitioned
from job.task import SPLITS, Task
from job.train.config import TrainConfig

TEST_ROWS = 40  # the held-out "test" split: finite, each evaluation one full pass
SPLIT_IDS = {**{split: i for i, split in enumerate(SPLITS)}, "test": len(SPLITS)}  # each split's own rows


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    size: int = 32  # the image side, in pixels
    hidden: int = 32
    classes: int = 4
    lr: float = 1e-2


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 16
    eval_batches: int = 1  # the "eval" split has no end: this many batches of it
    seed: int = 0


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(cfg.size * cfg.size, cfg.hidden, kernel_metadata=axes("embed", "mlp"), rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, cfg.classes, rngs=rngs,
                              kernel_init=partitioned(nnx.initializers.lecun_normal(), ("mlp", None)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


class Stripes:
    """Row r of a split: stripes of the row's class frequency at a random phase, plus noise; a pure
    function of (seed, split, step, row), so every topology and a resumed run see the same batches."""

    def __init__(self, cfg: DataConfig, model: ModelConfig) -> None:
        self.size = model.size  # the image side: the source's own attribute, nothing the loop reads
        self.seed, self.classes = cfg.seed, model.classes

    def split_size(self, split: str) -> int | None:
        return TEST_ROWS if split == "test" else None

    def rows(self, split: str, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        bits = row_bits(self.seed, SPLIT_IDS[split], step, start, stop, 2 + self.size * self.size)
        label = below(bits[:, 0], self.classes)
        phase = 2 * np.pi * uniform(bits[:, 1])
        y = np.arange(self.size)[None, :, None]
        image = np.cos(2 * np.pi * (label[:, None, None] + 1) * y / self.size + phase[:, None, None])
        noise = uniform(bits[:, 2:]).reshape(-1, self.size, self.size) - 0.5
        pixels = (image + noise).reshape(stop - start, -1).astype(np.float32)
        return {"x": pixels, "label": label.astype(np.int32)}


def loss(model: MLP, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    logits = model(batch["x"])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return value, {"loss": value, "accuracy": jnp.mean(logits.argmax(-1) == batch["label"])}


def validate(model_cfg: ModelConfig, data_cfg: DataConfig, *, rule: str, model_axis: int) -> None:
    require(model_cfg.size >= 4, "--model.size", "an image side of 4 pixels or more", model_cfg.size,
            "pass --model.size 32")
    if model_cfg.classes < 2:
        raise ConfigError("--model.classes", expected="2 or more", found=model_cfg.classes, fix="pass --model.classes 4")


def optimizer(cfg: TrainConfig, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.cosine_decay_schedule(cfg.model.lr, steps, alpha=0.1)
    return optax.adam(schedule), schedule


TASK = Task(
    name="textures",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: MLP(cfg, rngs=rngs),
    loss=loss,
    source=Stripes,
    validate=validate,
    shown=("loss", "accuracy"),
    eval_splits=("eval", "test"),
    optimizer=optimizer,
)
