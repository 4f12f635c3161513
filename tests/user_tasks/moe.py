"""A user's mixture-of-experts model, kept outside job/ and written as MaxText and flax write one: a
token model whose feed-forward block is a sparse mixture of experts (GShard / Switch): a top-2 router,
each expert taking at most `capacity` tokens of a group (a sequence), tokens sent to their experts and
back by dispatch and combine einsums, and a load-balancing loss added to the loss (metric `balance`).

    # experts split over an "expert" axis of 2; every other layer data-parallel over all 4 devices
    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.moe:TASK --mesh data=2,expert=2 --rule fsdp
    # experts over "expert", their mlp dimension over "model", embed over "data"
    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.moe:TASK --mesh data=1,expert=2,model=2 --rule fsdp_tensor

The expert kernels are annotated ("experts", "embed", "mlp") and ("experts", "mlp", "embed"); every
rule maps "experts" to the mesh axis "expert" (a mesh without one keeps them whole). The tokens
dispatched to the experts are laid out with `job.sharding.constrain`: made where their groups are
((None, "batch", None, "embed"): "batch" maps to "data" and "expert"), then ("experts", "batch", None,
"embed") for the experts (the experts take "expert", the groups keep "data"), so XLA sends them to their
experts' devices with an all-to-all, and the experts' outputs back the same way.

tests/multiprocess/test_experts.py trains it on these meshes and resumes it on others; bench/experts.py
measures the bytes a device holds of its experts, split and replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from job.errors import ConfigError
from job.random import below, row_bits
from job.sharding import constrain
from job.task import SPLITS, Task
from job.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 16  # tokens, and the targets they map to
    length: int = 8  # tokens per row: each row is one group the router fills its experts' capacity from
    embed: int = 16  # the model's width
    mlp: int = 16  # each expert's hidden width
    experts: int = 4
    top_k: int = 2  # experts each token is sent to
    capacity_factor: float = 1.25  # an expert's slots per group: capacity_factor * top_k * length / experts
    balance_weight: float = 0.01  # the load-balancing loss's weight in the loss
    lr: float = 1e-2


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 8
    eval_batches: int = 1
    seed: int = 0


def capacity(cfg: ModelConfig) -> int:
    """Tokens an expert takes from one group (GShard's expert capacity)."""
    return max(1, math.ceil(cfg.capacity_factor * cfg.top_k * cfg.length / cfg.experts))


def top_experts(probs_GSE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(probabilities, indices) of each token's k likeliest experts, as `jax.lax.top_k` gives them (ties to the
    lower index), taken as k argmaxes: each token's own, so XLA keeps them where the tokens are (XLA:CPU
    gathers the whole batch's probabilities onto every device for lax.top_k)."""
    picks, left_GSE = [], probs_GSE
    for _ in range(k):
        picks.append(jnp.argmax(left_GSE, axis=-1))
        left_GSE = jnp.where(jax.nn.one_hot(picks[-1], probs_GSE.shape[-1], dtype=bool), -jnp.inf, left_GSE)
    chosen_GSK = jnp.stack(picks, axis=-1)
    return jnp.take_along_axis(probs_GSE, chosen_GSK, axis=-1), chosen_GSK


def route(probs_GSE: jax.Array, top_k: int, slots: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(dispatch mask, combine weights, both [G, S, E, C]; the assignments chosen and those kept, both
    [G, S, K, E]) of the router's probabilities: each token to its top_k experts, gates renormalised over
    them, every token's first choice seated before any second choice (GShard), an expert's tokens past its
    `slots` dropped."""
    g, s, e = probs_GSE.shape
    gates_GSK, chosen_GSK = top_experts(probs_GSE, top_k)
    gates_GSK = gates_GSK / gates_GSK.sum(-1, keepdims=True)
    chosen_GSKE = jax.nn.one_hot(chosen_GSK, e, dtype=jnp.int32)
    in_order = chosen_GSKE.transpose(0, 2, 1, 3).reshape(g, top_k * s, e)  # choice-major: first choices first
    seat = ((jnp.cumsum(in_order, axis=1) - 1) * in_order).reshape(g, top_k, s, e).transpose(0, 2, 1, 3)
    kept_GSKE = chosen_GSKE * (seat < slots)
    slot_GSKEC = jax.nn.one_hot(seat, slots, dtype=probs_GSE.dtype) * kept_GSKE[..., None]
    dispatch_GSEC = slot_GSKEC.sum(2)
    combine_GSEC = (gates_GSK[..., None, None] * slot_GSKEC).sum(2)
    return dispatch_GSEC, combine_GSEC, chosen_GSKE, kept_GSKE


def balance_loss(probs_GSE: jax.Array, chosen_GSKE: jax.Array) -> jax.Array:
    """Switch's load-balancing loss: E x sum over experts of (the share of assignments it got) x (its mean
    router probability); 1 when the router spreads tokens evenly, up to E when it sends all to one."""
    share_E = chosen_GSKE.mean((0, 1, 2), dtype=jnp.float32)
    return probs_GSE.shape[-1] * jnp.sum(share_E * probs_GSE.mean((0, 1)))


class MoE(nnx.Module):
    """A sparse feed-forward block: the router picks top_k experts per token, each expert an MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.top_k, self.slots = cfg.top_k, capacity(cfg)
        # the router's kernel as MaxText's gate: ("embed", None), its experts' dimension whole
        self.router = nnx.Linear(cfg.embed, cfg.experts, use_bias=False, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", None)))
        init = nnx.initializers.lecun_normal(batch_axis=(0,))  # one fan-in per expert
        self.wi = nnx.Param(nnx.with_partitioning(init, ("experts", "embed", "mlp"))(
            rngs.params(), (cfg.experts, cfg.embed, cfg.mlp)))
        self.wo = nnx.Param(nnx.with_partitioning(init, ("experts", "mlp", "embed"))(
            rngs.params(), (cfg.experts, cfg.mlp, cfg.embed)))

    def __call__(self, x_GSD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        probs_GSE = jax.nn.softmax(self.router(x_GSD).astype(jnp.float32), axis=-1)
        dispatch_GSEC, combine_GSEC, chosen_GSKE, kept_GSKE = route(probs_GSE, self.top_k, self.slots)
        # the tokens each expert takes, [E, G, C, D], made where their groups are (every expert's slots of the
        # local groups), then sent to their experts' devices: from groups over "expert" to experts over it,
        # an all-to-all (GShard); the groups stay split over the batch axes left ("data")
        sent_EGCD = constrain(jnp.einsum("gsec,gsd->egcd", dispatch_GSEC, x_GSD), (None, "batch", None, "embed"))
        x_EGCD = constrain(sent_EGCD, ("experts", "batch", None, "embed"))
        h_EGCF = constrain(nnx.gelu(jnp.einsum("egcd,edf->egcf", x_EGCD, self.wi[...])),
                           ("experts", "batch", None, "mlp"))
        y_EGCD = constrain(jnp.einsum("egcf,efd->egcd", h_EGCF, self.wo[...]), ("experts", "batch", None, "embed"))
        back_EGCD = constrain(y_EGCD, (None, "batch", None, "embed"))  # the all-to-all back to the groups
        y_GSD = constrain(jnp.einsum("egcd,gsec->gsd", back_EGCD, combine_GSEC), ("batch", "length", "embed"))
        dropped = 1.0 - kept_GSKE.sum() / chosen_GSKE.sum()  # the share of assignments past an expert's capacity
        return y_GSD, {"balance": balance_loss(probs_GSE, chosen_GSKE), "dropped": dropped}


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.embed, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)


class Model(nnx.Module):
    """Embed the tokens, one pre-norm residual mixture-of-experts block, each token's logits over the vocabulary."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.balance_weight = cfg.balance_weight  # a plain float: static, not state
        self.embed = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs,
                               embedding_init=nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed")))
        self.norm = layer_norm(cfg, rngs)
        self.moe = MoE(cfg, rngs=rngs)
        self.out = nnx.Linear(cfg.embed, cfg.vocab, use_bias=False, rngs=rngs,
                              kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab")))

    def __call__(self, tokens_GS: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        # a one-hot matmul, as MaxText's iota embedding: its gradient is a dot, split as the rule says (a lookup's,
        # a scatter, XLA replicates first where "embed" is over "data" and the batch over "data" and "expert")
        onehot_GSV = jax.nn.one_hot(tokens_GS, self.embed.num_embeddings, dtype=self.embed.embedding.dtype)
        x_GSD = constrain(onehot_GSV @ self.embed.embedding[...], ("batch", "length", "embed"))
        y_GSD, routing = self.moe(self.norm(x_GSD))
        return self.out(x_GSD + y_GSD), routing


def loss(model: Model, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of each token's target, plus the load-balancing loss times its weight."""
    logits, routing = model(batch["tokens"])
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    value = xent + model.balance_weight * routing["balance"]
    return value, {"loss": value, "xent": xent, **routing,
                   "accuracy": jnp.mean(logits.argmax(-1) == batch["targets"])}


class Tokens:
    """Row r: `length` tokens drawn from job.random, each one's target a fixed permutation of it (5t + 3 mod
    vocab), which the experts learn between them; a pure function of (seed, split, step, row)."""

    def __init__(self, cfg: DataConfig, model: ModelConfig) -> None:
        self.seed, self.vocab, self.length = cfg.seed, model.vocab, model.length

    def rows(self, split: str, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        tokens = below(row_bits(self.seed, SPLITS.index(split), step, start, stop, self.length), self.vocab)
        return {"tokens": tokens.astype(np.int32), "targets": ((5 * tokens + 3) % self.vocab).astype(np.int32)}


def validate(model_cfg: ModelConfig, data_cfg: DataConfig, *, rule: str, model_axis: int) -> None:
    if not 1 <= model_cfg.top_k <= model_cfg.experts:
        raise ConfigError("--model.top-k", expected=f"1 .. --model.experts ({model_cfg.experts})",
                          found=model_cfg.top_k, fix="pass --model.top-k 2")
    if not model_cfg.capacity_factor > 0:
        raise ConfigError("--model.capacity-factor", expected="a number > 0 (1.0: room for an even share)",
                          found=model_cfg.capacity_factor, fix="pass --model.capacity-factor 1.25")


def optimizer(cfg: TrainConfig, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Adam (two moments per parameter) at a constant rate after a 2-step warmup: a few steps learn."""
    schedule = optax.warmup_constant_schedule(0.0, cfg.model.lr, 2)
    return optax.adam(schedule), schedule


TASK = Task(
    name="moe",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: Model(cfg, rngs=rngs),
    loss=loss,
    source=Tokens,
    validate=validate,
    shown=("loss", "balance", "dropped"),
    items_per_row=lambda cfg: cfg.length,
    unit="tok",
    optimizer=optimizer,
)
