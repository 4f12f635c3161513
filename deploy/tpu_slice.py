"""The slice's lifecycle: query, create or reuse, wait until READY, delete.

    slice_ = Slice(cfg, Runner())
    slice_.ensure_ready()      # creates, reuses a READY one, or recreates a preempted one
    slice_.status()            # SliceStatus(state='READY', accelerator='v4-32', queued=None)
    slice_.delete()

State queries run even in a dry run (`mutating=False`); creation and
deletion are printed instead. Node states are Cloud TPU's (CREATING, READY,
PREEMPTED, ...); queued resources have their own (ACCEPTED, ACTIVE,
SUSPENDED, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from deploy import tpu_gcloud as gcloud
from deploy.runner import Runner
from deploy.tpu_config import TpuConfig
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


class TpuError(JobError, RuntimeError):
    """gcloud failed, or the slice is not in a state the command can use."""


@dataclasses.dataclass(frozen=True)
class SliceStatus:
    state: str | None  # the node's state; None when there is no such node
    accelerator: str | None  # the node's accelerator type, as gcloud reports it
    queued: str | None = None  # the queued resource's state (only asked with --queued); None = none

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
                or (self.queued == ACTIVE and self.state is None))

    def describe(self) -> str:
        text = self.state or "NOT_FOUND"
        return text if self.queued is None else f"{text} (queued resource {self.queued})"


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
        queued = self._query(gcloud.describe_queued(self.cfg)) if self.cfg.queued else None
        out = self._query(gcloud.describe_node(self.cfg))
        if out is None:
            return SliceStatus(None, None, queued or None)
        state, _, accelerator = out.partition("\t")
        return SliceStatus(state.strip() or "STATE_UNSPECIFIED", accelerator.strip() or None, queued or None)

    # ------------------------------------------------------------------ lifecycle
    def ensure_ready(self) -> str:
        """Make the slice READY: "reused", "created" or "waited" (it was already being created)."""
        status = self.status()
        if status.ready:
            self.check_type(status)
            log.info("reusing slice %s (%s, READY)", self.cfg.name, status.accelerator)
            return "reused"
        if status.broken:
            log.info("slice %s is %s: deleting it to create it again", self.cfg.name, status.describe())
            self._delete(status)
        elif status.state in NODE_PENDING or status.queued in QUEUED_PENDING:
            log.info("slice %s is %s: waiting until it is READY", self.cfg.name, status.describe())
            self.check_type(status)
            self.wait_ready()
            return "waited"
        elif not status.absent:
            log.info("slice %s is %s: waiting until it is gone", self.cfg.name, status.describe())
            self._wait(lambda s: s.absent, "gone")
        self._create()
        self.wait_ready()
        return "created"

    def check_type(self, status: SliceStatus) -> None:
        """The existing slice must have the requested accelerator type."""
        if status.accelerator and status.accelerator != self.cfg.accelerator:
            raise ConfigError(
                "ACCELERATOR (--accelerator)", expected=f"{status.accelerator}, the type of the existing "
                f"slice {self.cfg.name}", found=self.cfg.accelerator,
                fix=f"use ACCELERATOR={status.accelerator}, another TPU_NAME, or `make tpu-delete` first",
            )

    def _create(self) -> None:
        cfg = self.cfg
        kind = "queued resource" if cfg.queued else ("Spot slice" if cfg.spot else "slice")
        log.info("creating %s %s: %s (%d workers), runtime %s, zone %s", kind, cfg.name, cfg.accelerator,
                 cfg.workers, cfg.runtime_version, cfg.zone)
        self.runner.run(gcloud.create_queued(cfg) if cfg.queued else gcloud.create_node(cfg))

    def _delete(self, status: SliceStatus) -> None:
        if status.queued is not None:
            self.runner.run(gcloud.delete_queued(self.cfg))
        elif status.state is not None:
            self.runner.run(gcloud.delete_node(self.cfg))

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
        self._wait(lambda s: s.ready, READY)

    def _wait(self, done: Callable[[SliceStatus], bool], goal: str) -> None:
        if self.runner.dry_run:
            log.info("dry run: not waiting for slice %s to be %s", self.cfg.name, goal)
            return
        deadline = self.clock() + self.cfg.ready_timeout_s
        while True:
            status = self.status()
            if done(status):
                return
            if goal == READY and (status.broken or status.absent or status.state == DELETING):
                raise TpuError(f"slice {self.cfg.name} became {status.describe()} while waiting for READY")
            if self.clock() > deadline:
                raise TpuError(f"slice {self.cfg.name} is still {status.describe()} after "
                               f"{self.cfg.ready_timeout_s:.0f} s; fix: wait and run `make tpu-status`, "
                               "or pass --ready-timeout")
            self.sleep(self.cfg.poll_s)
