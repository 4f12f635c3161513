"""The kernels a model calls to be fast on a TPU (and right everywhere else): attention with grouped kv
heads, remat by policy name, a cross-entropy against the output kernel that never holds whole float32
logits, and a token embedding's lookup whose rows agree with the rest of the activations under every rule.
The example LM calls exactly these; a model in any package calls them the same way (docs/api.md,
docs/your-model.md's "Fast on a TPU").

    from job import kernels

    y = kernels.attention(q_blhd, k_blkd, v_blkd)                   # splash on a TPU, XLA elsewhere
    block_fn = kernels.remat(call, "auto")                           # call(block, x) under the loop's choice
    loss_sum, hits = kernels.head_cross_entropy(h_bld, w_dv, targets_bl, weights_bl)
    x_bld = kernels.embed_tokens(embed, tokens_bl)                  # embed(tokens), split by rows
"""

from job.kernels.self_attention import KERNELS, Kernel, attention, choose
from job.kernels.cross_entropy import head_cross_entropy
from job.kernels.embedding import embed_tokens
from job.kernels.rematerialize import NAMES as REMAT_POLICIES
from job.kernels.rematerialize import remat

__all__ = ["KERNELS", "REMAT_POLICIES", "Kernel", "attention", "choose", "embed_tokens", "head_cross_entropy",
           "remat"]
