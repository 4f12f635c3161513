"""Deprecated: the old path of `job.train.entry`, kept so that a fork's `from job import entry` works.

A fork's own entry point imports `from job.train import entry` (docs/api.md: what a fork may
import). Importing this module warns once with a DeprecationWarning naming that path.
"""

import warnings

from job.train.entry import QUIET_LOGGERS, command, setup_logging, train

warnings.warn("job.entry is deprecated: import it as job.train.entry (from job.train import entry); "
              "docs/api.md lists what a fork may import", DeprecationWarning, stacklevel=2)

__all__ = ["QUIET_LOGGERS", "command", "setup_logging", "train"]
