"""The randomness a task's rows are drawn from: words that are a pure function of (seed, split, step, row).

The public face of `job.train.random` (where the code and its documentation live): import it
from here, `from job.random import below, row_bits, uniform`; the library itself imports
`job.train.random`.
"""

from job.train.random import below, row_bits, uniform

__all__ = ["below", "row_bits", "uniform"]
