"""Deprecated: the old path of the chunked head cross-entropy, now the library's `job.kernels`.

Importing this module warns once with a DeprecationWarning naming the new path.
"""

import warnings

from job.kernels.cross_entropy import CHUNK_BYTES, chunk_length, head_cross_entropy

warnings.warn("job.tasks.lm.cross_entropy is deprecated: import from job.kernels: call job.kernels.head_cross_entropy "
              "(chunk_length and CHUNK_BYTES are in job.kernels.cross_entropy)", DeprecationWarning, stacklevel=2)

__all__ = ["CHUNK_BYTES", "chunk_length", "head_cross_entropy"]
