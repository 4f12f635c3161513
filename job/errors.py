"""Errors that say what was expected, what was found, and how to fix it, and the checks that raise them.

The public face of `job.core.errors` (where the code and its documentation live): import it
from here, `from job import errors`; the library itself imports `job.core.errors`.
"""

from job.core.errors import (
    BAD_INPUT_EXIT_CODE,
    ConfigError,
    InitOrderError,
    JobError,
    as_config_error,
    positive_seconds,
    refuse_dash_values,
    require,
    seconds,
)

__all__ = [
    "BAD_INPUT_EXIT_CODE",
    "JobError",
    "ConfigError",
    "require",
    "as_config_error",
    "InitOrderError",
    "refuse_dash_values",
    "seconds",
    "positive_seconds",
]
