"""job.parallel.fingerprint: equal for equal values however they are sharded, different for any changed element."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from job.parallel import fingerprint as fp


def _mix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def reference_sums(x: np.ndarray) -> np.ndarray:
    """The same four sums in NumPy on the host: the definition the device code must follow."""
    words = x.view(np.uint32).ravel()
    seeds = [np.uint32(s) for s in fp._SEEDS]
    with np.errstate(over="ignore"):
        weight = _mix(np.arange(words.size, dtype=np.uint32) ^ seeds[0])
        odd = [weight | np.uint32(1), (weight * seeds[1]) | np.uint32(1)]
        linear = [np.sum(words * w, dtype=np.uint32) for w in odd]
        mixed = [np.sum(_mix(words ^ weight), dtype=np.uint32),
                 np.sum(_mix(words + seeds[2]) * odd[0], dtype=np.uint32)]
    return np.array(linear + mixed, dtype=np.uint32)


@pytest.fixture(scope="module")
def params() -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(7), 3)
    return {"embed": jax.random.normal(keys[0], (64, 48)), "bias": jax.random.normal(keys[1], (48,)),
            "scale": jax.random.normal(keys[2], (8, 6, 10)).astype(jnp.bfloat16)}


def test_device_sums_follow_the_host_definition(params: dict[str, jax.Array]) -> None:
    for name in ("embed", "bias"):
        np.testing.assert_array_equal(fp.leaf_sums(params[name]), reference_sums(np.asarray(params[name])))


@pytest.mark.parametrize("spec", [P(), P("data"), P("data", "model"), P("model", "data"), P(None, ("data", "model"))])
def test_equal_values_give_one_fingerprint_however_they_are_sharded(
        params: dict[str, jax.Array], mesh42: jax.sharding.Mesh, spec: P) -> None:
    on_one_device = fp.fingerprint(params)
    sharded = {"embed": jax.device_put(params["embed"], NamedSharding(mesh42, spec)),
               "bias": jax.device_put(params["bias"], NamedSharding(mesh42, P(spec[0]) if spec else P())),
               "scale": jax.device_put(params["scale"], NamedSharding(mesh42, P("data")))}
    assert fp.fingerprint(sharded) == on_one_device


@pytest.mark.parametrize("index", [(0, 0), (3, 5), (63, 47), (31, 0)])
def test_one_ulp_anywhere_changes_the_fingerprint(params: dict[str, jax.Array], index: tuple[int, int]) -> None:
    before = fp.fingerprint(params)
    nudged = params["embed"].at[index].set(jnp.nextafter(params["embed"][index], jnp.float32(np.inf)))
    assert fp.fingerprint({**params, "embed": nudged}) != before
    assert all(a != b for a, b in zip(fp.leaf_sums(nudged), fp.leaf_sums(params["embed"]))), "every sum moves"


def test_swapping_two_elements_changes_the_fingerprint(params: dict[str, jax.Array]) -> None:
    x = params["bias"]
    swapped = x.at[0].set(x[1]).at[1].set(x[0])
    assert fp.fingerprint({"b": swapped}) != fp.fingerprint({"b": x})


def test_paths_dtypes_and_shapes_take_part(params: dict[str, jax.Array]) -> None:
    x = params["bias"]
    base = fp.fingerprint({"b": x})
    assert fp.fingerprint({"c": x}) != base
    assert fp.fingerprint({"b": x.reshape(6, 8)}) != base
    assert fp.fingerprint({"b": jax.lax.bitcast_convert_type(x, jnp.int32)}) != base


def test_narrow_and_boolean_leaves_are_fingerprinted(params: dict[str, jax.Array]) -> None:
    scale = params["scale"]
    nudged = scale.at[1, 2, 3].set(jnp.nextafter(scale[1, 2, 3], jnp.bfloat16(np.inf)))
    assert fp.fingerprint({"s": nudged}) != fp.fingerprint({"s": scale})
    flags = jnp.array([True, False, True])
    assert fp.fingerprint({"f": flags}) != fp.fingerprint({"f": ~flags})
    assert fp.fingerprint({"i": jnp.arange(5, dtype=jnp.int8)}) != fp.fingerprint({"i": jnp.arange(5, dtype=jnp.int16)})


def test_nothing_is_gathered(params: dict[str, jax.Array], mesh42: jax.sharding.Mesh,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    from jax.experimental import multihost_utils

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("fingerprint must not gather leaves")

    sharded = jax.device_put(params["embed"], NamedSharding(mesh42, P("data", "model")))
    expected = fp.fingerprint({"w": params["embed"]})
    monkeypatch.setattr(multihost_utils, "process_allgather", refuse)
    monkeypatch.setattr(jax, "device_get", refuse)
    assert fp.fingerprint({"w": sharded}) == expected
