"""Both checkpoint tiers and the choice between them: the one object the loop asks, as orbax's CheckpointManager.

    checkpoints = Checkpoints(run_dir, cfg.ckpt, abstract_state, node_name(), resume=cfg.resume,
                              end=cfg.steps, stopping=lambda: guard.stopping)
    newest = checkpoints.newest_specs()             # for the resume check, before anything is restored
    restored = checkpoints.restore(plan.init)       # Restored(Origin(step, tier, source), state)
    if checkpoints.should_save(step):               # after every step: its cadences, the last step, a stop
        checkpoints.save(step, state)               # in the tier that step is due in
    checkpoints.wait(); checkpoints.close(completed=True)

When to save is decided here alone, as orbax's CheckpointManager decides it (`should_save`, `reached_preemption`):
the persistent tier every `--ckpt.every` steps, at the run's last step and at a stop the processes agreed on
(a preemption, Ctrl-C); the node-local tier every `--ckpt.local-every` steps in between. The loop asks and saves.

The persistent tier is job/runs/checkpoint.py (orbax, in RUN_DIR/checkpoints); the node-local tier,
made only with --ckpt.local-every, is job/runs/local_tier.py. A restore takes the node-local tier's step
when it holds one newer than the persistent tier's newest (and --resume), else the persistent tier's
newest readable step, else a fresh state: never over checkpoints set aside as unreadable, and with the
node-local tier cleared of an earlier run's steps. Every process makes the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from etils import epath

from job.core import rundir
from job.runs.checkpoint import Checkpointer
from job.runs.config import CheckpointConfig
from job.runs.local_tier import LocalTier
from job.runs.resume import move_aside_for_fresh_start, refuse_fresh_start_over_set_aside
from job.runtime.preflight import raised_together

class Tier(enum.Enum):
    """Where a run's state came from. Each value is the words of the attempt record's `resumed` line
    (job/runs/attempts.py, `tier`), so `Tier(record["tier"])` reads back the records already on disk."""

    LOCAL = "node-local"
    PERSISTENT = "persistent"
    FRESH = "none (from step 0)"


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a restore took the state from: its step, its tier and the source, in words (where each process read
    its node-local shards, or the persistent tier's folder; "" for Tier.FRESH)."""

    step: int
    tier: Tier
    source: str

    def said(self) -> str | None:
        """The run's opening line about it; None for a fresh start."""
        if self.tier is Tier.LOCAL:
            return f"resumed from step {self.step} (the node-local tier: {self.source})"
        if self.tier is Tier.PERSISTENT:
            return f"resumed from step {self.step} ({self.source})"
        return None


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpoints.restore` gives the loop: where the state came from, and the state."""

    origin: Origin
    state: Any


class Checkpoints:
    """The run's checkpoints, both tiers: made by every process together; with `resume` False (--no-resume)
    the earlier checkpoints are moved aside first (`moved`: where they went, None when there were none).
    `like`: the abstract state (shapes, dtypes, shardings) a restore fills in; `node`: this process's node
    name, as the other nodes resolve it (the node-local tier's peers)."""

    def __init__(self, run_dir: epath.Path, cfg: CheckpointConfig, like: Any, node: str, *, resume: bool,
                 end: int, stopping: Callable[[], bool] = lambda: False) -> None:
        """`end`: the run's last step (--steps), always saved; `stopping`: whether the processes have agreed to
        stop (the preemption guard's answer at this step), which saves the step in the persistent tier."""
        self.run_dir, self.cfg, self.like, self.node, self.resume = run_dir, cfg, like, node, resume
        self.end, self.stopping = end, stopping
        self.last_saved = 0  # the newest step saved in either tier, or restored (set by restore)
        self.directory = rundir.checkpoints(run_dir)
        self.moved = None if resume else move_aside_for_fresh_start(self.directory)
        self.persistent = Checkpointer(self.directory, cfg, training=True)
        # made by restore, after the resume check: a state this run does not build stops it with nothing touched
        self.local: LocalTier | None = None

    def newest_specs(self) -> tuple[int, dict[str, tuple]] | None:
        """(step, {leaf path: (shape, dtype)}) of the persistent tier's newest step whose metadata reads, for
        `resume.check` before anything is restored; None with --no-resume or none readable."""
        return self.persistent.newest_specs() if self.resume else None

    def restore(self, init: Callable[[], Any]) -> Restored:
        """The node-local tier's step when newer than the persistent tier's newest, else the persistent tier's
        newest readable step, else `init()` (a fresh start: refused over checkpoints set aside as unreadable,
        unless --no-resume); `last_saved` becomes its step. Makes the node-local tier first (--ckpt.local-every).
        Collective."""
        if self.cfg.local_every:
            self.local = LocalTier(self.cfg.local_dir, str(self.run_dir), self.cfg.local_every, self.node, self.like)
        restored = self._restored(init)
        self.last_saved = restored.origin.step
        return restored

    def _restored(self, init: Callable[[], Any]) -> Restored:
        local = self._restore_local(newer_than=self.persistent.latest_step())
        if local is not None:
            return local
        if self.resume and self.persistent.all_steps():  # read back first: an unreadable newest step is set aside
            step, state = self.persistent.restore_newest(self.like)
            return Restored(Origin(step, Tier.PERSISTENT, str(self.directory)), state)
        if self.resume:  # never from step 0 over checkpoints that were set aside as unreadable
            with raised_together("set_aside"):
                refuse_fresh_start_over_set_aside(self.persistent.directory)
        state = init()
        if self.local is not None:
            self.local.clear()  # an earlier run's local steps are never restored into this one
        return Restored(Origin(0, Tier.FRESH, ""), state)

    def _restore_local(self, newer_than: int | None) -> Restored | None:
        """The node-local tier's step when it holds one newer than the persistent tier's newest (`newer_than`)
        and every process read its part back; else None (and with no tier, or --no-resume). Collective."""
        if self.local is None or not self.resume:
            return None
        restored = self.local.restore(self.like, newer_than)
        if restored is None:
            return None
        step, state = restored
        return Restored(Origin(step, Tier.LOCAL, self.local.sources(step)), state)

    def latest_step(self) -> int | None:
        """The persistent tier's newest step."""
        return self.persistent.latest_step()

    def reserve(self, program_bytes: int) -> None:
        """Keep `program_bytes` per device free beside a background save's on-device copy: what the train step's
        program takes when it loads again (job/runs/headroom.py)."""
        self.persistent.reserved = program_bytes

    def should_save(self, step: int) -> bool:
        """Whether finished step `step` is saved, in either tier: never one already saved (or restored); asked by
        every process after each step, once the processes have agreed whether to stop there."""
        return step != self.last_saved and (self._persistent_due(step) or self._local_due(step))

    def _persistent_due(self, step: int) -> bool:
        return step % self.cfg.every == 0 or step == self.end or self.stopping()

    def _local_due(self, step: int) -> bool:
        return self.local is not None and self.local.due(step)

    def save(self, step: int, state: Any) -> None:
        """Save `step` in the tier it is due in (`should_save`): the persistent one (collective; returns before
        the write ends when async) where both are, else this process's shards to its node's folder, sent to its
        peer on a thread."""
        if self._persistent_due(step):
            self.persistent.save(step, state, last=self.stopping())
        elif self._local_due(step):
            assert self.local is not None  # _local_due says so
            self.local.save(step, state)
        else:
            raise AssertionError(f"step {step} is due in no checkpoint tier: ask should_save first")
        self.last_saved = step

    def wait(self) -> None:
        """Until the last persistent save is written; CheckpointError if it failed on any process."""
        self.persistent.wait()

    def close(self, *, completed: bool) -> None:
        """Both tiers closed; a `completed` run's node-local folder is removed (every step of it)."""
        self.persistent.close()
        if self.local is not None:
            self.local.close(completed=completed)

