"""Deprecated: the old path of the per-row random helpers, kept so that a fork's `import job.batches` works.

`row_bits`, `below` and `uniform` are public at `job.random`; the loop's batching (`Prefetch`,
`global_batch`, `row_span`, `to_global`) lives in `job.train.batches`. Importing this module
warns once with a DeprecationWarning naming the new path (docs/api.md: what a fork may import).
"""

import warnings

from job.train.batches import Prefetch, global_batch, row_span, to_global
from job.train.random import below, row_bits, uniform

warnings.warn("job.batches is deprecated: import row_bits, below and uniform from job.random (the loop's "
              "Prefetch, global_batch, row_span and to_global are in job.train.batches); docs/api.md lists "
              "what a fork may import", DeprecationWarning, stacklevel=2)

__all__ = ["Prefetch", "below", "global_batch", "row_bits", "row_span", "to_global", "uniform"]
