"""job.runs.array_io: what the template's restore reads is bitwise what was saved, by the template or by plain orbax,
on any target sharding; plain orbax reads what the template writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from job.runs import array_io
from job.runs.checkpoint import Checkpointer, abstract
from job.runs.config import CheckpointConfig


def _mesh() -> jax.sharding.Mesh:
    assert jax.device_count() == 8, "needs 8 devices: tests/conftest.py sets XLA_FLAGS"
    return jax.make_mesh((4, 2), ("data", "model"))


def _placed(spec: dict[str, PartitionSpec]) -> dict[str, Any]:
    """Random float32, bfloat16 and int arrays and a PRNG key, placed by `spec` (per leaf name) on the 4 x 2 mesh."""
    mesh, rng = _mesh(), np.random.default_rng(0)
    values = {"w": rng.standard_normal((16, 8), dtype=np.float32),
              "h": rng.standard_normal((8, 4)).astype(jnp.bfloat16),
              "n": rng.integers(-2**31, 2**31 - 1, (4, 2), dtype=np.int32),
              "s": np.float32(rng.standard_normal())}
    state = {k: jax.device_put(v, NamedSharding(mesh, spec.get(k, PartitionSpec()))) for k, v in values.items()}
    state["key"] = jax.device_put(jax.random.split(jax.random.key(7), 8), NamedSharding(mesh, spec.get("key", PartitionSpec())))
    return state


REPLICATED: dict[str, PartitionSpec] = {}
SHARDED = {"w": PartitionSpec("data", "model"), "h": PartitionSpec(("data", "model")), "n": PartitionSpec("data"),
           "key": PartitionSpec("data")}
ELSEWHERE = {"w": PartitionSpec("model", "data"), "h": PartitionSpec(None, "model"), "n": PartitionSpec(None, "model"),
             "key": PartitionSpec("model")}


def _bits(x: Any) -> np.ndarray:
    """The array's bytes as unsigned integers (a PRNG key as its key data): equal bits, not merely equal values."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _assert_bitwise(back: dict, saved: dict, like: dict) -> None:
    assert set(back) == set(like)
    for name in like:
        assert back[name].dtype == saved[name].dtype, name
        np.testing.assert_array_equal(_bits(back[name]), _bits(saved[name]), err_msg=name)
        if isinstance(like[name], jax.Array):
            assert back[name].sharding.is_equivalent_to(like[name].sharding, back[name].ndim), name


@pytest.mark.parametrize(("saved", "target"), [(REPLICATED, REPLICATED), (SHARDED, SHARDED),
                                               (SHARDED, ELSEWHERE), (REPLICATED, SHARDED)],
                         ids=["replicated", "sharded", "sharded-to-another", "replicated-to-sharded"])
def test_the_template_restores_bitwise_what_it_saved_on_any_target_sharding(
        saved: dict, target: dict, tmp_path: Path) -> None:
    state, like = _placed(saved), _placed(target)
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=True))
    checkpoints.save(3, state)
    checkpoints.wait()
    _assert_bitwise(checkpoints.restore(3, like), state, like)
    checkpoints.close()


def test_a_partial_restore_reads_only_what_the_target_names(tmp_path: Path) -> None:
    state = _placed(SHARDED)
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False))
    checkpoints.save(1, state)
    like = {k: v for k, v in _placed(ELSEWHERE).items() if k in ("w", "key")}
    _assert_bitwise(checkpoints.restore(1, like, partial=True), state, like)
    checkpoints.close()


def _plain_restore(path: Path, like: dict) -> dict:
    target = abstract(like)
    with ocp.StandardCheckpointer() as plain:
        return plain.restore(path, target)


@pytest.mark.parametrize("compressed", [False, True], ids=["uncompressed", "zstd"])
def test_plain_orbax_and_the_template_read_each_others_checkpoints(compressed: bool, tmp_path: Path) -> None:
    state = _placed(SHARDED)
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False))
    checkpoints.save(2, state)
    elsewhere = _placed(ELSEWHERE)
    _assert_bitwise(_plain_restore(tmp_path / "ck" / "2" / "default", elsewhere), state, elsewhere)
    # orbax's own save, compressed (its default) or not, read by the template
    handler = ocp.PyTreeCheckpointHandler(use_compression=compressed)
    with ocp.CheckpointManager(tmp_path / "plain", item_handlers=handler,
                               options=ocp.CheckpointManagerOptions(create=True)) as plain:
        plain.save(4, args=ocp.args.PyTreeSave(state))
        plain.wait_until_finished()
    reader = Checkpointer(tmp_path / "plain", CheckpointConfig())
    like = _placed(ELSEWHERE)
    _assert_bitwise(reader.restore(4, like), state, like)
    reader.close()
    checkpoints.close()


def test_a_restore_to_a_shape_unlike_the_saved_one_says_what_to_do(tmp_path: Path) -> None:
    mesh = _mesh()
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False))
    checkpoints.save(1, {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, PartitionSpec()))})
    wider = {"w": jax.device_put(np.ones((8, 6), np.float32), NamedSharding(mesh, PartitionSpec()))}
    with pytest.raises(Exception, match=r"expected the stored shape \(8, 4\).*Fix:"):  # noqa: PT011 - orbax wraps it
        checkpoints.restore(1, wider)
    checkpoints.close()


def test_the_read_path_covers_sharded_arrays_and_leaves_keys_and_other_layouts_to_orbax() -> None:
    mesh = _mesh()
    rows = NamedSharding(mesh, PartitionSpec("data"))
    assert array_io.plan(ocp.ArrayRestoreArgs(sharding=rows)) == array_io.Read(rows, None)
    keys = array_io.plan(ocp.ArrayRestoreArgs(sharding=rows, global_shape=(8,), dtype=jax.random.key(0).dtype))
    assert keys == array_io.Read(rows, (8, 2), "threefry2x32")  # the key data's trailing dimension whole
    assert array_io.plan(ocp.ArrayRestoreArgs(sharding=rows, strict=False)) is None  # orbax's padding
    assert array_io.plan(ocp.ArrayRestoreArgs()) is None  # no sharding: orbax reads its file
    held = array_io.distinct_indices(NamedSharding(mesh, PartitionSpec("data")), (8, 2))
    assert len(held) == 4 and all(len(devices) == 2 for _, devices in held.values())  # each row block on 2 devices
