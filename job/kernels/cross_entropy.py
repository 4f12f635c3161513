"""The LM head and its cross-entropy in one pass, a chunk of positions at a time: logits exist for one
chunk only, never for the whole batch.

    loss_sum, correct = head_cross_entropy(h_bld, w_dv, targets_bl, weights_bl)

For GPT-2 small at batch 16 the whole batch's float32 logits are 16 x 1024 x 50,304 x 4 bytes = 3.3 GB,
and their gradient as much again. Here each chunk's logits are computed (in the compute dtype, as the
head's matmul gives them: bfloat16 for a bfloat16 model; every reduction in float32), reduced to the loss, and turned at once into the chunk's gradients with
respect to the hidden states and the head's kernel (softmax minus the one-hot target); the backward
pass only scales them. So the head's matmuls run once each way, as without chunks (no recompute), and
memory holds one chunk's logits plus the gradients' accumulators.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from job.parallel.sharding import constrain

CHUNK_BYTES = 256 * 2**20  # float32 logits of one chunk, summed over the batch (every device's share)
LOGITS = ("batch", "length", "vocab")


def chunk_length(batch: int, length: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions a chunk takes: the largest divisor of `length` whose [batch, chunk, vocab] float32 logits fit
    `chunk_bytes` (at least 1)."""
    most = max(1, chunk_bytes // (4 * batch * vocab))
    return max(d for d in range(1, min(most, length) + 1) if length % d == 0)


def head_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, weights: jax.Array, *,
                       chunk_bytes: int = CHUNK_BYTES) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted cross-entropies, weighted count of argmax hits) of logits h @ w, h [B, L, D] in the
    compute dtype, w [D, V] (float32 parameters, cast to h's dtype), targets int [B, L], weights [B, L];
    a chunk's logits take at most `chunk_bytes` (as float32)."""
    return _head_ce(h, w, targets, weights.astype(jnp.float32), chunk_bytes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _head_ce(h: jax.Array, w: jax.Array, targets: jax.Array, weights: jax.Array,
             chunk_bytes: int) -> tuple[jax.Array, jax.Array]:
    loss, correct, _, _ = _forward_and_gradients(h, w, targets, weights, chunk_bytes)
    return loss, correct


def _fwd(h: jax.Array, w: jax.Array, targets: jax.Array, weights: jax.Array, chunk_bytes: int) -> tuple[
        tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
    loss, correct, dh, dw = _forward_and_gradients(h, w, targets, weights, chunk_bytes)
    return (loss, correct), (dh, dw, targets, weights)


def _bwd(chunk_bytes: int, residuals: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
         cotangents: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, None, None]:
    dh, dw, targets, weights = residuals
    g = cotangents[0]  # the hit count is a metric: nothing flows back from it
    return (dh * g).astype(dh.dtype), dw * g, None, None


_head_ce.defvjp(_fwd, _bwd)


def _forward_and_gradients(h: jax.Array, w: jax.Array, targets: jax.Array, weights: jax.Array,
                           chunk_bytes: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(loss sum, hit count, d loss / d h, d loss / d w), one chunk of positions per scan iteration."""
    batch, length, _ = h.shape
    vocab = w.shape[1]
    c = chunk_length(batch, length, vocab, chunk_bytes)
    n = length // c
    kernel = w.astype(h.dtype)

    def chunks(x: jax.Array) -> jax.Array:  # [B, L, ...] -> [n, B, c, ...]
        return jnp.moveaxis(x.reshape(batch, n, c, *x.shape[2:]), 1, 0)

    def step(carry: tuple[jax.Array, jax.Array, jax.Array],
             chunk: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        loss, correct, dw = carry
        h_bcd, t_bc, m_bc = chunk
        # the chunk's logits in the compute dtype (as the head's matmul gives them), every reduction in float32
        logits = constrain(jnp.einsum("bcd,dv->bcv", h_bcd, kernel), LOGITS).astype(jnp.float32)
        top = logits.max(-1, keepdims=True)
        shifted = logits - jax.lax.stop_gradient(top)
        lse = jnp.log(jnp.exp(shifted).sum(-1))
        target = jnp.take_along_axis(shifted, t_bc[..., None], -1)[..., 0]
        loss = loss + ((lse - target) * m_bc).sum()
        correct = correct + ((logits.argmax(-1) == t_bc) * m_bc).sum()
        # d loss / d logits = (softmax - one hot) * weight, in the compute dtype for the two matmuls
        probs = jnp.exp(shifted - lse[..., None])
        dlogits = ((probs - jax.nn.one_hot(t_bc, vocab, dtype=jnp.float32)) * m_bc[..., None]).astype(h.dtype)
        dlogits = constrain(dlogits, LOGITS)
        dh = jnp.einsum("bcv,dv->bcd", dlogits, kernel, preferred_element_type=jnp.float32).astype(h.dtype)
        dw = dw + jnp.einsum("bcd,bcv->dv", h_bcd, dlogits, preferred_element_type=jnp.float32)
        return (loss, correct, dw), dh

    zero = jnp.zeros((), jnp.float32)
    (loss, correct, dw), dh = jax.lax.scan(step, (zero, zero, jnp.zeros(w.shape, jnp.float32)),
                                           (chunks(h), chunks(targets), chunks(weights)))
    dh = jnp.moveaxis(dh, 0, 1).reshape(h.shape)
    return loss, correct, dh, dw.astype(w.dtype)


__all__ = ["CHUNK_BYTES", "chunk_length", "head_cross_entropy"]
