"""Deprecated: the old path of the attention kernels, now the library's `job.kernels` (any model calls them).

Importing this module warns once with a DeprecationWarning naming the new path.
"""

import warnings

from job.kernels.self_attention import (
    BLOCKS,
    KERNELS,
    PALLAS,
    RESIDUALS,
    Kernel,
    attend,
    attention,
    block_for,
    choose,
    platform,
)

warnings.warn("job.tasks.lm.attention is deprecated: import from job.kernels: call job.kernels.attention(q, k, v) "
              "(grouped kv heads and segment ids too; job.kernels.self_attention holds choose, Kernel and the rest)",
              DeprecationWarning, stacklevel=2)

__all__ = ["BLOCKS", "KERNELS", "PALLAS", "RESIDUALS", "Kernel", "attend", "attention", "block_for", "choose",
           "platform"]
