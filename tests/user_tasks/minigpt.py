"""A user's model in the style of flax's NNX miniGPT tutorial, kept outside job/: its own transformer
with dropout (an rng stream in the model), its own logical axis name ("hidden"), its own optimizer
(Lion with a warmup, built from its own config), its own extra state and train step (a count of the
rows trained on), and its own rows. With `--ema.decay` it also keeps an EMA of its parameters.

    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.minigpt:TASK --rule tensor --model-axis 2 --ema.decay 0.9

The train steps run it in train mode (dropout on, a fresh key each step from its rng state), the
evaluations in eval mode (dropout off), as the tutorial's `model.train()` / `model.eval()` do.
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
    vocab: int = 16
    maxlen: int = 16
    embed: int = 32
    heads: int = 4
    ff: int = 64
    blocks: int = 1
    dropout: float = 0.1
    lr: float = 3e-3  # the user's own optimizer flags
    warmup: int = 4


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 8
    eval_batches: int = 1


def dense(cfg: ModelConfig, n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.xavier_uniform(), names)
    return nnx.Linear(n_in, n_out, kernel_init=init, use_bias=False, rngs=rngs)


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.embed, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.heads = cfg.heads
        self.qkv = dense(cfg, cfg.embed, 3 * cfg.embed, ("embed", "hidden"), rngs)
        self.proj = dense(cfg, cfg.embed, cfg.embed, ("hidden", "embed"), rngs)
        self.norm1 = layer_norm(cfg, rngs)
        self.norm2 = layer_norm(cfg, rngs)
        self.up = dense(cfg, cfg.embed, cfg.ff, ("embed", "hidden"), rngs)
        self.down = dense(cfg, cfg.ff, cfg.embed, ("hidden", "embed"), rngs)
        self.dropout1 = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.dropout2 = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, self.heads, 3 * d // self.heads), 3, axis=-1)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        x = x + self.dropout1(self.proj(y))
        return x + self.dropout2(self.down(nnx.relu(self.up(self.norm2(x)))))


class MiniGPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(cfg.vocab, cfg.embed, embedding_init=nnx.with_partitioning(init, ("hidden", "embed")),
                                rngs=rngs)
        self.positions = nnx.Embed(cfg.maxlen, cfg.embed, embedding_init=nnx.with_partitioning(init, (None, "embed")),
                                   rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(cfg, rngs=rngs) for _ in range(cfg.blocks)])
        self.out = dense(cfg, cfg.embed, cfg.vocab, ("embed", "hidden"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def loss(model: MiniGPT, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["tokens"][:, :-1])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
    return value, {"loss": value}


class Rows:
    """Counting sequences from a random start with a random stride: a pure function of (split, step, row)."""

    def __init__(self, vocab: int, maxlen: int) -> None:
        self.vocab, self.maxlen = vocab, maxlen

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        out = []
        for r in range(start, stop):
            first, stride = np.random.default_rng([split == "eval", step, r]).integers(0, self.vocab, 2)
            out.append((first + (1 + stride % 3) * np.arange(self.maxlen)) % self.vocab)
        return {"tokens": np.stack(out).astype(np.int32)}


class Seen(nnx.Module):
    """The user's own extra state: how many rows the model has trained on (checkpointed with it)."""

    def __init__(self) -> None:
        self.rows = nnx.Variable(jnp.zeros((), jnp.int32))


def train_step(nodes: dict, batch: dict, default) -> dict:  # noqa: ANN001 - default(nodes, batch) -> metrics
    """The usual gradient step, then the user's own bookkeeping."""
    metrics = default(nodes, batch)
    nodes["seen"].rows.value += batch["tokens"].shape[0]
    return {**metrics, "rows_seen": nodes["seen"].rows.value}


def optimizer(cfg, steps: int):  # noqa: ANN001, ANN201 - the user's: (TrainConfig, steps) -> (tx, schedule)
    schedule = optax.warmup_constant_schedule(0.0, cfg.model.lr, cfg.model.warmup)
    return optax.lion(schedule, b1=0.9, b2=0.99), schedule


TASK = job.task.Task(
    name="minigpt",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: MiniGPT(cfg, rngs=rngs),
    loss=loss,
    source=lambda data_cfg, model_cfg: Rows(model_cfg.vocab, model_cfg.maxlen),
    optimizer=optimizer,
    extra_state=lambda cfg, model: {"seen": Seen()},
    train_step=train_step,
    # its own name: "hidden" goes over the "model" axis where the rule is tensor-parallel
    logical_axes={"hidden": {"tensor": "model", "fsdp_tensor": "model"}},
)
