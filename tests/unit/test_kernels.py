"""The library's kernels (job.kernels), on CPU: the TPU kernel (splash) through Pallas' interpret mode against
XLA's attention, with as many kv heads as query heads, grouped and one, with segment ids, padded up to a
tile, alone and split over (data, sequence) and (data, model) meshes; the chunked head cross-entropy and its
gradients against optax's cross-entropy of whole logits; remat by name, and `auto` chosen by compiling."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from job import sharding as sh
from job.errors import ConfigError
from job.kernels import cross_entropy
from job.kernels import rematerialize as remat
from job.kernels import self_attention as attention
from job.tasks.lm import model
from job.train import remat_auto
from job.runtime.device_memory import Need

# remat none: traced outside the training loop, the model needs an explicit policy (`auto` there is an error)
SMALL = dict(vocab_size=64, seq_len=128, dim=32, heads=2, layers=2, mlp_dim=64, remat="none")
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
    ("auto", "tpu", 1023, "bfloat16", attention.Kernel("splash", 512, padded=1024)),  # no tile divides it: padded
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


def test_a_length_no_tile_divides_is_padded_for_splash_anywhere_but_refused_when_split() -> None:
    assert attention.choose("splash", length=1000, on="tpu") == attention.Kernel("splash", 512, padded=1024)
    assert attention.choose("auto", length=200, on="tpu", shards=2) == attention.Kernel("xla")


def test_a_sequence_split_too_fine_for_a_tile_names_the_whole_seq_len_that_fits() -> None:
    with pytest.raises(ConfigError, match="pass --model.seq-len 256, or --model.attention xla"):
        attention.choose("splash", length=64, on="tpu", shards=2, flag="--model.attention",
                         length_flag="--model.seq-len")
    with pytest.raises(ConfigError, match="pass sequences of 256 positions, or kernel='xla'"):
        attention.choose("splash", length=64, on="tpu", shards=2)  # no flags: the arguments, the length


@pytest.mark.parametrize(("requested", "platform", "length", "says"), [
    ("flash", "cpu", 1024, "flash on a TPU"),
    ("cudnn", "tpu", 1024, "cudnn on a GPU"),
    ("ring", "tpu", 1024, "one of auto, xla, splash, flash, cudnn"),
])
def test_a_kernel_that_cannot_run_is_one_error_naming_the_fix(requested: str, platform: str, length: int,
                                                               says: str) -> None:
    with pytest.raises(ConfigError) as e:
        attention.choose(requested, length=length, on=platform, flag="--model.attention")
    assert str(e.value).startswith("--model.attention: expected") and says in str(e.value)
    with pytest.raises(ConfigError) as e:
        attention.choose(requested, length=length, on=platform)  # the caller named no flag: the argument
    assert str(e.value).startswith("kernel: expected") and says in str(e.value) and "kernel='" in str(e.value)
    assert "--" not in str(e.value)


def test_the_example_lm_names_its_own_flags_in_the_kernels_errors() -> None:
    m = model.Transformer(model.ModelConfig(**{**SMALL, "seq_len": 128}, attention="flash"), rngs=nnx.Rngs(0))
    tokens, mask = _batch()
    with pytest.raises(ConfigError) as e:
        model.loss_fn(m, tokens, mask)  # flash on a CPU: the kernel refuses it while the model is traced
    assert str(e.value).startswith("--model.attention: expected flash on a TPU")
    assert "pass --model.attention splash" in str(e.value)
    m.cfg = dataclasses.replace(m.cfg, remat="dot")  # past validate: the kernel's own check names the flag
    with pytest.raises(ConfigError, match="--model.remat: expected one of none"):
        model.loss_fn(m, tokens, mask)


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


def _qkv(heads: int, kv_heads: int, length: int = 256, rows: int = 2, dim: int = 16, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(rows, length, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, length, kv_heads, dim)), jnp.float32) for _ in range(2))
    return q, k, v


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    """Causal attention with every kv head repeated to the queries', by hand, in float32."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("blhd,bmhd->bhlm", q, k) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    allowed = jnp.tril(jnp.ones((length, length), bool))[None, None]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhlm,bmhd->blhd", weights, v)


@pytest.mark.parametrize("kernel", ["xla", "splash"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (12, 4), (4, 1)])
def test_attention_with_grouped_kv_heads_equals_repeating_them_by_hand(kernel: str, heads: int, kv_heads: int) -> None:
    q, k, v = _qkv(heads, kv_heads)
    np.testing.assert_allclose(attention.attention(q, k, v, kernel=kernel), _reference(q, k, v), atol=1e-6)


@pytest.mark.parametrize("kernel", ["xla", "splash"])
def test_segment_ids_keep_each_packed_row_and_its_padding_to_itself(kernel: str) -> None:
    q, k, v = _qkv(4, 2)
    segments = jnp.asarray(np.repeat([[1, 2, 3, 0]], 64, axis=1).reshape(1, -1).repeat(2, 0), jnp.int32)
    got = attention.attention(q, k, v, segment_ids=segments, kernel=kernel)
    np.testing.assert_allclose(got, _reference(q, k, v, segments), atol=1e-6)
    alone = attention.attention(q[:, 64:128], k[:, 64:128], v[:, 64:128], kernel="xla")  # segment 2 by itself
    np.testing.assert_allclose(got[:, 64:128], alone, atol=1e-6)


def test_splash_pads_a_length_no_tile_divides_and_gives_the_unpadded_result() -> None:
    q, k, v = _qkv(4, 2, length=200)
    np.testing.assert_allclose(attention.attention(q, k, v, kernel="splash"), _reference(q, k, v), atol=1e-6)


@pytest.mark.parametrize(("rule", "axes"), [("replicated", ("data", "sequence")), ("fsdp", ("data", "sequence")),
                                            ("tensor", ("data", "model")), ("fsdp_tensor", ("data", "model"))])
def test_splash_in_shard_map_equals_xla_with_grouped_heads_under_every_rule(rule: str, axes: tuple) -> None:
    """12 query heads over 4 kv heads, the rows split over data, the queries over sequence or the heads over
    model (2 kv heads a device); one kv head over model=2 is repeated to 2, one a device."""
    mesh = jax.make_mesh((2, 2), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4])
    for heads, kv_heads in ((12, 4), (4, 1)):
        q, k, v = _qkv(heads, kv_heads)
        expected = _reference(q, k, v)
        with sh.mesh_context(mesh, sh.rule_table(rule)):
            for kernel in ("splash", "xla"):
                got = jax.jit(lambda q, k, v: attention.attention(q, k, v, kernel=kernel))(q, k, v)
                np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"{kernel} {heads}/{kv_heads}")


@pytest.mark.parametrize("kernel", ["auto", "xla", "splash"])  # auto on a CPU: XLA's jax.nn.dot_product_attention
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_names_its_own_output_for_remat_dots_on_every_path(kernel: str, kv_heads: int) -> None:
    """A user's model that calls job.kernels.attention gets its output kept under `dots` without naming it."""
    q, k, v = _qkv(4, kv_heads, length=128)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention.attention(q, k, v, kernel=kernel))(q, k, v))
    assert re.search(rf"f32\[2,128,4,16\] = name\[name={attention.RESIDUALS}\]", jaxpr), jaxpr[-400:]


def test_attention_refuses_shapes_it_cannot_take_naming_them() -> None:
    q, k, v = _qkv(4, 3)
    with pytest.raises(ConfigError, match="kv_heads dividing the query heads"):
        attention.attention(q, k, v)
    q, k, v = _qkv(4, 2)
    with pytest.raises(ConfigError, match=r"segment_ids \[B, L\]"):
        attention.attention(q, k, v, segment_ids=jnp.zeros((2, 5), jnp.int32))


def test_remat_by_name_gives_the_same_gradients_and_refuses_an_unknown_name() -> None:
    cfg = model.ModelConfig(**SMALL)
    tokens, mask = _batch()
    grads = {}
    for policy in ("none", "dots", "full", "auto"):
        m = model.Transformer(dataclasses.replace(cfg, remat=policy), rngs=nnx.Rngs(0))
        with remat.choosing("dots"):  # what auto stands for here
            grads[policy] = nnx.grad(lambda m: model.loss_fn(m, tokens, mask)[0])(m)
    for policy in ("dots", "full", "auto"):
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy])):
            np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(ConfigError, match="--model.remat: expected one of none, full, dots, dots_all, auto"):
        remat.remat(lambda block, x: x, "dot", flag="--model.remat")
    with pytest.raises(ConfigError, match="policy: expected one of none, .*Fix: pass policy='auto'"):
        remat.remat(lambda block, x: x, "dot")  # the caller named no flag: the argument
    assert remat.name(True) == "full" and remat.name(False) == "none"


def _block_jaxpr(policy: str) -> str:
    """The jaxpr of a gradient through one block under remat(`policy`)."""
    graphdef, weights = nnx.split(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    call = remat.remat(lambda block, x: jnp.tanh(block(x)), policy)
    loss = lambda w, x: call(nnx.merge(graphdef, w), x).sum()  # noqa: E731
    return str(jax.make_jaxpr(jax.grad(loss))(weights, jnp.ones((2, 8))))


def test_remat_auto_traced_outside_a_choice_is_one_error_and_inside_one_runs_that_policy() -> None:
    with pytest.raises(ConfigError) as e:
        _block_jaxpr("auto")
    said = str(e.value)
    assert said.startswith("remat policy: expected an explicit policy") and "found 'auto, with no policy" in said
    assert "chosen by the training loop" in said and "job.kernels.rematerialize.choosing(policy)" in said
    with remat.choosing("dots"):
        assert remat.resolve("auto") == "dots" and remat.resolve("full") == "full"
        chosen = _block_jaxpr("auto")
    assert "remat2[" in chosen and "policy=<function save_from_both_policies" in chosen  # dots' policy
    assert chosen == _block_jaxpr("dots")  # the trace an explicit dots gives
    assert chosen != _block_jaxpr("full") and "remat2[" not in _block_jaxpr("none")
    with pytest.raises(ConfigError):
        remat.resolve("auto")  # the choice ends with its context


GIB = 2**30


def _compiles(needs: dict[str, float | None], texts: dict[str, str] | None = None) -> tuple[list[str], object]:
    """A stand-in for compiling the step under each policy: GiB needed (None: XLA's out-of-memory); each program's
    text is read (named "read:POLICY" in the list) only where a later candidate is compared with it."""
    asked: list[str] = []

    def compile_under(policy: str) -> tuple[str, Need, object]:
        asked.append(policy)
        gib = needs[policy]
        need = (Need(False, None, 16 * GIB, "RESOURCE_EXHAUSTED") if gib is None
                else Need(True, int(gib * GIB), 16 * GIB, program=int(gib * GIB) // 2))

        def text() -> str:
            asked.append(f"read:{policy}")
            return (texts or {}).get(policy, policy)

        return f"step-{policy}", need, text

    return asked, compile_under


TWO = ["none", "dots", "read:none", "read:dots"]  # two compiles, the second's program compared with the first's
THREE = [*TWO, "full", "read:full"]


@pytest.mark.parametrize(("needs", "chosen", "asked"), [
    ({"none": 10, "dots": 6, "full": 3}, "none", ["none"]),  # fits as it is: one compile, its text never read
    ({"none": None, "dots": 9, "full": 3}, "dots", TWO),  # XLA's out-of-memory, then dots
    ({"none": 15, "dots": 9, "full": 3}, "dots", TWO),  # over 90% of the 16 GiB, then dots
    ({"none": 15, "dots": 15, "full": 3}, "full", THREE),
])
def test_remat_auto_takes_the_first_policy_whose_compiled_step_fits_the_device_alone(
        needs: dict, chosen: str, asked: list) -> None:
    called, compile_under = _compiles(needs)
    choice = remat_auto.choose(compile_under, limit=16 * GIB)
    assert (choice.policy, choice.step, choice.fits, called) == (chosen, f"step-{chosen}", True, asked)
    assert choice.line().startswith(f"remat auto: {chosen} ({needs[chosen]:.2f} GiB per device of 16.00 GiB")
    assert choice.remembered is None and choice.program() == remat_auto.program_of(chosen)


def _remembered(policy: str, program: str | None) -> remat_auto.Remembered:
    return remat_auto.Remembered(policy, None if program is None else remat_auto.program_of(program),
                                 "an earlier run in /runs/a")


def test_an_earlier_runs_choice_is_compiled_first_and_taken_in_one_compile_where_it_fits_as_remembered() -> None:
    called, compile_under = _compiles({"none": None, "dots": 9, "full": 3})
    choice = remat_auto.choose(compile_under, limit=16 * GIB, first=_remembered("dots", "dots"))
    assert (choice.policy, choice.remembered, called) == ("dots", _remembered("dots", "dots"), ["dots", "read:dots"])
    assert choice.line() == ("remat auto: dots (remembered from an earlier run in /runs/a, compiled once; "
                             "9.00 GiB per device of 16.00 GiB)")
    called, compile_under = _compiles({"none": None, "dots": 9, "full": 3})  # a record without its program's digest
    assert remat_auto.choose(compile_under, limit=16 * GIB, first=_remembered("dots", None)).policy == "dots"
    assert called == ["dots"]


def test_an_earlier_choice_is_only_an_order_the_compile_checks_the_fit_and_a_changed_program_tries_faster_ones(
        ) -> None:
    called, compile_under = _compiles({"none": 15, "dots": 15, "full": 3})  # remembered dots no longer fits
    choice = remat_auto.choose(compile_under, limit=16 * GIB, first=_remembered("dots", "dots"))
    assert (choice.policy, choice.remembered) == ("full", None)
    assert called == ["dots", "none", "read:dots", "read:none", "full", "read:full"]
    called, compile_under = _compiles({"none": 10, "dots": 9, "full": 3})  # full remembered, the model changed since
    choice = remat_auto.choose(compile_under, limit=16 * GIB, first=_remembered("full", "full before"))
    assert (choice.policy, choice.remembered, called) == ("none", None, ["full", "read:full", "none", "read:none"])
    called, compile_under = _compiles({"none": 15, "dots": 9, "full": 3})  # dots remembered, changed, none too big
    choice = remat_auto.choose(compile_under, limit=16 * GIB, first=_remembered("dots", "dots before"))
    assert (choice.policy, choice.remembered, called) == ("dots", None, ["dots", "read:dots", "none", "read:none"])
    called, compile_under = _compiles({"none": 10, "dots": 9, "full": 3})
    assert remat_auto.choose(compile_under, limit=16 * GIB, first=_remembered("bogus", None)).policy == "none"
    assert called == ["none"]


def test_remat_auto_compiles_once_where_memory_is_unknown_or_the_model_does_not_read_it() -> None:
    called, compile_under = _compiles({"none": 100, "dots": 1, "full": 1})
    choice = remat_auto.choose(compile_under, limit=None)  # a CPU
    assert (choice.policy, called) == ("none", ["none"])
    assert choice.line().startswith("remat auto: none (")  # said for the first candidate too
    called, compile_under = _compiles({"none": None, "dots": None, "full": None},
                                      {p: "same" for p in ("none", "dots", "full")})
    choice = remat_auto.choose(compile_under, limit=16 * GIB)
    assert (choice.fits, called) == (False, TWO)  # dots compiled to none's program: no further try
    # over the share but compiled by XLA, with no policy to choose from: that program runs (the chip's memory edge)
    called, compile_under = _compiles({"none": 15.5, "dots": 15.5, "full": 15.5},
                                      {p: "same" for p in ("none", "dots", "full")})
    choice = remat_auto.choose(compile_under, limit=16 * GIB)
    assert (choice.policy, choice.fits, called) == ("none", True, TWO)
    assert choice.line().startswith("remat auto: none (15.50 GiB per device of 16.00 GiB")


def test_the_kernel_is_said_once_for_an_unrolled_stack_traced_for_train_and_eval(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = model.ModelConfig(**{**SMALL, "layers": 3, "seq_len": 72}, scan=False, attention="xla")  # a shape of its own
    m = model.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens, mask = _batch(length=cfg.seq_len + 1)
    with caplog.at_level("INFO", logger=attention.log.name):
        jax.jit(lambda t, w: model.loss_fn(m, t, w)[0]).lower(tokens, mask)  # the train step's trace
        jax.jit(lambda t, w: model.loss_fn(m, t, w)[0] * 2).lower(tokens, mask)  # and eval's
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention: ")]
    assert said == ["attention: xla for queries (4, 72, 2, 16), 2 kv heads"]
