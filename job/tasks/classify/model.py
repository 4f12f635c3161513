"""The classifier: a residual MLP from `features` coordinates to `classes` logits, in Flax NNX.

Every kernel carries logical axis names so `job.sharding` can place it
("in", "embed", "mlp", "out"); the loss is softmax cross-entropy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import optax
from flax import nnx

from job.errors import ConfigError
from job.sharding import axes

MAX_SIZE = 1 << 20


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    features: int = 2  # input coordinates (2 are the spiral; more are noise)
    classes: int = 3  # spiral arms, one class each
    dim: int = 64  # residual width ("embed")
    mlp_dim: int = 128  # hidden width of each block ("mlp")
    layers: int = 2  # residual MLP blocks


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(cfg.dim, scale_metadata=axes("embed"), bias_metadata=axes("embed"), rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.mlp_dim, kernel_metadata=axes("embed", "mlp"),
                             bias_metadata=axes("mlp"), rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_dim, cfg.dim, kernel_metadata=axes("mlp", "embed"),
                               bias_metadata=axes("embed"), rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.gelu(self.up(self.norm(h))))


class Classifier(nnx.Module):
    """float32 x [B, features] -> float32 logits [B, classes]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        validate(cfg)
        self.inp = nnx.Linear(cfg.features, cfg.dim, kernel_metadata=axes("in", "embed"),
                              bias_metadata=axes("embed"), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.head = nnx.Linear(cfg.dim, cfg.classes, kernel_metadata=axes("embed", "out"),
                               bias_metadata=axes("out"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def loss_fn(model: Classifier, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy; metrics loss, accuracy and count (the eval weight)."""
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = (logits.argmax(-1) == batch["label"]).mean()
    return loss, {"loss": loss, "accuracy": accuracy, "count": jax.numpy.float32(batch["label"].shape[0])}


def validate(cfg: ModelConfig) -> None:
    for field in ("features", "classes", "dim", "mlp_dim", "layers"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            flag = "--model." + field.replace("_", "-")
            raise ConfigError(flag, expected=f"an integer 1..{MAX_SIZE}", found=value,
                              fix=f"pass {flag} {getattr(ModelConfig, field)}")
    if cfg.features < 2 or cfg.classes < 2:
        raise ConfigError("--model.features / --model.classes", expected="at least 2 each (a 2-D spiral, 2+ arms)",
                          found=(cfg.features, cfg.classes), fix="pass --model.features 2 --model.classes 3")
