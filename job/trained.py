"""Deprecated: the old path of `job.train.trained`, kept so that `from job import trained` works.

A trained run's model is `job.train.trained.load_model(run_dir)` (docs/api.md: what a fork may
import). Importing this module warns once with a DeprecationWarning naming that path.
"""

import warnings

from job.train.trained import eval_command, export_command, load_model, saved_config

warnings.warn("job.trained is deprecated: import it as job.train.trained (from job.train import trained); "
              "docs/api.md lists what a fork may import", DeprecationWarning, stacklevel=2)

__all__ = ["eval_command", "export_command", "load_model", "saved_config"]
