"""Tests for job.tasks.lm.model, the example transformer, on 8 fake CPU devices (see tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from job import sharding as sh  # noqa: E402
from job.errors import ConfigError  # noqa: E402
from job.tasks.lm import model as lm  # noqa: E402
from job.tasks.lm.model import (  # noqa: E402
    ModelConfig,
    Transformer,
    encode_prompt,
    loss_fn,
    remat_name,
    validate,
)
from job.train.state import count_params  # noqa: E402

def explicit_config(**fields: object) -> ModelConfig:
    """The example model's config with an explicit remat policy: these tests trace it outside the training loop,
    where `auto` (the loop's choice, made by compiling) is an error."""
    return ModelConfig(**{"remat": "none", **fields})  # type: ignore[arg-type]


# Compiled once per shape and reused: eager op-by-op dispatch would dominate the runtime.
forward = nnx.jit(Transformer.__call__)
jit_loss = nnx.jit(loss_fn)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(explicit_config(), rngs=nnx.Rngs(0))


def tokens(shape: tuple[int, int], seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, 32, dtype=jnp.int32)


def shard(node: object, mesh: Mesh, rule: str) -> list[str]:
    """shard_model, returning the messages of the UserWarnings it emitted."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sh.shard_model(node, mesh, rule)
    return [str(w.message) for w in rec if issubclass(w.category, UserWarning)]


# --- forward pass --------------------------------------------------------------------------

def test_output_shape_dtype_and_param_count(model: Transformer) -> None:
    logits = forward(model, tokens((2, 32)))
    assert logits.shape == (2, 32, 32) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    assert forward(model, tokens((3, 5))).shape == (3, 5, 32)  # shorter than seq_len
    # embed + positions + 2 x (2 norms + q/k/v/out + up/down) + final norm + head
    assert count_params(model) == 32 * 64 + 32 * 64 + 2 * (2 * 64 + 4 * 64 * 64 + 2 * 64 * 256) + 64 + 64 * 32
    assert count_params(model) == 104768
    with pytest.raises(ConfigError, match="at most seq_len=32"):
        forward(model, tokens((1, 33)))


def test_causal(model: Transformer) -> None:
    x = tokens((2, 16))
    base = forward(model, x)
    later = forward(model, x.at[:, 10].set((x[:, 10] + 1) % 32))
    np.testing.assert_allclose(later[:, :10], base[:, :10], atol=1e-6)
    assert float(jnp.abs(later[:, 10:] - base[:, 10:]).max()) > 1e-4
    earlier = forward(model, x.at[:, 2].set((x[:, 2] + 1) % 32))
    np.testing.assert_allclose(earlier[:, :2], base[:, :2], atol=1e-6)
    assert bool((jnp.abs(earlier[:, 2:] - base[:, 2:]).max(axis=-1) > 1e-5).all())  # every later position


def test_bfloat16_compute_float32_logits_and_params(model: Transformer) -> None:
    m = Transformer(explicit_config(dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(m, nnx.Param))} == {jnp.dtype("float32")}
    x = tokens((2, 17))
    logits = forward(m, x[:, :-1])
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    np.testing.assert_allclose(logits, forward(model, x[:, :-1]), atol=0.1)  # same params, less precision
    loss, _ = jit_loss(m, x, jnp.ones((2, 17)))
    np.testing.assert_allclose(loss, jit_loss(model, x, jnp.ones((2, 17)))[0], rtol=0.02)


# --- loss ----------------------------------------------------------------------------------

def test_loss_matches_hand_computation(model: Transformer) -> None:
    x = tokens((2, 17), seed=2)
    mask = jnp.asarray(np.random.default_rng(0).integers(0, 2, (2, 17)), jnp.float32).at[:, 1].set(1.0)
    loss, metrics = jit_loss(model, x, mask)

    logits = np.asarray(forward(model, x[:, :-1]), np.float64)
    targets, w = np.asarray(x[:, 1:]), np.asarray(mask[:, 1:])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    assert float(metrics["tokens"]) == w.sum()
    np.testing.assert_allclose(float(loss), (nll * w).sum() / w.sum(), rtol=1e-5)
    assert float(metrics["loss"]) == float(loss)
    acc = ((logits.argmax(-1) == targets) * w).sum() / w.sum()
    np.testing.assert_allclose(float(metrics["accuracy"]), acc, rtol=1e-6)
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0


def test_loss_of_perfect_prediction_is_near_zero() -> None:
    """Head weights that copy the input token make "repeat the token" predicted perfectly."""
    m = Transformer(explicit_config(), rngs=nnx.Rngs(1))
    # Blocks add nothing and positions are zero, so the final norm sees the one-hot token embedding.
    m.blocks.attn.out.kernel[...] = jnp.zeros_like(m.blocks.attn.out.kernel[...])  # every layer of the stack
    m.blocks.mlp.down.kernel[...] = jnp.zeros_like(m.blocks.mlp.down.kernel[...])
    m.embed.embedding[...] = jnp.eye(32, 64)
    m.pos[...] = jnp.zeros_like(m.pos[...])
    m.head.kernel[...] = 10.0 * jnp.eye(64, 32)
    x = jnp.tile(tokens((2, 1)), (1, 17))  # each row repeats one token
    loss, metrics = jit_loss(m, x, jnp.ones((2, 17)))
    assert float(loss) < 1e-3 and float(metrics["accuracy"]) == 1.0 and float(metrics["tokens"]) == 32.0


def test_zero_mask_gives_zero_loss_and_gradient(model: Transformer) -> None:
    x, zeros = tokens((2, 17)), jnp.zeros((2, 17))
    loss, metrics = jit_loss(model, x, zeros)
    assert float(loss) == 0.0 and float(metrics["accuracy"]) == 0.0 and float(metrics["tokens"]) == 0.0
    grads, _ = nnx.jit(nnx.grad(loss_fn, has_aux=True))(model, x, zeros)
    assert all(bool((g == 0).all()) for g in jax.tree.leaves(grads))


# --- sharding ------------------------------------------------------------------------------

def test_every_param_is_annotated_with_its_rank(model: Transformer) -> None:
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(params) == 12  # embed, pos, the 8 of the stacked blocks, the final norm, head
    for path, var in params:
        meta = var.get_metadata()
        names = meta.get("out_sharding")
        assert names is not None and len(names) == var.ndim, path
        assert set(names) <= set(sh.TRAIN_LOGICAL_AXES) | {sh.LAYERS_AXIS, None}, path
        assert meta["eager_sharding"] is False, path
        # the stacked blocks lead with the layers axis, the rest never has it
        assert (names[0] == sh.LAYERS_AXIS and var.shape[0] == 2) == (path[0] == "blocks"), path


EXPECTED = {  # the stacked blocks' leading "layers" dimension stays whole under every rule
    "replicated": {"embed/embedding": P(), "blocks/mlp/up/kernel": P(), "head/kernel": P()},
    "fsdp": {"embed/embedding": P(None, "data"), "pos": P(None, "data"),
             "blocks/attn/q/kernel": P(None, "data"), "blocks/attn/out/kernel": P(None, None, "data"),
             "blocks/mlp/down/kernel": P(None, None, "data"), "blocks/attn_norm/scale": P(None, "data"),
             "norm/scale": P("data"), "head/kernel": P("data")},
    "tensor": {"embed/embedding": P("model"), "pos": P(), "blocks/attn/k/kernel": P(None, None, "model"),
               "blocks/attn/out/kernel": P(None, "model"), "blocks/mlp/up/kernel": P(None, None, "model"),
               "blocks/mlp/down/kernel": P(None, "model"), "norm/scale": P(), "head/kernel": P(None, "model")},
}


@pytest.mark.parametrize("rule", ["replicated", "fsdp", "tensor"])
def test_shard_model_places_every_param_without_fallback(rule: str, mesh42: Mesh) -> None:
    m = Transformer(explicit_config(), rngs=nnx.Rngs(0))
    msgs = shard(m, mesh42, rule)
    assert not [msg for msg in msgs if "replicated instead" in msg or "fell back" in msg], msgs
    assert len(msgs) == (rule != "replicated") and all("experimental" in msg for msg in msgs)
    got = {k: s.spec for k, s in sh.sharding_of(m).items()}
    assert {k: got[k] for k in EXPECTED[rule]} == EXPECTED[rule]
    assert all(s.mesh == mesh42 for s in sh.sharding_of(m).values())
    assert forward(m, tokens((4, 8))).shape == (4, 8, 32)


def test_training_step_on_tensor_sharded_model_reduces_loss(mesh42: Mesh) -> None:
    m = Transformer(explicit_config(), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(m, optax.adamw(3e-3), wrt=nnx.Param)
    shard(m, mesh42, "tensor")
    shard(opt, mesh42, "tensor")
    batch = sh.shard_batch({"tokens": tokens((8, 33)), "mask": jnp.ones((8, 33))}, mesh42)

    @nnx.jit
    def step(m: Transformer, opt: nnx.Optimizer, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        grads, metrics = nnx.grad(loss_fn, has_aux=True)(m, batch["tokens"], batch["mask"])
        opt.update(m, grads)
        return metrics

    losses = [float(step(m, opt, batch)["loss"]) for _ in range(20)]
    assert 3.0 < losses[0] < 5.0, losses  # about ln(32) = 3.47 plus the spread of random logits
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(opt.step[...]) == 20
    assert sh.sharding_of(m)["blocks/mlp/up/kernel"].spec == P(None, None, "model")  # still sharded


# --- scanned and unrolled blocks, remat policies -----------------------------------------------

def unrolled_like(scanned: Transformer) -> Transformer:
    """The --model.no-scan model holding the same parameters: layer i of every stacked array."""
    m = Transformer(dataclasses.replace(scanned.cfg, scan=False), rngs=nnx.Rngs(9))
    stacked = dict(nnx.to_flat_state(nnx.state(scanned.blocks)))
    for i, block in enumerate(m.blocks):
        for path, var in nnx.to_flat_state(nnx.state(block)):
            var[...] = stacked[path][...][i]
    for name in ("embed", "norm", "head"):
        nnx.update(getattr(m, name), nnx.state(getattr(scanned, name)))
    m.pos[...] = scanned.pos[...]
    return m


def test_scanned_blocks_compute_what_the_unrolled_blocks_do() -> None:
    scanned = Transformer(explicit_config(layers=3), rngs=nnx.Rngs(0))
    unrolled = unrolled_like(scanned)
    assert count_params(unrolled) == count_params(scanned)
    x = tokens((2, 17), seed=3)
    np.testing.assert_allclose(forward(unrolled, x), forward(scanned, x), atol=2e-6)
    grads = {}
    for name, m in (("scanned", scanned), ("unrolled", unrolled)):
        g, _ = nnx.jit(nnx.grad(loss_fn, has_aux=True))(m, x, jnp.ones((2, 17)))
        grads[name] = g
    for layer in range(3):
        np.testing.assert_allclose(grads["unrolled"].blocks[layer].mlp.up.kernel[...],
                                   grads["scanned"].blocks.mlp.up.kernel[...][layer], atol=2e-6)


@pytest.mark.parametrize("scan", [True, False])
def test_every_remat_policy_gives_the_same_loss_and_gradient(scan: bool) -> None:
    x, mask = tokens((2, 17), seed=4), jnp.ones((2, 17))
    results = {}
    for remat in ("none", "full", "dots", "dots_all"):
        m = Transformer(explicit_config(scan=scan, remat=remat), rngs=nnx.Rngs(0))
        (loss, _), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(m, x, mask)
        results[remat] = (float(loss), jax.tree.leaves(grads))
    for remat, (loss, grads) in results.items():
        assert loss == pytest.approx(results["none"][0], rel=1e-6), remat
        for a, b in zip(grads, results["none"][1], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=remat)


def test_full_remat_keeps_less_for_the_backward_pass_than_none() -> None:
    """What the compiled gradient holds at once: XLA's own temporary-buffer figure for 8 scanned layers."""
    x, mask = tokens((8, 33), seed=5), jnp.ones((8, 33))
    temp = {}
    for remat in ("none", "full"):
        m = Transformer(explicit_config(layers=8, remat=remat), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        step = jax.jit(lambda s, graphdef=graphdef: jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), x, mask)[0])(s))
        temp[remat] = step.lower(state).compile().memory_analysis().temp_size_in_bytes
    assert temp["full"] < 0.6 * temp["none"], temp


def test_remat_reads_the_on_off_values_of_configs_saved_before_it_took_a_policy_name() -> None:
    assert remat_name(True) == "full" and remat_name(False) == "none" and remat_name("dots") == "dots"
    validate(ModelConfig(remat=True), rule="replicated", model_axis=1)  # type: ignore[arg-type]


# --- sequence parallelism -----------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh22() -> Mesh:
    """4 of the CPU devices as data 2 x sequence 2: each pair of sequence devices holds the same rows."""
    return sh.make_mesh(jax.devices()[:4], axes={"data": 2, "sequence": 2})


def traced_layouts(m: Transformer, x: jax.Array, mesh: Mesh,
                   monkeypatch: pytest.MonkeyPatch) -> dict[tuple, set[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """{logical names: (global shape, the shape each device holds) of every activation the model constrained
    by them}: a jitted forward under `mesh` and the replicated rule, each layout as XLA partitioned it
    (jax.debug.inspect_array_sharding)."""
    seen: dict[tuple, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    constrain = lm.constrain

    def recording(y: jax.Array, names: tuple) -> jax.Array:
        out = constrain(y, names)

        def held(where: jax.sharding.Sharding) -> None:
            seen.setdefault(tuple(names), set()).add((tuple(out.shape), tuple(where.shard_shape(out.shape))))

        jax.debug.inspect_array_sharding(out, callback=held)
        return out

    monkeypatch.setattr(lm, "constrain", recording)
    with sh.mesh_context(mesh, sh.rule_table("replicated")):
        nnx.jit(lambda m, x: m(x))(m, x)  # a new function: traced here, under the rules
    return seen


@pytest.mark.parametrize("scan", [True, False])
def test_split_along_the_sequence_each_device_holds_its_positions_and_attention_gathers_keys_and_values(
        scan: bool, mesh22: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    m = Transformer(explicit_config(scan=scan), rngs=nnx.Rngs(0))  # 64 wide, 4 heads of 16, mlp 256, 32 tokens
    assert traced_layouts(m, tokens((4, 32)), mesh22, monkeypatch) == {  # 2 rows of 4, 16 positions of 32
        lm.RESIDUAL: {((4, 32, 64), (2, 16, 64))},
        lm.QUERIES: {((4, 32, 4, 16), (2, 16, 4, 16))},
        lm.KEYS_VALUES: {((4, 32, 4, 16), (2, 32, 4, 16))},  # every position's keys and values
        lm.HIDDEN: {((4, 32, 256), (2, 16, 256))},
        lm.LOGITS: {((4, 32, 32), (2, 16, 32))},
    }


@pytest.mark.parametrize(("scan", "rule", "axes"), [
    (True, "replicated", {"data": 2, "sequence": 2}),
    (False, "replicated", {"data": 2, "sequence": 2}),
    (True, "fsdp", {"data": 2, "sequence": 2}),
    (True, "tensor", {"data": 1, "sequence": 2, "model": 2}),  # 4 heads: 2 per model device
])
def test_logits_and_loss_split_along_the_sequence_equal_those_of_the_whole_sequence(scan: bool, rule: str,
                                                                                   axes: dict[str, int]) -> None:
    m = Transformer(explicit_config(scan=scan), rngs=nnx.Rngs(0))
    x, mask = tokens((4, 33), seed=6), jnp.ones((4, 33))
    whole_logits, (whole_loss, _) = forward(m, x[:, :-1]), jit_loss(m, x, mask)
    mesh = sh.make_mesh(jax.devices()[:4], axes=axes)
    shard(m, mesh, rule)
    with sh.mesh_context(mesh, sh.rule_table(rule)):  # new functions: traced here, under the rules
        logits = nnx.jit(lambda m, x: m(x))(m, x[:, :-1])
        loss, _ = nnx.jit(lambda m, x, mask: loss_fn(m, x, mask))(m, x, mask)
    assert logits.sharding.spec[1] == "sequence"  # the logits too: each device its own positions
    np.testing.assert_allclose(logits, whole_logits, rtol=1e-5, atol=1e-5)
    assert float(loss) == pytest.approx(float(whole_loss), rel=1e-5)


def test_a_length_the_sequence_axis_does_not_divide_is_one_error_naming_the_seq_len_to_pass(mesh22: Mesh) -> None:
    m = Transformer(explicit_config(), rngs=nnx.Rngs(0))
    with sh.mesh_context(mesh22, sh.rule_table("replicated")), pytest.raises(ConfigError) as e:
        nnx.jit(lambda m, x, mask: loss_fn(m, x, mask))(m, tokens((4, 32)), jnp.ones((4, 32)))  # 31 predicted
    assert str(e.value).startswith("sequence length: expected a multiple of the mesh's 'sequence' axis of size 2")
    assert "found 31. Fix: pass --model.seq-len 32" in str(e.value)


def test_a_gradient_split_four_ways_along_the_sequence_keeps_under_0_4_of_one_devices_temporaries() -> None:
    """XLA's own temporary-buffer figure per device: every activation is a quarter as long, the keys and
    values whole (measured: 0.29 at 128 positions)."""
    m = Transformer(explicit_config(seq_len=129), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    x, mask = tokens((4, 129), seed=7), jnp.ones((4, 129))
    temp = {}
    for parts in (1, 4):
        grad = jax.jit(lambda s: jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), x, mask)[0])(s))
        mesh = sh.make_mesh(jax.devices()[:parts], axes={"sequence": parts})
        with sh.mesh_context(mesh, sh.rule_table("replicated")):
            temp[parts] = grad.lower(state).compile().memory_analysis().temp_size_in_bytes
    assert temp[4] < 0.4 * temp[1], temp


# --- validate ------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, rule, model_axis", [
    (ModelConfig(), "replicated", 1),
    (ModelConfig(), "fsdp", 8),
    (ModelConfig(), "tensor", 2),
    (ModelConfig(), "tensor", 4),
    (ModelConfig(heads=3, dim=48, mlp_dim=96), "tensor", 1),
    (ModelConfig(vocab_size=256, dtype="bfloat16"), "tensor", 2),
])
def test_validate_accepts_good_configs(cfg: ModelConfig, rule: str, model_axis: int) -> None:
    validate(cfg, rule=rule, model_axis=model_axis)


@pytest.mark.parametrize("cfg, rule, model_axis, expected", [
    (ModelConfig(dim=60, heads=8), "replicated", 1, ["--model.heads", "found 8", "--model.dim=60", "--model.heads"]),
    (ModelConfig(layers=0), "replicated", 1, ["--model.layers", "found 0", "positive", "--model.layers 2"]),
    (ModelConfig(vocab_size=-1), "replicated", 1, ["--model.vocab-size", "found -1", "--model.vocab-size 32"]),
    (ModelConfig(mlp_dim=0), "fsdp", 1, ["--model.mlp-dim", "found 0"]),
    (ModelConfig(dtype="float16"), "replicated", 1, ["--model.dtype", "'float16'", "bfloat16"]),
    (ModelConfig(heads=2), "tensor", 4, ["--model.heads", "found 2", "--model-axis=4", "--model-axis 2",
                                         "--model.heads 4 or 8"]),
    (ModelConfig(heads=1), "tensor", 2, ["--model.heads", "found 1", "--model-axis=2", "--model-axis 1"]),
    (ModelConfig(mlp_dim=255), "tensor", 2, ["--model.mlp-dim", "found 255", "--model-axis=2", "--model.mlp-dim 256"]),
    (ModelConfig(vocab_size=257), "tensor", 2, ["--model.vocab-size", "found 257", "--model.vocab-size 258"]),
    (ModelConfig(), "zero3", 1, ["--rule", "'zero3'"]),
    (ModelConfig(), "tensor", 0, ["--model-axis", "found 0"]),
    (ModelConfig(remat="some"), "replicated", 1, ["--model.remat", "'some'", "none, full, dots, dots_all"]),
    (ModelConfig(scan="yes"), "replicated", 1, ["--model.scan", "'yes'", "--model.no-scan"]),
])
def test_validate_rejects_bad_configs(cfg: ModelConfig, rule: str, model_axis: int, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        validate(cfg, rule=rule, model_axis=model_axis)
    msg = str(e.value)
    assert "Fix:" in msg
    for part in expected:
        assert part in msg, (part, msg)


def test_transformer_validates_before_building() -> None:
    with pytest.raises(ConfigError, match="--model.heads"):
        Transformer(explicit_config(dim=60, heads=8), rngs=nnx.Rngs(0))


def test_a_prompt_of_a_small_vocabulary_is_plain_token_ids_and_anything_else_one_error() -> None:
    assert encode_prompt("1 5  7 2", 32) == [1, 5, 7, 2]
    assert encode_prompt("hé", 256) == [104, 195, 169]  # byte-level: its UTF-8 bytes
    for bad in ("1 32", "1 -2", "1 +2", "1 2_0", "1 \u0662", "one"):
        with pytest.raises(ConfigError, match=r"--prompt: expected space-separated token ids 0\.\.31"):
            encode_prompt(bad, 32)
