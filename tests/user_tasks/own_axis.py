"""A user's task that names a mesh axis of its own: the miniGPT model's "hidden" width (tests/user_tasks/minigpt.py)
split over a mesh axis the user calls `width` under --rule tensor, declared in its Task.logical_axes, so --mesh
takes the name (an axis no rule maps to is refused: it would split nothing).

    python -m job.launch -n 2 --devices-per-process 2 -- \\
        python -m job train --task tests.user_tasks.own_axis:TASK --mesh data=2,width=2 --rule tensor
"""

from __future__ import annotations

import dataclasses

from tests.user_tasks import minigpt

TASK = dataclasses.replace(minigpt.TASK, name="own_axis", logical_axes={"hidden": {"tensor": "width"}})
