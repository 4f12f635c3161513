"""docs/your-model.md: every python block of the page run as the page shows it, and what the page says of
each checked against what it does (8 CPU devices, tests/conftest.py; the blocks use 4 of them)."""

from __future__ import annotations

import dataclasses
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from job import sharding
from job.errors import ConfigError
from job.parallel.trees import leaf_specs
from job.runs.resume import state_differences
from job.task import Task
from job.train import config
from job.train.batches import to_global
from job.train.evaluation import Evaluator
from job.parallel.sharding import check_global_batch
from tests.docs_examples import DOCS, code_blocks

PAGE = "your-model.md"
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# a text only one block holds, for each block of the page, in the page's order
BLOCKS = ("class Sums", "def noisy_rows", "class MLP", "def conv(", "class Net", "class Indexed", "def stream(",
          "class TinyLM")


def _page_block(marker: str) -> dict[str, Any]:
    """Run the one block of the page that holds `marker` in a namespace of its own; that namespace."""
    blocks = code_blocks(PAGE)
    found = [i for i, block in enumerate(blocks) if marker in block]
    assert len(found) == 1, f"docs/{PAGE}: expected one python block holding {marker!r}, found {len(found)}"
    namespace: dict[str, Any] = {"__name__": f"your_model_block_{found[0]}"}
    # dont_inherit: the block runs as a file of its own would, without this module's __future__ imports
    exec(compile(blocks[found[0]], f"docs/{PAGE} block {found[0]}", "exec", dont_inherit=True), namespace)
    return namespace


def _example_ids(rows: dict[str, np.ndarray]) -> list[int]:
    """The examples a batch of the page's tables holds (row i of "image" is full of i)."""
    return rows["image"][:, 0].astype(int).tolist()


@dataclasses.dataclass(frozen=True)
class _NoModel:
    """A model config with one field: the data config is what these tests parse."""

    width: int = 1


def _sums_task(page: dict[str, Any]) -> Task:
    """A task whose data config and rows are the page's first block's."""
    return Task(name="sums", model_config=_NoModel, data_config=page["DataConfig"], build=lambda cfg, rngs: None,
                loss=lambda model, rows: (0.0, {}), source=lambda data_cfg, model_cfg: page["Sums"](data_cfg))


def test_every_python_block_of_the_page_is_run_by_a_test_below() -> None:
    blocks = code_blocks(PAGE)
    owners = [[marker for marker in BLOCKS if marker in block] for block in blocks]
    assert owners == [[marker] for marker in BLOCKS], owners


def test_the_data_config_s_fields_are_data_flags_and_rows_a_dict_of_float32_arrays_of_stop_minus_start_rows() -> None:
    page = _page_block("class Sums")
    data_config, source = page["DataConfig"], page["source"]
    batch = page["batch"]
    assert {name: (a.shape, a.dtype) for name, a in batch.items()} == {
        "x": ((32, 8), np.float32), "y": ((32,), np.float32)}
    np.testing.assert_array_equal(source.rows("train", 0, 8, 16)["x"], batch["x"][8:16])
    np.testing.assert_array_equal(source.rows("train", 0, 0, 32)["x"], batch["x"])  # the same call, the same rows
    assert not np.array_equal(source.rows("train", 1, 0, 32)["x"], batch["x"])
    task = _sums_task(page)
    assert config.defaults(task).data == data_config()
    cfg = config.parse(["--data.global-batch", "64", "--data.features", "4", "--data.seed", "3"], task)
    assert cfg.data == data_config(global_batch=64, eval_batches=2, features=4, seed=3)
    assert config.from_dict(config.to_dict(cfg), task) == cfg  # what config.json holds comes back
    with pytest.raises(ConfigError, match="--data.features"):
        data_config(features=0)


def test_the_loop_reads_global_batch_against_devices_and_accumulation_and_eval_batches_0_evaluates_nothing() -> None:
    page = _page_block("class Sums")
    task = _sums_task(page)
    with pytest.raises(ConfigError, match="--accum-steps"):
        config.validate(config.parse(["--accum-steps", "3"], task), task)  # 32 rows in 3 micro-batches
    mesh = sharding.make_mesh()  # 8 data-parallel devices
    check_global_batch(16, 2, mesh)
    with pytest.raises(ConfigError, match="--data.global-batch"):
        check_global_batch(12, 1, mesh)

    class Finite:
        def split_size(self, split: str) -> int:
            return 20

    planned = {batches: Evaluator(lambda *a: None, Finite(), mesh, splits=("eval", "test"), global_batch=8,
                                  batches=batches, full=True, weight=None).plan for batches in (0, 2)}
    assert planned[0] == {} and set(planned[2]) == {"eval", "test"}


def test_64_bit_rows_arrive_on_the_devices_as_32_bit_arrays() -> None:
    mesh = sharding.make_mesh()
    rows = {"label": np.arange(8, dtype=np.int64), "x": np.ones((8, 2), np.float64)}
    placed = to_global(rows, sharding.batch_sharding(mesh), 8)
    assert {name: a.dtype for name, a in placed.items()} == {"label": jnp.int32, "x": jnp.float32}


def test_a_rows_random_words_are_the_same_whatever_rows_are_asked_for_beside_it() -> None:
    page = _page_block("def noisy_rows")
    noisy_rows, whole = page["noisy_rows"], page["whole"]
    pieces = [noisy_rows(0, "train", 5, a, b) for a, b in ((0, 3), (3, 17), (17, 32))]
    for name in whole:
        np.testing.assert_array_equal(np.concatenate([piece[name] for piece in pieces]), whole[name])
    assert {name: a.dtype for name, a in whole.items()} == {"label": np.int32, "flip": bool, "noise": np.float32}
    assert not np.array_equal(noisy_rows(0, "train", 6, 0, 32)["noise"], whole["noise"])  # another step
    assert not np.array_equal(noisy_rows(0, "eval", 5, 0, 32)["noise"], whole["noise"])  # another split
    many = noisy_rows(0, "test", 0, 0, 20_000)
    assert set(np.unique(many["label"])) == set(range(10))
    assert abs(many["flip"].mean() - 0.5) < 0.02
    assert abs(many["noise"].mean()) < 0.02 and abs(many["noise"].std() - 1) < 0.02  # standard normal
    bits = page["row_bits"](0, 0, 5, 2, 7, 3)
    assert bits.dtype == np.uint64 and bits.shape == (5, 3)
    assert page["below"](bits, 4).dtype == np.int64 and page["uniform"](bits).dtype == np.float64


def test_a_model_annotated_with_with_partitioning_fails_outside_the_loop_and_is_placed_as_the_page_shows() -> None:
    page = _page_block("class MLP")
    mlp, mesh, model = page["MLP"], page["mesh"], page["model"]
    with pytest.raises(ValueError, match="An auto mesh context or metadata is required"):
        mlp(nnx.Rngs(0))
    with pytest.raises(ValueError, match="Resource axis: embed"), jax.set_mesh(mesh):
        mlp(nnx.Rngs(0))
    assert dict(mesh.shape) == {"data": 2, "model": 2} and page["fallbacks"] == []
    specs = {path: where.spec for path, where in sharding.sharding_of(model).items()}
    assert specs == {"up/kernel": P("data", "model"), "up/bias": P("model"), "down/kernel": P("model", "data"),
                     "down/bias": P("data")}
    assert {shard.data.shape for shard in model.up.kernel[...].addressable_shards} == {(8, 32)}
    whole = page["whole"]
    assert sharding.sharding_of(whole)["up/kernel"].spec == P("data")  # fsdp: "embed" over data, "mlp" whole
    built_whole = dict(nnx.to_flat_state(nnx.state(whole)))
    for path, value in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(built_whole[path][...]))
    assert {shard.data.shape for shard in page["x"].addressable_shards} == {(4, 16)}  # 8 rows over data 2
    assert page["y"].shape == (8, 16)
    np.testing.assert_allclose(np.asarray(page["y"]), np.asarray(whole(jnp.ones((8, 16)))), rtol=1e-5, atol=1e-6)


def test_the_project_s_own_annotations_build_outside_the_loop_without_eager_sharding_turned_off() -> None:
    init = nnx.initializers.lecun_normal()
    by_init = nnx.Linear(16, 64, kernel_init=sharding.partitioned(init, ("embed", "mlp")), rngs=nnx.Rngs(0))
    by_metadata = nnx.Linear(16, 64, kernel_metadata=sharding.axes("embed", "mlp"), rngs=nnx.Rngs(0))
    for layer in (by_init, by_metadata):
        assert layer.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


def _conv_table() -> dict[str, tuple[str, tuple[int, ...]]]:
    """The page's conv table: {rule: (the kernel's spec, what each device holds)}."""
    text = (DOCS / PAGE).read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(P\([^`]*\))`[^|]*\| `\(([\d, ]+)\)` \|$", text, re.M)
    return {rule: (spec, tuple(int(n) for n in shape.split(","))) for rule, spec, shape in rows}


def test_a_conv_kernel_is_split_by_each_rule_as_the_page_s_table_says() -> None:
    assert jax.device_count() >= 4, "needs 4 devices: tests/conftest.py sets XLA_FLAGS"
    page = _page_block("def conv(")
    conv, mesh, abstract = page["conv"], page["mesh"], page["abstract_state"]
    table = _conv_table()
    assert set(table) == {"replicated", "fsdp", "tensor", "fsdp_tensor"}
    for rule, (spec, held) in table.items():
        shardings, fallbacks = sharding.placement(abstract, mesh, rule)
        assert fallbacks == [] and str(shardings["kernel"].spec) == spec, rule
        assert shardings["kernel"].shard_shape((3, 3, 16, 32)) == held, rule
    layer = page["layer"]
    assert {shard.data.shape for shard in layer.kernel[...].addressable_shards} == {table["fsdp_tensor"][1]}
    assert layer.bias[...].sharding.spec == P("model")
    assert layer(jnp.ones((2, 5, 5, 16))).shape == (2, 5, 5, 32)
    one_axis = sharding.make_mesh(jax.devices()[:4], model_axis=1)  # --model-axis 1: every device on data
    assert sharding.placement(abstract, one_axis, "fsdp")[0]["kernel"].shard_shape((3, 3, 16, 32)) == (3, 3, 4, 32)


def test_a_channel_count_the_mesh_does_not_divide_leaves_the_kernel_whole_and_is_named() -> None:
    def rgb(names: tuple[str | None, ...]) -> nnx.Conv:
        return nnx.Conv(3, 32, kernel_size=(3, 3), rngs=nnx.Rngs(0),
                        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names))

    mesh = sharding.make_mesh(jax.devices()[:4], model_axis=2)
    with nnx.use_eager_sharding(False):
        shardings, fallbacks = sharding.placement(nnx.state(rgb((None, None, "embed", "mlp"))), mesh, "fsdp_tensor")
        assert shardings["kernel"].spec == P() and [line for line in fallbacks if "kernel" in line]
        shardings, fallbacks = sharding.placement(nnx.state(rgb((None, None, None, "mlp"))), mesh, "fsdp_tensor")
        assert shardings["kernel"].spec == P(None, None, None, "model")


def _dtypes(node: Any, kind: type = nnx.Param) -> set[Any]:
    return {value[...].dtype for _, value in nnx.to_flat_state(nnx.state(node, kind))}


def test_bfloat16_compute_keeps_float32_parameters_gradients_moments_and_logits() -> None:
    page = _page_block("class Net")
    model, optimizer = page["model"], page["optimizer"]
    assert _dtypes(model) == {F32}
    assert page["logits"].dtype == jnp.float32 and page["logits"].shape == (4, 10)
    assert model.head(jnp.ones((4, 64))).dtype == jnp.bfloat16  # the layer computes in bfloat16
    assert {g[...].dtype for _, g in nnx.to_flat_state(page["grads"])} == {F32}
    moments = {v[...].dtype for path, v in nnx.to_flat_state(nnx.state(optimizer, nnx.OptState))
               if "mu" in path or "nu" in path}
    assert moments == {F32}
    lowered = nnx.Linear(16, 64, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    moments = {v[...].dtype for path, v in nnx.to_flat_state(nnx.state(
        nnx.Optimizer(lowered, optax.adamw(1e-3), wrt=nnx.Param), nnx.OptState)) if "mu" in path or "nu" in path}
    assert moments == {BF16}  # no float32 master copy: the moments follow the parameters


def test_another_compute_dtype_is_the_same_state_and_another_param_dtype_is_another() -> None:
    page = _page_block("class Net")
    net, model_config = page["Net"], page["ModelConfig"]
    as_bf16 = leaf_specs(nnx.state(net(model_config("bfloat16"), rngs=nnx.Rngs(0))))
    assert state_differences(as_bf16, leaf_specs(nnx.state(net(model_config("float32"), rngs=nnx.Rngs(0))))) == []
    lowered = nnx.state(nnx.Linear(16, 64, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    kept = nnx.state(nnx.Linear(16, 64, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    assert state_differences(leaf_specs(kept), leaf_specs(lowered))


def test_indexed_rows_are_pure_tile_the_batch_and_read_every_example_once_an_epoch() -> None:
    page = _page_block("class Indexed")
    indexed, data_config, source = page["Indexed"], page["DataConfig"], page["source"]
    batch = page["batch"]
    fresh = indexed(data_config(), source.splits)  # nothing cached: the same rows
    for name in batch:
        np.testing.assert_array_equal(fresh.rows("train", 3, 0, 32)[name], batch[name])
        np.testing.assert_array_equal(source.rows("train", 3, 0, 32)[name], batch[name])
        tiles = [source.rows("train", 3, a, b)[name] for a, b in ((0, 5), (5, 17), (17, 31), (31, 32))]
        np.testing.assert_array_equal(np.concatenate(tiles), batch[name])
    assert batch["image"].dtype == np.float32 and batch["label"].dtype == np.int32
    np.testing.assert_array_equal(batch["label"], batch["image"][:, 0].astype(np.int32) % 10)
    stream = [i for step in range(5) for i in _example_ids(source.rows("train", step, 0, 32))]  # places 0..159
    epochs = stream[:80], stream[80:160]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(80))
    assert epochs[0] != epochs[1] and epochs[0] != list(range(80))
    assert _example_ids(batch) == [int(source.order(g // 80)[g % 80]) for g in range(96, 128)]
    other_seed = indexed(data_config(seed=1), source.splits)
    assert _example_ids(other_seed.rows("train", 0, 0, 32)) != _example_ids(source.rows("train", 0, 0, 32))
    assert source.split_size("train") is None and source.split_size("eval") == 20
    assert _example_ids(source.rows("eval", 0, 0, 20)) == list(range(80, 100))


def test_a_materialized_stream_is_indexed_like_the_table_it_was_read_from() -> None:
    stream = _page_block("def stream(")
    try:
        assert all(isinstance(array, np.memmap) for array in stream["table"].values())
        page = _page_block("class Indexed")
        from_files = page["Indexed"](page["DataConfig"](), stream["splits"])
        for step in range(4):
            rows, expected = from_files.rows("train", step, 0, 32), page["source"].rows("train", step, 0, 32)
            assert {name: a.dtype for name, a in rows.items()} == {"image": np.float32, "label": np.int32}
            for name in expected:
                np.testing.assert_array_equal(rows[name], expected[name])
        assert from_files.split_size("eval") == 20
    finally:
        shutil.rmtree(stream["folder"])


def test_a_model_split_into_features_and_its_head_gets_the_whole_logits_loss_and_gradients_from_the_fused_one(
        ) -> None:
    page = _page_block("class TinyLM")
    model, batch = page["model"], page["batch"]
    fused = nnx.grad(lambda m: page["loss"](m, batch)[0])(model)
    whole = nnx.grad(lambda m: page["whole_logits_loss"](m, batch))(model)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert page["model"](batch["tokens"]).shape == (4, 9, 64)  # __call__ still gives the logits
    tied = page["kernels"].head_cross_entropy(model.features(batch["tokens"][:, :-1]),
                                              model.embed.embedding[...].T, batch["tokens"][:, 1:],
                                              jnp.ones((4, 8), jnp.float32))[0]  # a tied head's kernel, as said
    logits = model.features(batch["tokens"][:, :-1]) @ model.embed.embedding[...].T
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).sum()
    np.testing.assert_allclose(tied, expected, rtol=1e-5)
