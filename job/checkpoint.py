"""Checkpoints: orbax's CheckpointManager, atomic, async, keep-last-N.

Orbax writes each step into a temporary folder and renames it only when
every process has finished, so an interrupted save is never listed (and
never restored). Restoring takes abstract targets carrying the *current*
shardings, so a run saved on 4 processes x 2 devices resumes on any other
topology.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from job.config import CheckpointConfig

log = logging.getLogger(__name__)


def abstract(tree: Any) -> Any:
    """Shape, dtype and sharding of every array leaf: what restore fills in."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree,
    )


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CheckpointConfig) -> None:
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Start saving `state` as `step` (collective; returns before the write ends when async)."""
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, step: int, like: Any) -> Any:
        """The saved state, placed like `like` (which may come from another topology)."""
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract(like)))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
