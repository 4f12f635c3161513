"""Deprecated: the old path of the remat policies, now the library's `job.kernels` (any model calls them).
`auto` is chosen by compiling the step (the training loop), no longer estimated from the example's shapes.

Importing this module warns once with a DeprecationWarning naming the new path.
"""

import warnings

from job.kernels.rematerialize import POLICIES, name, resolve

warnings.warn("job.tasks.lm.remat is deprecated: import from job.kernels: wrap a block's call in "
              "job.kernels.remat(call, policy) (job.kernels.rematerialize holds POLICIES, name and resolve)",
              DeprecationWarning, stacklevel=2)

__all__ = ["POLICIES", "name", "resolve"]
