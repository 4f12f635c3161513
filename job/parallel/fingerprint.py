"""A fingerprint of a pytree of arrays that never gathers them onto one host.

    from job.parallel.fingerprint import fingerprint
    fingerprint(nnx.state(model, nnx.Param))   # '3f1c...' (64 hex digits)

Each leaf is reduced where it lives, on its own devices, to four 32-bit sums
over its elements' bits, each element weighted by a hash of its position.
Integer addition modulo 2**32 is exact in any order, so the result does not
depend on how the leaf is sharded or on how many processes hold it
(1x4 = 4x1 = 2x2), and only the four sums per leaf cross the network. The
string is the sha256 of every leaf's path, dtype, shape and sums.

Any change to one element changes every sum (its weights are odd, so the
difference never vanishes modulo 2**32); reordering elements changes them with
the odds of a 128-bit hash. Positions beyond 2**32 elements in one leaf reuse
the weights of earlier ones.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SEEDS = (0x9E3779B9, 0x7F4A7C15, 0x85EBCA6B)


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The leaf's bits as uint32 words (narrower types widened, wider ones split)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = x.dtype.itemsize * 8
    if bits >= 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


@jax.jit
def _sums(x: jax.Array) -> jax.Array:
    words = _words(x)
    weight = _mix(jax.lax.iota(jnp.uint32, words.size).reshape(words.shape) ^ jnp.uint32(_SEEDS[0]))
    odd = [weight | jnp.uint32(1), (weight * jnp.uint32(_SEEDS[1])) | jnp.uint32(1)]
    linear = [jnp.sum(words * w, dtype=jnp.uint32) for w in odd]
    mixed = [jnp.sum(_mix(words ^ weight), dtype=jnp.uint32),
             jnp.sum(_mix(words + jnp.uint32(_SEEDS[2])) * odd[0], dtype=jnp.uint32)]
    return jnp.stack(linear + mixed)


def leaf_sums(x: Any) -> np.ndarray:
    """The four uint32 sums of one array (a jax.Array anywhere, or a NumPy array)."""
    out = _sums(x)
    # replicated on every device of the leaf: read this process's copy, never a gather
    return np.asarray(out.addressable_data(0))


def fingerprint(tree: Any) -> str:
    """sha256 hex digest of every array leaf's path, dtype, shape and position-weighted sums."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            continue
        digest.update(f"{jax.tree_util.keystr(path)}|{np.dtype(leaf.dtype)}|{tuple(leaf.shape)}|".encode())
        digest.update(leaf_sums(leaf).astype("<u4").tobytes())
    return digest.hexdigest()


__all__ = ["fingerprint", "leaf_sums"]
