"""The tasks the training loop can run: one folder each; this is where you fork.

`python -m job train --task NAME` runs `job/tasks/NAME/` (default `lm`). Copy
`lm/` (a transformer LM) or `classify/` (a small classifier) to a new folder,
edit it there, and nothing outside it needs to change. See `job/task.py` for
the interface a folder's `TASK` fills in.
"""
