"""Global batches from a task's rows: every process makes only the rows its devices hold.

    batch = global_batch(source, NamedSharding(mesh, P("data")), split="train", step=s, size=32)
    with Prefetch(lambda s: source.rows("train", s, *span), range(start, steps)) as upcoming:
        rows = upcoming.get(step)                                # made while the previous step ran

The rows a process needs come from the sharding itself (`row_span`, job/parallel/rows.py),
so any device order works as long as each process's rows are one contiguous block, and
processes of one model group (tensor parallelism across processes) make the same rows.

The rows themselves are the task's, a pure function of (split, step, row range); the
randomness they are drawn from is `job.random` (job/train/random.py). This module imports
jax only when it builds arrays.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from job.core.errors import ConfigError
from job.parallel.rows import row_span
from job.runtime import priority
from job.train.task import Rows

if TYPE_CHECKING:
    import jax

T = TypeVar("T")
PREFETCH_NICE = 10  # the prefetch thread gives way to the loop and the step (bench.pipeline)


def to_global(rows: Mapping[str, Any], sharding: jax.sharding.Sharding, size: int) -> dict[str, jax.Array]:
    """This process's rows (from `row_span`) as jax.Arrays of `size` global rows laid out by `sharding`."""
    import jax  # only to build arrays: this module imports without jax (tests/unit/test_batches.py)

    local = {name: np.asarray(value) for name, value in rows.items()}
    shapes = {name: (size, *value.shape[1:]) for name, value in local.items()}
    return jax.make_array_from_process_local_data(sharding, local, shapes)  # one call: one batched transfer


def global_batch(source: Rows, sharding: jax.sharding.Sharding, *, split: str, step: int, size: int,
                 offset: int = 0) -> dict[str, jax.Array]:
    """Batch `step` of `split` as jax.Arrays of `size` rows laid out by `sharding`: the source's rows
    offset .. offset + size (a finite split's full pass reads it in such windows)."""
    start, stop = row_span(sharding, size)
    return to_global(source.rows(split, step, offset + start, offset + stop), sharding, size)


def impurity(source: Rows, split: str, step: int, start: int, stop: int) -> tuple[Mapping[str, Any], str | None]:
    """Rows start..stop of `step` asked for twice: (the first answer, None when both are the same bytes, else
    where they first differ). The loop's promises (bitwise resume, the same batch on every topology) rest on
    `rows` being a pure function of (split, step, start, stop)."""
    first, again = source.rows(split, step, start, stop), source.rows(split, step, start, stop)
    said = f"rows({split!r}, {step}, {start}, {stop}) asked twice"
    if sorted(first) != sorted(again):
        return first, f"{said}: fields {sorted(first)}, then {sorted(again)}"
    for name in sorted(first):
        a, b = np.asarray(first[name]), np.asarray(again[name])
        if a.shape != b.shape or a.dtype != b.dtype:
            return first, f"{said}: field {name!r} {a.dtype}{list(a.shape)}, then {b.dtype}{list(b.shape)}"
        if a.tobytes() != b.tobytes():
            row = next((i for i in range(len(a)) if a[i].tobytes() != b[i].tobytes()), 0) if a.ndim else 0
            return first, f"{said}: field {name!r} differs, first at row {start + row}"
    return first, None


@dataclasses.dataclass(frozen=True)
class _Made(Generic[T]):
    step: int
    value: T  # what make(step) returned


@dataclasses.dataclass(frozen=True)
class _Failed:
    step: int
    error: BaseException  # what make(step) raised


class Prefetch(Generic[T]):
    """`make(step)` for each step of `steps` in order, up to `depth` steps ahead, on a daemon thread.

    `get(step)` returns what `make(step)` returned (or raises what it raised); steps are
    asked for in order. Nothing beyond the last step of `steps` is made. Leaving the
    `with` block (normally, by `break`, or by an exception) stops the thread.
    """

    def __init__(self, make: Callable[[int], T], steps: range, depth: int = 2) -> None:
        if depth < 1:
            raise ConfigError("prefetch depth", expected="an integer >= 1", found=depth, fix="pass depth=1 or more")
        self._make, self._steps = make, steps
        self._ready: queue.Queue[_Made[T] | _Failed] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="job-prefetch", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        priority.lower(PREFETCH_NICE)  # it fills the step's gaps on a host whose cores the step uses
        for step in self._steps:
            item: _Made[T] | _Failed
            try:
                item = _Made(step, self._make(step))
            except BaseException as err:  # handed to the consumer, which re-raises it in its own thread
                item = _Failed(step, err)
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, _Failed):
                return

    def get(self, step: int) -> T:
        """What `make(step)` returned, waiting for it if it is not ready yet."""
        while True:
            try:
                item = self._ready.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError(f"prefetch: step {step} was asked for, but the prefetch thread has "
                                       f"stopped (it makes steps {self._steps.start}..{self._steps.stop - 1} "
                                       "in order)") from None
        if isinstance(item, _Failed):
            raise item.error
        if item.step != step:
            raise RuntimeError(f"prefetch: expected step {step}, found step {item.step}; ask for steps in order")
        return item.value

    def close(self) -> None:
        """Stop the thread (it finishes the step it is making) and drop what it made."""
        self._stop.set()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10.0)

    def __enter__(self) -> Prefetch[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Prefetch", "global_batch", "row_span", "to_global"]
