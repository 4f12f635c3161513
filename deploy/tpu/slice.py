"""The slice's lifecycle: query, create or reuse, wait until READY, delete.

    slice_ = Slice(cfg, Runner())
    slice_.ensure_ready()      # creates, reuses a READY one, or recreates a preempted one
    slice_.status()            # SliceStatus(state='READY', accelerator='v4-32', queued=None)
    slice_.delete()

State queries run even in a dry run (`mutating=False`); creation and
deletion are printed instead. Node states are Cloud TPU's (CREATING, READY,
PREEMPTED, ...); queued resources have their own (ACCEPTED, ACTIVE,
SUSPENDED, FAILED, ...). With SLICES=N one queued resource holds N nodes
(NAME-0 .. NAME-(N-1)): the set is READY when every node is, and one
preempted node means the whole set is deleted and created again.

A stock-out (see deploy/tpu/capacity.py) during a Spot or queued creation is
retried: delete what is left, wait (doubling, at most 10 minutes), create
again, until CREATE_DEADLINE; then one error with the last reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from deploy.runner import Runner
from deploy.tpu import capacity, gcloud
from deploy.tpu.config import TpuConfig
from job.errors import ConfigError, JobError

log = logging.getLogger("deploy.tpu")

READY = "READY"
ACTIVE = "ACTIVE"
# Slices in these states never become READY again: delete and create anew.
NODE_BROKEN = frozenset({"PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "HIDDEN", "HIDING"})
QUEUED_BROKEN = frozenset({"SUSPENDED", "SUSPENDING", "FAILED"})
# On their way to READY / ACTIVE: wait.
NODE_PENDING = frozenset({"CREATING", "STARTING", "RESTARTING", "REPAIRING", "UNHIDING", "STATE_UNSPECIFIED"})
QUEUED_PENDING = frozenset({"CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES"})
DELETING = "DELETING"
FAILED = "FAILED"
WAITING_FOR_CAPACITY = frozenset({"ACCEPTED", "WAITING_FOR_RESOURCES"})  # bounded by CREATE_DEADLINE
INCOMPLETE = "INCOMPLETE"  # some slices of a multislice set exist, others do not


class TpuError(JobError, RuntimeError):
    """gcloud failed, or the slice is not in a state the command can use."""


class _StockOut(Exception):
    """Cloud TPU has no capacity now (the reason is gcloud's message): retry later."""


@dataclasses.dataclass(frozen=True)
class SliceStatus:
    state: str | None  # the node's state (of every node: see `overall`); None when there is no node
    accelerator: str | None  # the node's accelerator type, as gcloud reports it
    queued: str | None = None  # the queued resource's state (only asked with --queued); None = none
    reason: str | None = None  # why the queued resource FAILED (state.failedData.error.message)
    nodes: tuple[tuple[str, str | None], ...] = ()  # (node, state or None) of each slice

    @property
    def absent(self) -> bool:
        return self.state is None and self.queued is None

    @property
    def ready(self) -> bool:
        return self.state == READY and self.queued in (None, ACTIVE)

    @property
    def broken(self) -> bool:
        """Preempted or failed: only deleting and creating it again helps."""
        return (self.state in NODE_BROKEN or self.queued in QUEUED_BROKEN
                or (self.queued in (ACTIVE, None) and self.state == INCOMPLETE)
                or (self.queued == ACTIVE and self.state is None))

    def describe(self) -> str:
        text = self.state or "NOT_FOUND"
        if len(self.nodes) > 1:
            text += " (" + ", ".join(f"{node} {state or 'NOT_FOUND'}" for node, state in self.nodes) + ")"
        if self.queued is not None:
            text += f" (queued resource {self.queued}{': ' + self.reason if self.reason else ''})"
        return text


def overall(states: list[str | None]) -> str | None:
    """One state for a set of slices: None when none exists, a broken one if any, INCOMPLETE when some
    are missing, READY when all are, else the first one still on its way."""
    present = [s for s in states if s is not None]
    if not present:
        return None
    broken = [s for s in present if s in NODE_BROKEN]
    if broken:
        return broken[0]
    if len(present) < len(states):
        return INCOMPLETE
    return next((s for s in present if s != READY), READY)


class Slice:
    def __init__(self, cfg: TpuConfig, runner: Runner, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.runner = runner
        self.sleep = sleep
        self.clock = clock

    # ------------------------------------------------------------------ queries
    def _query(self, argv: list[str]) -> str | None:
        """stdout of a describe; None when gcloud says NOT_FOUND."""
        proc = self.runner.run(argv, check=False, capture=True, mutating=False)
        if proc.returncode == 0:
            return (proc.stdout or "").strip()
        if "NOT_FOUND" in (proc.stderr or "") or "not found" in (proc.stderr or ""):
            return None
        raise TpuError(f"`{' '.join(argv[:6])} ...` failed with exit code {proc.returncode}: "
                       f"{(proc.stderr or '').strip()}")

    def status(self) -> SliceStatus:
        queued = reason = None
        if self.cfg.queued:
            out = self._query(gcloud.describe_queued(self.cfg))
            if out:
                state, _, why = out.partition("\t")
                queued, reason = state.strip() or None, why.strip() or None
        nodes: list[tuple[str, str | None]] = []
        accelerator = None
        for node in self.cfg.slice_names:
            out = self._query(gcloud.describe_node(self.cfg, node))
            if out is None:
                nodes.append((node, None))
                continue
            state, _, found = out.partition("\t")
            nodes.append((node, state.strip() or "STATE_UNSPECIFIED"))
            accelerator = accelerator or found.strip() or None
        return SliceStatus(overall([s for _, s in nodes]), accelerator, queued, reason, tuple(nodes))

    # ------------------------------------------------------------------ lifecycle
    def ensure_ready(self) -> str:
        """Make the slice READY: "reused", "created" or "waited" (it was already being created)."""
        deadline = self.clock() + self.cfg.create_deadline_s
        status = self.status()
        if status.ready:
            self.check_type(status)
            log.info("reusing slice %s (%s, READY)", self.cfg.name, status.describe())
            return "reused"
        if status.broken:
            log.info("slice %s is %s: deleting it to create it again", self.cfg.name, status.describe())
            self._delete(status)
        elif status.state in NODE_PENDING or status.queued in QUEUED_PENDING or status.state == INCOMPLETE:
            log.info("slice %s is %s: waiting until it is READY", self.cfg.name, status.describe())
            self.check_type(status)
            try:
                self._wait_ready(deadline)
                return "waited"
            except _StockOut as e:
                self._stocked_out(str(e), 1, deadline)
        elif not status.absent:
            log.info("slice %s is %s: waiting until it is gone", self.cfg.name, status.describe())
            self._wait(lambda s: s.absent, "gone")
        self._create_until_ready(deadline)
        return "created"

    def check_type(self, status: SliceStatus) -> None:
        """The existing slice must have the requested accelerator type."""
        if status.accelerator and status.accelerator != self.cfg.accelerator:
            raise ConfigError(
                "ACCELERATOR (--accelerator)", expected=f"{status.accelerator}, the type of the existing "
                f"slice {self.cfg.name}", found=self.cfg.accelerator,
                fix=f"use ACCELERATOR={status.accelerator}, another TPU_NAME, or `make tpu-delete` first",
            )

    def _create_until_ready(self, deadline: float) -> None:
        """Create and wait until READY; after a stock-out, delete what is left, back off and create again."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self._create()
                self._wait_ready(deadline)
                return
            except _StockOut as e:
                self._stocked_out(str(e), attempt, deadline)

    def _stocked_out(self, reason: str, attempt: int, deadline: float) -> None:
        """Log the stock-out, delete what it left, and wait before the next attempt (or give up)."""
        cfg = self.cfg
        wait = capacity.backoff_s(cfg.stockout_backoff_s, max(attempt, 1))
        left = deadline - self.clock()
        if wait > left:
            raise TpuError(
                f"no capacity for {cfg.accelerator} x {cfg.slices} in {cfg.zone} within CREATE_DEADLINE "
                f"({cfg.create_deadline_s:.0f} s, {attempt} attempts); last reason: {reason}; fix: try again later, "
                "another ZONE, QUEUED=1 (waits in line for capacity), RESERVED=1 with a reservation, "
                "or a longer CREATE_DEADLINE")
        log.warning("stock-out creating %s (attempt %d): %s; retrying in %.0f s (%.0f s left before CREATE_DEADLINE)",
                    cfg.name, attempt, reason, wait, left)
        status = self.status()
        if not status.absent:
            self._delete(status)
        self.sleep(wait)

    def _create(self) -> None:
        cfg = self.cfg
        kind = "queued resource" if cfg.queued else ("Spot slice" if cfg.spot else "slice")
        slices = f"{cfg.slices} slices {', '.join(cfg.slice_names)} of " if cfg.slices > 1 else ""
        log.info("creating %s %s: %s%s (%d workers), runtime %s, zone %s", kind, cfg.name, slices, cfg.accelerator,
                 cfg.workers, cfg.runtime_version, cfg.zone)
        argv = gcloud.create_queued(cfg) if cfg.queued else gcloud.create_node(cfg)
        proc = self.runner.run(argv, check=False, capture=True)
        if proc.returncode == 0:
            return
        message = (proc.stderr or proc.stdout or "").strip()
        if capacity.is_stockout(message):
            if cfg.spot or cfg.queued:
                raise _StockOut(message)
            raise TpuError(f"no capacity for {cfg.accelerator} in {cfg.zone}: {message}; fix: SPOT=1 or QUEUED=1 "
                           "(retried until CREATE_DEADLINE), RESERVED=1 with a reservation, or another ZONE")
        raise TpuError(f"`{' '.join(argv[:6])} ...` failed with exit code {proc.returncode}: {message}")

    def _delete(self, status: SliceStatus) -> None:
        if status.queued is not None:
            self.runner.run(gcloud.delete_queued(self.cfg))
            return
        for node, state in status.nodes:
            if state is not None:
                self.runner.run(gcloud.delete_node(self.cfg, node))

    def delete(self) -> bool:
        """Delete the slice (and its queued resource); False when there was none."""
        status = self.status()
        if status.absent:
            log.info("slice %s does not exist in %s: nothing to delete", self.cfg.name, self.cfg.zone)
            return False
        log.info("deleting slice %s (%s)", self.cfg.name, status.describe())
        self._delete(status)
        return True

    def wait_ready(self) -> None:
        """Wait until READY; a FAILED queued resource is an error with its reason."""
        try:
            self._wait_ready(self.clock() + self.cfg.create_deadline_s)
        except _StockOut as e:
            raise TpuError(f"queued resource {self.cfg.name} FAILED: {e}") from None

    def _wait_ready(self, capacity_deadline: float) -> None:
        """Wait until READY: up to CREATE_DEADLINE while a queued resource waits for capacity, then up to
        --ready-timeout. _StockOut when it FAILED for lack of capacity; TpuError for any other failure."""
        self._wait(lambda s: s.ready, READY, capacity_deadline)

    def _wait(self, done: Callable[[SliceStatus], bool], goal: str, capacity_deadline: float | None = None) -> None:
        if self.runner.dry_run:
            log.info("dry run: not waiting for slice %s to be %s", self.cfg.name, goal)
            return
        deadline: float | None = None
        while True:
            status = self.status()
            if done(status):
                return
            if goal == READY and status.queued == FAILED:
                reason = status.reason or "no reason given"
                if capacity.is_stockout(reason):
                    raise _StockOut(reason)
                raise TpuError(f"queued resource {self.cfg.name} FAILED: {reason}; fix: correct the cause, then "
                               "`make tpu-delete QUEUED=1` and create it again")
            if goal == READY and (status.broken or status.absent or status.state == DELETING):
                raise TpuError(f"slice {self.cfg.name} became {status.describe()} while waiting for READY")
            if capacity_deadline is not None and status.queued in WAITING_FOR_CAPACITY:
                if self.clock() > capacity_deadline:
                    raise TpuError(
                        f"queued resource {self.cfg.name} is still {status.queued} after CREATE_DEADLINE "
                        f"({self.cfg.create_deadline_s:.0f} s): no capacity yet; it stays in line: `make tpu-create "
                        "QUEUED=1` waits again, `make tpu-delete QUEUED=1` gives up")
            else:
                deadline = deadline if deadline is not None else self.clock() + self.cfg.ready_timeout_s
                if self.clock() > deadline:
                    raise TpuError(f"slice {self.cfg.name} is still {status.describe()} after "
                                   f"{self.cfg.ready_timeout_s:.0f} s; fix: wait and run `make tpu-status`, "
                                   "or pass --ready-timeout")
            self.sleep(self.cfg.poll_s)
