"""The classifier, as the flax NNX guides write one: an MLP with input jitter and dropout, on in training and off in
evaluation (the loop calls `model.train()` and `model.eval()`), each drawing from an rng stream the model keeps."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from job.sharding import axes


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    features: int = 4  # inputs of a row: --model.features
    hidden: int = 32  # --model.hidden
    classes: int = 3  # --model.classes
    dropout: float = 0.1  # --model.dropout
    jitter: float = 0.1  # standard deviation of the noise added to the inputs in training: --model.jitter


class Jitter(nnx.Module):
    """Gaussian noise on the inputs in training, none in evaluation, from the model's own "noise" stream (its key
    and count are model state: placed, checkpointed and restored like the weights)."""

    def __init__(self, scale: float, *, rngs: nnx.Rngs) -> None:
        self.scale, self.deterministic = scale, False
        self.rngs = rngs["noise"].fork()

    def __call__(self, x: jax.Array) -> jax.Array:
        return x if self.deterministic else x + self.scale * jax.random.normal(self.rngs(), x.shape, x.dtype)


class Classifier(nnx.Module):
    """Annotated with the template's own `axes` (the layers' `*_metadata`), so the --rule flags can split it."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.jitter = Jitter(cfg.jitter, rngs=rngs)
        self.hidden = nnx.Linear(cfg.features, cfg.hidden, kernel_metadata=axes("embed", "mlp"),
                                 bias_metadata=axes("mlp"), rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, cfg.classes, kernel_metadata=axes("mlp", None), bias_metadata=axes(None),
                              rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.dropout(nnx.relu(self.hidden(self.jitter(x)))))


def cross_entropy(model: Classifier, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return value, {"loss": value, "accuracy": (logits.argmax(-1) == batch["label"]).mean()}
