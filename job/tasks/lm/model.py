"""The example model: a small decoder-only transformer language model in Flax NNX.

Replace it with yours; keep the logical-axis annotations so `job.sharding` can place it:

    cfg = ModelConfig(vocab_size=256)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    loss, metrics = loss_fn(model, tokens, mask)  # tokens int32 [B, T], mask float [B, T]

Every parameter carries one logical axis name per dimension ("vocab", "embed",
"heads", "mlp", or None); `job.sharding.TRAIN_RULES` maps those names to mesh axes.
Call `validate(cfg, rule=..., model_axis=...)` first to fail fast on a config
that the chosen sharding rule cannot split.

Its activations are laid out by logical names too (`job.sharding.constrain`, a no-op outside the
training loop): the residual stream [B, L, D] is ("batch", "length", "embed"), so on a mesh with a
"sequence" axis (`--mesh data=2,sequence=2`) each device holds L / sequence positions of its rows.
Attention gathers keys and values whole along the sequence (see `Attention`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from job.core import renamed, values
from job.errors import ConfigError, as_config_error
from job import kernels
from job.kernels import rematerialize, self_attention
from job.kernels.cross_entropy import LOGITS
from job.kernels.self_attention import KEYS_VALUES, QUERIES
from job.sharding import LAYERS_AXIS, SEQUENCE_AXIS, axes, constrain, partitioned, rule_table

DTYPES = ("float32", "bfloat16")
MAX_SIZE = 2**31 - 1  # any model size above this is a typo (and overflows int32 shapes)
# how activations are laid out (job.sharding.constrain): the residual stream and the MLP's hidden layer; the
# logits and attention's [B, L, heads, head_dim] queries (split along the sequence) and keys and values (whole
# along it) as the kernels lay them out (LOGITS, QUERIES, KEYS_VALUES, imported above): one layout each
RESIDUAL = ("batch", "length", "embed")
HIDDEN = ("batch", "length", "mlp")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the example transformer; the defaults build 104,768 parameters."""

    vocab_size: int = 32  # tokens; the synthetic task needs 32, byte-level text 256
    seq_len: int = 32  # longest sequence (learned positions)
    dim: int = 64  # model width ("embed")
    heads: int = 4  # attention heads ("heads"); dim must be a multiple
    layers: int = 2  # transformer blocks
    mlp_dim: int = 256  # MLP hidden width ("mlp")
    dtype: str = "float32"  # activation/compute dtype ("float32" or "bfloat16"); params stay float32
    # what each block keeps for the backward pass: none (all), full, dots, dots_all, or auto: the fastest that fits
    # the device's memory, chosen by the training loop (none on CPU; logged; outside the loop an error)
    remat: str = "auto"
    # the attention kernel: auto (splash on TPU, cuDNN on GPU, XLA on CPU), xla, splash, flash or cudnn
    attention: str = "auto"
    scan: bool = True  # stack the blocks on a "layers" axis and run them with nnx.scan (one block compiled)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free projection whose kernel is annotated with the logical axes `names`."""
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
                      kernel_metadata=axes(*names), rngs=rngs)


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.dim, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
                       scale_metadata=axes("embed"), rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head self-attention with separate q/k/v/out projections.

    The "heads" dimension of a kernel is heads * head_dim wide, so splitting it
    over a model axis that divides `heads` keeps whole heads on each device.

    Split along the sequence, attention all-gathers: the queries stay split, the keys and values are
    made whole along the sequence before the scores, so each device scores its own positions against
    every position, and the causal mask (XLA's, from the global [L, L] shape) compares global positions.
    Exact and simple, at the cost of each device holding the whole sequence's keys and values (and
    scores of [B, heads, L / sequence, L]); a ring (keys and values passed round the sequence devices
    block by block) would keep only a block of them, the next step for very long sequences.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.heads = cfg.heads
        self.kernel = cfg.attention  # --model.attention: resolved per trace (job/kernels/self_attention.py)
        self.q = _linear(cfg, cfg.dim, cfg.dim, ("embed", "heads"), rngs)
        self.k = _linear(cfg, cfg.dim, cfg.dim, ("embed", "heads"), rngs)
        self.v = _linear(cfg, cfg.dim, cfg.dim, ("embed", "heads"), rngs)
        self.out = _linear(cfg, cfg.dim, cfg.dim, ("heads", "embed"), rngs)

    def _split(self, y: jax.Array) -> jax.Array:
        """[B, T, dim] -> [B, T, heads, dim // heads], the layout dot_product_attention takes."""
        return y.reshape(*y.shape[:-1], self.heads, -1)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Causal attention by the kernel --model.attention names (splash on TPU: job/kernels/self_attention.py)."""
        q = constrain(self._split(self.q(x)), QUERIES)
        k = constrain(self._split(self.k(x)), KEYS_VALUES)  # all-gathered along the sequence
        v = constrain(self._split(self.v(x)), KEYS_VALUES)
        # named by the kernel for remat's dots (job/kernels/self_attention.py)
        y = kernels.attention(q, k, v, kernel=self.kernel,  # the kernels' errors name this model's flags
                              flag=_flag_name("attention"), length_flag=_flag_name("seq_len"))
        return self.out(constrain(y, QUERIES).reshape(x.shape))


class MLP(nnx.Module):
    """Two projections with a GELU between them."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.up = _linear(cfg, cfg.dim, cfg.mlp_dim, ("embed", "mlp"), rngs)
        self.down = _linear(cfg, cfg.mlp_dim, cfg.dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(constrain(self.up(x), HIDDEN)))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x + self.attn(self.attn_norm(x)), RESIDUAL)
        return constrain(x + self.mlp(self.mlp_norm(x)), RESIDUAL)


class Transformer(nnx.Module):
    """Decoder-only LM: int32 tokens [B, T] -> float32 logits [B, T, vocab_size], T <= seq_len.

    With `cfg.scan` (the default) the blocks are one stack: every block parameter has a leading
    `layers` dimension (logical axis "layers", kept whole by every rule), made by `nnx.vmap` and run
    by `nnx.scan`, so one block is compiled whatever the depth and the backward pass keeps, per
    layer, only what the remat policy saves. `--model.no-scan` keeps the blocks in a list, unrolled."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        validate(cfg, rule="replicated", model_axis=1)  # the checks that need no mesh
        self.cfg = cfg
        init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, dtype=jnp.dtype(cfg.dtype),
                               param_dtype=jnp.float32, embedding_init=init,
                               embedding_metadata=axes("vocab", "embed"), rngs=rngs)
        self.pos = nnx.Param(partitioned(init, (None, "embed"))(rngs.params(), (cfg.seq_len, cfg.dim)))
        self.blocks: Block | nnx.List[Block]  # one stacked Block (--model.scan), or a list of them
        if cfg.scan:
            self.blocks = _stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = _norm(cfg, rngs)
        self.head = _linear(cfg, cfg.dim, cfg.vocab_size, ("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return constrain(self.head(self.features(tokens)), LOGITS).astype(jnp.float32)

    def features(self, tokens: jax.Array) -> jax.Array:
        """The normalized last hidden states [B, T, dim] that the head turns into logits (the loss takes
        them with the head's kernel, a chunk at a time: cross_entropy.py)."""
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ConfigError("sequence length", expected=f"at most seq_len={self.cfg.seq_len}",
                              found=t, fix="shorten the batch or raise --model.seq-len")
        _check_sequence_split(t)
        # positions by global index: under the mesh the arrays are global, each device adds its slice's rows
        # the table taken whole in its width, its rows split by rows as every activation (job/kernels/embedding.py)
        x = constrain(kernels.embed_tokens(self.embed, tokens) + self.pos[:t].astype(self.cfg.dtype), RESIDUAL)
        block_fn = kernels.remat(_call, self.cfg.remat, flag=_flag_name("remat"))  # auto: the policy the run chose
        if isinstance(self.blocks, nnx.List):  # --model.no-scan: unrolled
            for block in self.blocks:
                x = block_fn(block, x)
        else:
            x = _scan_blocks(block_fn, x, self.blocks)
        return self.norm(x)


def _check_sequence_split(length: int) -> None:
    """A ConfigError where the mesh of the trace has a "sequence" axis that does not divide `length`: the
    activations could not be split along it, and its devices would each compute every position."""
    mesh = jax.sharding.get_abstract_mesh()
    parts = 1 if mesh.empty else dict(mesh.shape).get(SEQUENCE_AXIS, 1)
    if length % parts:
        raise ConfigError("sequence length", expected=f"a multiple of the mesh's {SEQUENCE_AXIS!r} axis of size "
                          f"{parts}", found=length,
                          fix=f"pass --model.seq-len {-(-length // parts) * parts}, or a --mesh with a "
                              f"{SEQUENCE_AXIS!r} size that divides {length}")


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """cfg.layers blocks as one Block whose every variable has a leading `layers` dimension."""

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return make(rngs)


def _scan_blocks(block_fn: Callable[[Block, jax.Array], jax.Array], x: jax.Array, blocks: Block) -> jax.Array:
    """x through the stacked blocks, one scan iteration per layer."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
    def body(x: jax.Array, block: Block) -> jax.Array:
        return block_fn(block, x)

    return body(x, blocks)


def _call(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


remat_name = rematerialize.name  # the name a fork has imported from here


def loss_fn(model: Transformer, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross-entropy averaged over targets where `mask[:, 1:]` is 1.

    Returns (loss, {"loss", "accuracy", "tokens"}); an all-zero mask gives loss 0, not NaN.
    """
    targets = tokens[:, 1:]
    weights = mask[:, 1:].astype(jnp.float32)
    count = weights.sum()
    denom = jnp.maximum(count, 1.0)
    total, correct = kernels.head_cross_entropy(model.features(tokens[:, :-1]), model.head.kernel[...], targets, weights)
    loss = total / denom
    return loss, {"loss": loss, "accuracy": correct / denom, "tokens": count}


def encode_prompt(text: str, vocab_size: int) -> list[int]:
    """A prompt's tokens: UTF-8 bytes for a byte-level vocabulary (>= 256), else space-separated ids."""
    if vocab_size >= 256:
        return list(text.encode("utf-8"))
    with as_config_error("--prompt", expected=f"space-separated token ids 0..{vocab_size - 1} (a {vocab_size}-token "
                         "vocabulary is not byte-level)", found=text, fix="pass e.g. --prompt '1 5 7 2'"):
        return [values.whole(word, maximum=vocab_size - 1) for word in text.split()]


def decode(tokens: list[int], vocab_size: int) -> str:
    """encode_prompt's inverse: text for a byte-level vocabulary, ids otherwise."""
    if vocab_size >= 256:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    return " ".join(map(str, tokens))


def sample(model: Transformer, prompt: list[int], *, tokens: int, top_k: int, seed: int = 0) -> list[int]:
    """The prompt and `tokens` more, each drawn among the `top_k` likeliest (1: greedy). The window is the
    last seq_len tokens, padded on the right to one fixed shape (one compilation; causal attention
    never sees the padding)."""
    n = model.cfg.seq_len
    if not 1 <= top_k <= model.cfg.vocab_size or tokens < 0:
        raise ConfigError("--top-k / --tokens", expected=f"1 <= top-k <= {model.cfg.vocab_size}, tokens >= 0",
                          found=(top_k, tokens), fix="pass --top-k 8 --tokens 32")

    graphdef, weights = nnx.split(model)

    @jax.jit
    def next_token(weights: nnx.State, window: jax.Array, length: jax.Array, key: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, weights)(window[None])[0, length - 1]
        top, index = jax.lax.top_k(logits, top_k)
        return index[jax.random.categorical(key, top)]

    out, key = list(prompt) or [1], jax.random.key(seed)  # an empty prompt starts from BOS
    for _ in range(tokens):
        window = out[-n:]
        key, draw = jax.random.split(key)
        padded = jnp.zeros(n, jnp.int32).at[:len(window)].set(jnp.asarray(window, jnp.int32))
        out.append(int(next_token(weights, padded, jnp.int32(len(window)), draw)))
    return out


def _flag_name(field: str) -> str:
    """The command-line flag of a ModelConfig field (tyro spells "_" as "-"; both parse)."""
    return "--model." + field.replace("_", "-")


def _alternatives(values: list[int]) -> str:
    """'2 or 4 or 8': the values a fix may name."""
    return " or ".join(str(v) for v in values)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _nearest(candidates: list[int], target: int, n: int = 2) -> list[int]:
    """The `n` candidates closest to `target`, in increasing order."""
    return sorted(sorted(candidates, key=lambda c: (abs(c - target), c))[:n])


def validate(cfg: ModelConfig, *, rule: str, model_axis: int) -> None:
    """Raise ConfigError for a config that cannot be built or sharded with `rule`.

    Call before building anything. The fsdp fit of "embed" on the data axis is
    left to the placement (`job.sharding.placement`), which knows the mesh.
    """
    for field in ("vocab_size", "seq_len", "dim", "heads", "layers", "mlp_dim"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise ConfigError(_flag_name(field), expected=f"a positive int <= {MAX_SIZE}", found=value,
                              fix=f"pass {_flag_name(field)} {getattr(ModelConfig, field)}")
    if cfg.dim % cfg.heads:
        raise ConfigError("--model.heads", expected=f"a divisor of --model.dim={cfg.dim}", found=cfg.heads,
                          fix=f"use --model.heads {_alternatives(_nearest(_divisors(cfg.dim), cfg.heads))}, "
                          f"or a --model.dim that is a multiple of {cfg.heads}")
    if not isinstance(cfg.scan, bool):
        raise ConfigError("--model.scan", expected="True or False", found=cfg.scan, fix="pass --model.scan or "
                          "--model.no-scan")
    rematerialize.check(cfg.remat, _flag_name("remat"))
    if cfg.attention not in self_attention.KERNELS:
        raise ConfigError("--model.attention", expected=f"one of {', '.join(self_attention.KERNELS)}",
                          found=cfg.attention, fix="pass --model.attention auto (the backend's fastest kernel)")
    if cfg.dtype not in DTYPES:
        raise ConfigError("--model.dtype", expected=f"one of {DTYPES}", found=cfg.dtype,
                          fix="pass --model.dtype float32 (or bfloat16 on GPU/TPU)")
    rule_table(rule)  # an unknown rule: its ConfigError
    if isinstance(model_axis, bool) or not isinstance(model_axis, int) or model_axis < 1:
        raise ConfigError("--model-axis", expected="a positive int", found=model_axis, fix="use --model-axis 1")
    if rule not in ("tensor", "fsdp_tensor") or model_axis == 1:
        return
    axis_ok = [d for d in _divisors(cfg.heads) if d > 1 and cfg.mlp_dim % d == 0 and cfg.vocab_size % d == 0]
    axis_fix = f"use --model-axis {_alternatives(axis_ok)}" if axis_ok else "use --model-axis 1"
    if cfg.heads % model_axis:
        heads_ok = _nearest([h for h in _divisors(cfg.dim) if h % model_axis == 0], cfg.heads)
        heads_fix = f", or --model.heads {_alternatives(heads_ok)}" if heads_ok else ""
        raise ConfigError("--model.heads",
                          expected=f"a multiple of --model-axis={model_axis} (rule {rule!r} splits heads)",
                          found=cfg.heads, fix=f"{axis_fix}{heads_fix}")
    for field in ("mlp_dim", "vocab_size"):
        value = getattr(cfg, field)
        if value % model_axis:
            up = -(-value // model_axis) * model_axis
            raise ConfigError(_flag_name(field),
                              expected=f"a multiple of --model-axis={model_axis} (rule {rule!r} splits it)",
                              found=value, fix=f"{axis_fix}, or {_flag_name(field)} {up}")


# REMAT_POLICIES, the policies by name, lives in job.kernels.rematerialize (POLICIES); the old name warns
__getattr__ = renamed.answer(__name__, {"REMAT_POLICIES": "job.kernels.rematerialize.POLICIES"})

__all__ = ["DTYPES", "ModelConfig", "Transformer", "decode", "encode_prompt", "loss_fn", "remat_name", "sample", "validate"]
