"""A user's classifier in the style of flax's NNX MNIST tutorial, outside job/: an MLP with batch norm
and dropout (`nnx.BatchNorm`, `nnx.Dropout`: batch statistics in training, running averages in
evaluation), logical axis names on its kernels, and a finite dataset of its own with two held-out
splits ("eval" and "test") whose sizes are no multiple of any batch, each evaluated in one full pass.

    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.digits:TASK --rule fsdp --steps 40

Or through the user's own entry point (tests/user_tasks/train_digits.py), which needs no --task.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

import job.task

SIZES = {"train": 256, "eval": 50, "test": 37}  # rows of each split of the dataset


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    features: int = 8
    hidden: int = 32
    classes: int = 4
    dropout: float = 0.2


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 16
    eval_batches: int = 1  # for a split without a size; these have one, so each evaluation is a full pass
    seed: int = 3


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        ones = nnx.initializers.ones_init()
        self.hidden = nnx.Linear(cfg.features, cfg.hidden, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(kernel, ("embed", "mlp")),
                                 bias_init=nnx.with_partitioning(zeros, ("mlp",)))
        self.norm = nnx.BatchNorm(cfg.hidden, momentum=0.9, rngs=rngs, scale_init=nnx.with_partitioning(ones, ("mlp",)),
                                  bias_init=nnx.with_partitioning(zeros, ("mlp",)))
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, cfg.classes, rngs=rngs,
                              kernel_init=nnx.with_partitioning(kernel, ("mlp", None)),
                              bias_init=nnx.with_partitioning(zeros, (None,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def loss(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = (logits.argmax(-1) == batch["label"]).mean()
    return value, {"loss": value, "accuracy": accuracy}


class Dataset:
    """A fixed table per split (Gaussian clusters, one per class); train rows are drawn from its table by
    (step, row), the held-out splits are read in order: `split_size` says how many rows they have."""

    def __init__(self, cfg: DataConfig, model: ModelConfig) -> None:
        rng = np.random.default_rng(cfg.seed)
        centres = rng.normal(size=(model.classes, model.features)) * 2.0
        self.tables = {}
        for split, n in SIZES.items():
            labels = rng.integers(0, model.classes, n)
            x = centres[labels] + rng.normal(size=(n, model.features))
            self.tables[split] = (x.astype(np.float32), labels.astype(np.int32))

    def split_size(self, split: str) -> int | None:
        return None if split == "train" else SIZES[split]

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        x, labels = self.tables[split]
        if split == "train":
            index = np.array([np.random.default_rng([step, r]).integers(0, len(x)) for r in range(start, stop)])
        else:
            assert 0 <= start <= stop <= len(x), (split, start, stop)  # a full pass reads each row once
            index = np.arange(start, stop)
        return {"x": x[index], "label": labels[index]}


def full_split(data_cfg: DataConfig, model_cfg: ModelConfig, split: str) -> dict:
    """Every row of a held-out split as one batch (what a test evaluates the trained model on)."""
    return Dataset(data_cfg, model_cfg).rows(split, 0, 0, SIZES[split])


TASK = job.task.Task(
    name="digits",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: MLP(cfg, rngs=rngs),
    loss=loss,
    source=Dataset,
    shown=("loss", "accuracy"),
    eval_splits=("eval", "test"),
    optimizer=lambda cfg, steps: (optax.adam(1e-2), optax.constant_schedule(1e-2)),
)

