"""How pytree leaves are named and told apart in messages and checks.

    path_str(("blocks", 0, "mlp", "kernel"))   # "blocks/0/mlp/kernel"
    is_array(np.zeros(3)), is_array(np.float32(1.0))                   # True, False
    is_array(np.float32(1.0), scalars=True)                            # True
    leaf_specs({"w": jnp.zeros((2, 3))})                                # {"w": ((2, 3), "float32")}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def path_str(keys: Sequence[Any]) -> str:
    """A leaf's path as "a/b/0": jax key paths and NNX state paths alike; "<root>" for the empty path."""
    return jax.tree_util.keystr(tuple(keys), simple=True, separator="/") or "<root>"


def leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{"model/blocks/0/attn/q/kernel/value": (shape, dtype)} for every array-like leaf of `tree`
    (a train state, or the tree metadata orbax keeps of a saved one)."""
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            # a typed rng key is saved as its key data (uint32[..., 2] for threefry): compare it as such
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype))
            shape, dtype = data.shape, data.dtype
        specs[path_str(path)] = (tuple(shape), str(dtype if dtype is not None else ""))
    return specs


def is_array(leaf: object, *, scalars: bool = False) -> bool:
    """True for a jax.Array or a NumPy array (the leaves sharding places); with `scalars`, NumPy scalars
    too (every leaf with a shape and dtype, as the cross-host pytree checks compare them)."""
    kinds = (jax.Array, np.ndarray, np.generic) if scalars else (jax.Array, np.ndarray)
    return isinstance(leaf, kinds)
