"""Stragglers: the host whose own work makes every other process wait, named each log interval.

Every process adds up its host time per step: the wait for its next batch and the dispatch of the
step, the part of a step that is this host's own work (its input pipeline, its Python). The others
spend that time waiting inside the step's collectives instead. At each log step the processes share
their mean host time per step in one all-gather of one number (nothing is added to the other steps).
A process is named when its host time is over `ratio` x the median (`--straggler-ratio`, 1.2) and
over FLOOR of the step time (below that it cannot slow the job much, however large the ratio): on
process 0's progress line, in the metrics (split "hosts") and, for the slowest of the run, in the
summary. A slow device (its compute, not its host) makes every process wait alike: the profile
shows it, this does not.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from job.parallel.multihost import coordination_client

FLOOR = 0.2  # a straggler's host time is over this share of the whole step time
HOST_KEY = "job/stragglers/host/"  # where each process posts its host name (coordination service)
HOST_TIMEOUT_MS = 10_000
SLOWEST_KEPT = 5  # how many hosts the summary lists


@dataclasses.dataclass(frozen=True)
class Straggler:
    process: int
    host: str
    host_ms: float  # mean host time per step over the interval
    ratio: float  # host_ms / the median of every process's

    def line(self) -> str:
        return (f"process {self.process} ({self.host}) {self.host_ms:.1f} ms/step host time, "
                f"{self.ratio:.1f}x the median")


def named(times_ms: np.ndarray, step_ms: float, ratio: float) -> list[tuple[int, float, float]]:
    """(process, host ms, ratio to the median) of every straggler in `times_ms`, slowest first."""
    median = float(statistics.median(times_ms.tolist()))
    found = [(p, float(t), float(t) / median if median > 0 else float("inf")) for p, t in enumerate(times_ms)
             if t > ratio * median and t > FLOOR * step_ms]
    return sorted(found, key=lambda row: -row[1])


class StragglerWatch:
    """Host time of this process; `share` (a collective at log steps) names the stragglers on process 0."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.processes = jax.process_count()
        self._host_s, self._step_s, self._steps = 0.0, 0.0, 0
        self._hosts: dict[int, str] = {}
        self._worst: dict[int, Straggler] = {}  # the slowest interval of each process named so far
        self._client = coordination_client()
        if self._client is not None:
            self._client.key_value_set(f"{HOST_KEY}{jax.process_index()}", socket.gethostname(), allow_overwrite=True)

    def add(self, host_s: float, step_s: float) -> None:
        """One step: its host time (the wait for its batch and its dispatch) and its whole time."""
        self._host_s += host_s
        self._step_s += step_s
        self._steps += 1

    def share(self) -> list[Straggler]:
        """Collective at a log step: every process's mean host time per step since the last call; the
        stragglers among them (on every process: they all see the same numbers). [] for one process."""
        steps = max(self._steps, 1)
        mine, step_ms = self._host_s / steps * 1e3, self._step_s / steps * 1e3
        self._host_s, self._step_s, self._steps = 0.0, 0.0, 0
        if self.processes == 1:
            return []
        times_ms = np.asarray(multihost_utils.process_allgather(np.float64(mine))).reshape(-1)
        found = [Straggler(p, self._host(p), t, r) for p, t, r in named(times_ms, step_ms, self.ratio)]
        for straggler in found:
            if straggler.process not in self._worst or straggler.host_ms > self._worst[straggler.process].host_ms:
                self._worst[straggler.process] = straggler
        return found

    def slowest(self) -> list[dict[str, Any]]:
        """The summary's list: each named process at its slowest interval, slowest first."""
        worst = sorted(self._worst.values(), key=lambda s: -s.host_ms)[:SLOWEST_KEPT]
        return [dataclasses.asdict(s) for s in worst]

    def _host(self, process: int) -> str:
        if process not in self._hosts:
            try:
                self._hosts[process] = self._client.blocking_key_value_get(f"{HOST_KEY}{process}", HOST_TIMEOUT_MS)
            except Exception:  # noqa: BLE001 - a name is a nicety: the process id still says who
                self._hosts[process] = "?"
        return self._hosts[process]
