"""The example LM's attention kernels, its chunked head cross-entropy and remat's automatic choice, on CPU:
the TPU kernel (splash) through Pallas' interpret mode against XLA's attention, alone and split over a
(data, sequence) mesh; the loss and its gradients against optax's cross-entropy of whole logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from job import sharding as sh
from job.errors import ConfigError
from job.tasks.lm import attention, cross_entropy, model, remat

SMALL = dict(vocab_size=64, seq_len=128, dim=32, heads=2, layers=2, mlp_dim=64)
# splash in interpret mode against XLA, float32 (measured: 0 on the loss, 9e-8 on the gradients)
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5


def _batch(rows: int = 4, length: int = SMALL["seq_len"] + 1, vocab: int = SMALL["vocab_size"]) -> tuple:
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, vocab, (rows, length)), jnp.int32)
    return tokens, jnp.ones((rows, length), jnp.float32)


def loss_and_grads(kernel: str, **sizes: int) -> tuple[jax.Array, nnx.State]:
    """The lm loss and its gradients with attention `kernel`, the model SMALL with `sizes` changed (the
    TPU tier's test runs it on the chip)."""
    cfg = model.ModelConfig(**{**SMALL, **sizes}, attention=kernel)
    m = model.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens, mask = _batch(length=cfg.seq_len + 1, vocab=cfg.vocab_size)
    (loss, _), grads = nnx.value_and_grad(lambda m: model.loss_fn(m, tokens, mask), has_aux=True)(m)
    return loss, grads


@pytest.mark.parametrize(("requested", "platform", "length", "dtype", "expected"), [
    ("auto", "tpu", 1024, "bfloat16", attention.Kernel("splash", 512)),
    ("auto", "tpu", 384, "bfloat16", attention.Kernel("splash", 128)),
    ("auto", "tpu", 1023, "bfloat16", attention.Kernel("xla")),  # no tile divides it
    ("auto", "gpu", 1024, "bfloat16", attention.Kernel("cudnn")),
    ("auto", "gpu", 1024, "float32", attention.Kernel("xla")),  # cuDNN takes bf16/fp16
    ("auto", "cpu", 1024, "bfloat16", attention.Kernel("xla")),
    ("splash", "cpu", 256, "float32", attention.Kernel("splash", 256, interpret=True)),
    ("flash", "tpu", 1024, "bfloat16", attention.Kernel("flash", 512)),
    ("xla", "tpu", 1024, "bfloat16", attention.Kernel("xla")),
])
def test_each_backend_gets_its_kernel_and_auto_falls_back_where_no_tile_divides(
        requested: str, platform: str, length: int, dtype: str, expected: attention.Kernel) -> None:
    assert attention.choose(requested, length=length, dtype=dtype, on=platform) == expected


def test_a_sequence_split_too_fine_for_a_tile_names_the_whole_seq_len_that_fits() -> None:
    with pytest.raises(ConfigError, match="pass --model.seq-len 256, or --model.attention xla"):
        attention.choose("splash", length=64, on="tpu", shards=2)


@pytest.mark.parametrize(("requested", "platform", "length", "says"), [
    ("splash", "tpu", 1023, "pass --model.seq-len 1024"),
    ("flash", "cpu", 1024, "flash on a TPU"),
    ("cudnn", "tpu", 1024, "cudnn on a GPU"),
    ("ring", "tpu", 1024, "one of auto, xla, splash, flash, cudnn"),
])
def test_a_kernel_that_cannot_run_is_one_error_naming_the_fix(requested: str, platform: str, length: int,
                                                               says: str) -> None:
    with pytest.raises(ConfigError) as e:
        attention.choose(requested, length=length, on=platform)
    assert str(e.value).startswith("--model.attention: expected") and says in str(e.value)


def test_an_unknown_attention_flag_is_refused_before_the_model_is_built() -> None:
    with pytest.raises(ConfigError, match="--model.attention"):
        model.validate(model.ModelConfig(attention="splsh"), rule="replicated", model_axis=1)


def test_splash_in_interpret_mode_gives_xlas_loss_and_gradients() -> None:
    loss_x, grads_x = loss_and_grads("xla")
    loss_s, grads_s = loss_and_grads("splash")
    assert abs(float(loss_s - loss_x)) < LOSS_TOL
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), grads_x, grads_s)))
    assert 0 <= worst < GRAD_TOL


@pytest.mark.parametrize("kernel", ["xla", "splash"])
def test_under_a_data_by_sequence_mesh_each_kernel_gives_the_unsplit_loss(kernel: str) -> None:
    """splash runs in shard_map per device block; each sequence shard masks from its own offset."""
    mesh = jax.make_mesh((2, 2), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    m = model.Transformer(model.ModelConfig(**{**SMALL, "seq_len": 256}, attention=kernel), rngs=nnx.Rngs(0))
    tokens, mask = _batch(length=257)  # 128 positions a sequence shard: splash's smallest tile
    whole = float(model.loss_fn(m, tokens, mask)[0])
    with sh.mesh_context(mesh, sh.rule_table("replicated")):
        split = float(nnx.jit(lambda m, x, y: model.loss_fn(m, x, y)[0])(m, tokens, mask))
    assert abs(split - whole) < LOSS_TOL


@pytest.mark.parametrize("chunk_bytes", [cross_entropy.CHUNK_BYTES, 4 * 4 * 8 * 64])  # one chunk; 16 chunks of 8
def test_the_chunked_head_loss_equals_optax_on_whole_logits_with_its_gradients(chunk_bytes: int) -> None:
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(4, 128, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 64)) * 0.1, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 64, (4, 128)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, (4, 128)), jnp.float32)  # some positions not targets

    def ours(h: jax.Array, w: jax.Array) -> jax.Array:
        return cross_entropy.head_cross_entropy(h, w, targets, weights, chunk_bytes=chunk_bytes)[0]

    def theirs(h: jax.Array, w: jax.Array) -> jax.Array:
        return (optax.softmax_cross_entropy_with_integer_labels(h @ w, targets) * weights).sum()

    assert cross_entropy.chunk_length(4, 128, 64, chunk_bytes) == (128 if chunk_bytes > 2**20 else 8)
    np.testing.assert_allclose(ours(h, w), theirs(h, w), rtol=1e-5)
    for mine, reference in zip(jax.grad(ours, (0, 1))(h, w), jax.grad(theirs, (0, 1))(h, w)):
        np.testing.assert_allclose(mine, reference, atol=1e-5)
    hits = cross_entropy.head_cross_entropy(h, w, targets, weights, chunk_bytes=chunk_bytes)[1]
    assert float(hits) == float((((h @ w).argmax(-1) == targets) * weights).sum())


def test_a_gpt2_small_chunk_holds_at_most_256_mib_of_logits_not_the_batchs_3_gib() -> None:
    c = cross_entropy.chunk_length(16, 1024, 50304)
    assert 1024 % c == 0 and 16 * c * 50304 * 4 <= 256 * 2**20 < 16 * 2 * c * 50304 * 4


GPT2_SMALL = model.ModelConfig(vocab_size=50304, seq_len=1024, dim=768, heads=12, layers=12, mlp_dim=3072,
                               dtype="bfloat16")
M400 = dataclasses.replace(GPT2_SMALL, dim=1024, heads=16, layers=24, mlp_dim=4096)


@pytest.mark.parametrize(("cfg", "rows", "expected"), [
    # measured on a v5e chip: none needs 16.08 GiB at batch 16 (does not fit), dots fits; the 406M model's
    # dots needs 16.11 GiB at batch 16
    (GPT2_SMALL, 16, "dots"), (GPT2_SMALL, 2, "none"), (M400, 16, "full"),
])
def test_remat_auto_picks_what_fits_a_v5e_chip(monkeypatch: pytest.MonkeyPatch, cfg: model.ModelConfig,
                                               rows: int, expected: str) -> None:
    monkeypatch.setattr(attention, "platform", lambda: "tpu")
    monkeypatch.setattr(remat, "device_memory", lambda: remat.HBM["TPU v5 lite"])
    assert remat.resolve(cfg, rows=rows, length=1024) == expected
    assert remat.resolve(dataclasses.replace(cfg, remat="full"), rows=rows, length=1024) == "full"  # asked: kept


def test_remat_auto_keeps_everything_on_cpu() -> None:
    assert remat.resolve(GPT2_SMALL, rows=16, length=1024) == "none"
    assert remat.parameters(GPT2_SMALL) == 163_007_232


def test_the_kernel_is_said_once_for_an_unrolled_stack_traced_for_train_and_eval(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = model.ModelConfig(**{**SMALL, "layers": 3, "seq_len": 72}, scan=False, attention="xla")  # a shape of its own
    m = model.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens, mask = _batch(length=cfg.seq_len + 1)
    with caplog.at_level("INFO", logger=attention.log.name):
        jax.jit(lambda t, w: model.loss_fn(m, t, w)[0]).lower(tokens, mask)  # the train step's trace
        jax.jit(lambda t, w: model.loss_fn(m, t, w)[0] * 2).lower(tokens, mask)  # and eval's
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention: ")]
    assert said == ["attention: xla for queries (4, 72, 2, 16)"]
