"""The task interface: what the training loop needs from a task, and how a task is found by name.

The public face of `job.train.task` (where the code and its documentation live): import it
from here, `from job import task`; the library itself imports `job.train.task`.
"""

from job.train.task import (
    DEFAULT_TASK,
    SPLITS,
    TASKS_PACKAGE,
    Rows,
    Task,
    load,
    names,
    task_name,
    without_task,
)

__all__ = [
    "TASKS_PACKAGE",
    "DEFAULT_TASK",
    "SPLITS",
    "Rows",
    "Task",
    "names",
    "load",
    "task_name",
    "without_task",
]
