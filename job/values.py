"""Deprecated: the old path of `job.core.values`, kept so that a task copied from the example's
`from job import values` works. Importing this module warns once with a DeprecationWarning naming
the new path.
"""

import warnings

from job.core.values import OFF, ON, BadValue, switch, whole

warnings.warn("job.values is deprecated: import it as job.core.values (from job.core import values)",
              DeprecationWarning, stacklevel=2)

__all__ = ["OFF", "ON", "BadValue", "switch", "whole"]
