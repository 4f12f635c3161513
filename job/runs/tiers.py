"""Both checkpoint tiers and the choice between them: the one object the loop asks, as orbax's CheckpointManager.

    checkpoints = Checkpoints(run_dir, cfg.ckpt, abstract_state, node_name(), resume=cfg.resume,
                              end=cfg.steps, stopping=lambda: guard.stopping)
    newest = checkpoints.newest_specs()             # for the resume check, before anything is restored
    restored = checkpoints.restore(plan.init)       # Restored(Origin(step, tier, source), state)
    tier = checkpoints.due(step)                    # once a step: its cadences, the last step, a stop; or None
    if tier is not None:
        checkpoints.save(step, state, tier)         # in the tier that step is due in
    checkpoints.wait(); checkpoints.close(completed=True)

When to save is decided here alone, as orbax's CheckpointManager decides it (`should_save`, `reached_preemption`),
and asked once a step (`due`):
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
        self.persistent = Checkpointer(self.directory, cfg, training=True, like=like)
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

    def due(self, step: int) -> Tier | None:
        """The tier finished step `step` is saved in, or None: never a step already saved (or restored); the
        persistent tier where both are due. Asked once by every process after each step, once the processes have
        agreed whether to stop there."""
        if step == self.last_saved:
            return None
        if step % self.cfg.every == 0 or step == self.end or self.stopping():
            return Tier.PERSISTENT
        if self.local is not None and self.local.due(step):
            return Tier.LOCAL
        return None

    def save(self, step: int, state: Any, tier: Tier) -> None:
        """Save `step` in `tier`, the one `due(step)` gave: the persistent tier (collective; returns once the state
        is in host memory, the write going on when async), or this process's shards to its node's folder, sent to
        its peer on a thread."""
        if tier is Tier.PERSISTENT:
            self.persistent.save(step, state)
        elif tier is Tier.LOCAL and self.local is not None:
            self.local.save(step, state)
        else:
            raise ValueError(f"checkpoints: expected the tier due(step) gives for step {step} (persistent, or "
                             f"node-local with --ckpt.local-every), found {tier}; fix: save the tier due() returns")
        self.last_saved = step

    def writing(self) -> bool:
        """Whether the last persistent save is still being written, beside the steps (a question, nothing else)."""
        return self.persistent.writing()

    def wait(self) -> None:
        """Until the last persistent save is written; CheckpointError if it failed on any process."""
        self.persistent.wait()

    def close(self, *, completed: bool) -> None:
        """Both tiers closed; a `completed` run's node-local folder is removed (every step of it)."""
        self.persistent.close()
        if self.local is not None:
            self.local.close(completed=completed)

