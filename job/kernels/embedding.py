"""A token embedding's lookup laid out by the run's rules, for any model: what a model calls instead of its
`nnx.Embed`'s own call, so that the rows it looks up agree with the rest of its activations.

    x_bld = embed_tokens(self.embed, tokens_bl)    # what self.embed(tokens_bl) gives, split by rows

The table [vocab, width] is annotated ("vocab", "embed"), so a rule that splits "embed" over "data" (fsdp,
fsdp_tensor) stores its width split over the axis the activations' rows are split over. Looked up as stored,
the rows come out split in their width and whole in the batch, and the lookup's gradient (a scatter-add of
the rows' gradients into the table) asks for them so: XLA's partitioner finds no way to move rows split over
"data" to a width split over "data" while another mesh axis ("model") holds copies, and says it replicates
them whole on every device to get there ("Involuntary full rematerialization" in the compiler's log). Here the table is taken as
it is used, the way XLA takes a matmul's split weight: whole in its width (gathered over "data"), its
vocabulary split as the rules split "vocab"; the rows come out laid out as `rows_split` lays a block's input
(("batch", "length", "embed") for [B, L]: by rows, width whole), and the gradient goes back into the table
the same way, then to the table's own layout. Outside a mesh (a model called on its own) it is the plain
lookup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from job.core.errors import ConfigError
from job.kernels.rematerialize import rows_split
from job.parallel.sharding import constrain

TABLE = ("vocab", None)  # the table as a lookup uses it: its vocabulary split as the rules say, its width whole


def embed_tokens(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """The rows of `embed`'s table at the integer `tokens` [B, L] (any leading shape), in `embed`'s dtype:
    `embed(tokens)`, its table taken whole in its width and the rows [B, L, width] split by rows under the
    run's rules (module docstring)."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ConfigError("embed_tokens(tokens)", expected="integer token ids", found=f"dtype {tokens.dtype}",
                          fix="pass the token ids (e.g. tokens.astype(jnp.int32))")
    table = embed.embedding[...]
    if embed.dtype is not None:  # as nnx.Embed casts its table before the lookup
        table = table.astype(embed.dtype)
    return rows_split(jnp.take(constrain(table, TABLE), tokens, axis=0))


__all__ = ["TABLE", "embed_tokens"]
