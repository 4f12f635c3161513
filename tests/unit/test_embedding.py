"""`job.kernels.embed_tokens`: an nnx.Embed's own lookup outside a mesh, and under a rule that splits the
table's width over "data" the rows laid out by rows, with the lookup's values and gradients unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import job.errors
from job import kernels
from job import sharding as sh


def _embed(dtype: str = "float32") -> nnx.Embed:
    with nnx.use_eager_sharding(False):
        return nnx.Embed(32, 16, dtype=jnp.dtype(dtype), embedding_metadata=sh.axes("vocab", "embed"),
                         rngs=nnx.Rngs(0))


TOKENS = jnp.arange(8 * 12, dtype=jnp.int32).reshape(8, 12) % 32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outside_a_mesh_it_is_the_layers_own_call(dtype: str) -> None:
    embed = _embed(dtype)
    found = kernels.embed_tokens(embed, TOKENS)
    assert found.dtype == jnp.dtype(dtype) and found.shape == (8, 12, 16)
    np.testing.assert_array_equal(np.asarray(found, np.float32), np.asarray(embed(TOKENS), np.float32))


def test_under_fsdp_tensor_the_rows_come_out_split_by_rows_with_the_same_values_and_gradients() -> None:
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    embed = _embed()
    graphdef, state = nnx.split(embed)
    placed, fallbacks = sh.placement(state, mesh, "fsdp_tensor")
    assert fallbacks == [] and placed["embedding"].spec == P("model", "data")  # the width over "data", as stored
    tokens = jax.device_put(TOKENS, sh.batch_sharding(mesh))

    def total(state: nnx.State, lookup: object) -> jax.Array:
        return (lookup(nnx.merge(graphdef, state), tokens) ** 2).sum()  # type: ignore[operator]

    expected = jax.value_and_grad(total)(state, lambda e, t: e(t))  # no mesh: the plain lookup
    with sh.mesh_context(mesh, sh.rule_table("fsdp_tensor")):
        rows = jax.jit(kernels.embed_tokens).lower(embed, tokens).compile().output_shardings
        loss, grads = jax.jit(jax.value_and_grad(total), static_argnums=1, out_shardings=(None, placed))(
            jax.device_put(state, placed), kernels.embed_tokens)
    assert rows.spec in (P("data"), P("data", None, None)), rows  # by rows, the width whole
    np.testing.assert_allclose(float(loss), float(expected[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["embedding"][...]), np.asarray(expected[1]["embedding"][...]),
                               rtol=1e-6)


def test_tokens_that_are_not_integers_are_refused_with_the_fix() -> None:
    with pytest.raises(job.errors.ConfigError, match="expected integer token ids, found 'dtype float32'"):
        kernels.embed_tokens(_embed(), TOKENS.astype(jnp.float32))
