"""tests/user_tasks/llama.py after docs/your-model.md's "Fast on a TPU": the same model with the lines a user
changes to take the library's kernels (job.kernels: attention with its 4 kv heads, remat by name, the chunked
head loss, the embedding's lookup). Everything else is the file as the user wrote it
(tests/unit/test_user_kernels.py counts the changed lines).

    python -m job train --task tests.user_tasks.llama_fast:TASK --preset gpt2-small-size
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import job.errors
import job.task
from job import kernels


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64  # token ids 0..vocab-1
    seq_len: int = 32  # positions trained on per row (a row holds seq_len + 1 tokens)
    dim: int = 64  # model width
    layers: int = 2  # decoder blocks, stacked and scanned
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention), dividing heads
    mlp: int = 128  # SwiGLU hidden width
    rope_base: float = 10000.0  # RoPE's base wavelength
    dtype: str = "float32"  # compute dtype ("bfloat16" on an accelerator); parameters stay float32
    remat: str = "auto"  # what each block keeps: none, dots, full, or auto (the most that fits)
    rms_eps: float = 1e-6  # RMSNorm's epsilon


@dataclasses.dataclass(frozen=True)
class DataConfig:
    global_batch: int = 8
    eval_batches: int = 1


def linear(cfg: ModelConfig, n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=init, dtype=jnp.dtype(cfg.dtype),
                      param_dtype=jnp.float32, rngs=rngs)


def rms_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.dim, epsilon=cfg.rms_eps, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)), rngs=rngs)


def rope(x: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of x [B, L, H, D] at positions 0..L-1 (rotate-half form), in float32."""
    length, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]  # [1, L, 1, D]
    xf = x.astype(jnp.float32)
    half = d // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention: kv_heads key/value heads shared by heads query heads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.heads
        self.q = linear(cfg, cfg.dim, cfg.heads * self.head_dim, ("embed", "heads"), rngs)
        self.k = linear(cfg, cfg.dim, cfg.kv_heads * self.head_dim, ("embed", "heads"), rngs)
        self.v = linear(cfg, cfg.dim, cfg.kv_heads * self.head_dim, ("embed", "heads"), rngs)
        self.o = linear(cfg, cfg.heads * self.head_dim, cfg.dim, ("heads", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, length, _ = x.shape
        q = rope(self.q(x).reshape(b, length, self.cfg.heads, self.head_dim), self.cfg.rope_base)
        k = rope(self.k(x).reshape(b, length, self.cfg.kv_heads, self.head_dim), self.cfg.rope_base)
        v = self.v(x).reshape(b, length, self.cfg.kv_heads, self.head_dim)
        y = kernels.attention(q, k, v)
        return self.o(y.reshape(b, length, self.cfg.heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.gate = linear(cfg, cfg.dim, cfg.mlp, ("embed", "mlp"), rngs)
        self.up = linear(cfg, cfg.dim, cfg.mlp, ("embed", "mlp"), rngs)
        self.down = linear(cfg, cfg.mlp, cfg.dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def block_call(block: Block, x: jax.Array) -> jax.Array:
    """One block on x (what the scan runs, under nnx.remat when cfg.remat)."""
    return block(x)


class Llama(nnx.Module):
    """int32 tokens [B, L] -> float32 logits [B, L, vocab]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
                               embedding_init=init, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.norm = rms_norm(cfg, rngs)
        self.head = linear(cfg, cfg.dim, cfg.vocab, ("embed", "vocab"), rngs)

    def run_blocks(self, x: jax.Array) -> jax.Array:
        """x [B, L, dim] through the stacked blocks, one scan iteration per layer."""
        call = kernels.remat(block_call, self.cfg.remat, flag="--model.remat")

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"},
                  unroll=True)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return call(block, x)

        return body(x, self.blocks)

    def features(self, tokens: jax.Array) -> jax.Array:
        """The normalized last hidden states [B, L, dim]."""
        return self.norm(self.run_blocks(kernels.embed_tokens(self.embed, tokens)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.features(tokens)).astype(jnp.float32)


def loss(model: Llama, batch: dict) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy, a chunk of positions at a time against the head (no whole logits)."""
    tokens = batch["tokens"]
    targets = tokens[:, 1:]
    weights = jnp.ones(targets.shape, jnp.float32)
    total, hits = kernels.head_cross_entropy(model.features(tokens[:, :-1]), model.head.kernel[...], targets, weights)
    value, accuracy = total / targets.size, hits / targets.size
    return value, {"loss": value, "accuracy": accuracy}


class Rows:
    """Each row: a random start, then +stride mod vocab, the stride one of a few per row; a pure function
    of (split, step, row)."""

    STRIDES = (1, 2, 3, 5)

    def __init__(self, vocab: int, seq_len: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len

    def rows(self, split: str, step: int, start: int, stop: int) -> dict:
        split_id = {"train": 0, "eval": 1}[split]
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        for i, row in enumerate(range(start, stop)):
            rng = np.random.default_rng([split_id, step, row])
            first, stride = rng.integers(0, self.vocab), rng.choice(self.STRIDES)
            out[i] = (first + stride * np.arange(self.seq_len + 1)) % self.vocab
        return {"tokens": out}


def validate(cfg: ModelConfig, data_cfg: DataConfig, *, rule: str, model_axis: int) -> None:
    if cfg.heads % cfg.kv_heads:
        raise job.errors.ConfigError("--model.kv-heads", expected=f"a divisor of --model.heads={cfg.heads}",
                                     found=cfg.kv_heads, fix="pass --model.kv-heads 1, 2 or another divisor of heads")
    if cfg.dim % cfg.heads:
        raise job.errors.ConfigError("--model.dim", expected=f"a multiple of --model.heads={cfg.heads}",
                                     found=cfg.dim, fix=f"pass --model.dim {-(-cfg.dim // cfg.heads) * cfg.heads}")


def gpt2_small_size() -> tuple[ModelConfig, DataConfig, dict]:
    """GPT-2 small's size as a Llama: 152.8M parameters (untied head), 0.798 GFLOP a token, bf16 compute,
    global batch 16 x 1024 tokens, 100 steps.

        python -m job train --task tests.user_tasks.llama_fast:TASK --preset gpt2-small-size
    """
    return (ModelConfig(vocab=50304, seq_len=1024, dim=768, layers=12, heads=12, kv_heads=4, mlp=2048,
                        dtype="bfloat16", remat="auto"),
            DataConfig(global_batch=16),
            {"steps": 100, "log_every": 10, "eval_every": 1000, "optim": {"lr": 3e-4, "warmup_steps": 10},
             "accum_steps": 2})


PRESETS = {"gpt2-small-size": gpt2_small_size}

TASK = job.task.Task(
    name="llama_fast",
    model_config=ModelConfig,
    data_config=DataConfig,
    build=lambda cfg, rngs: Llama(cfg, rngs=rngs),
    loss=loss,
    source=lambda data_cfg, model_cfg: Rows(model_cfg.vocab, model_cfg.seq_len),
    validate=validate,
    shown=("loss", "accuracy"),
    items_per_row=lambda cfg: cfg.seq_len,
    unit="tok",
    presets=PRESETS,
)
