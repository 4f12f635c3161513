"""Evaluation of a task's declared splits: a fixed number of batches, or one full pass over a finite split.

    evaluator = Evaluator(eval_step, source, mesh, splits=task.eval_splits, global_batch=32,
                          batches=cfg.data.eval_batches, full=cfg.eval_full, weight=task.weight)
    results = evaluator.run(state)            # {split: {metric: value}}, or None when a signal came

A split is finite when its source says how many rows it has (`source.split_size(split)` returns an
int; the old name `size(split)` is still read, with a FutureWarning, when it is a method taking the
split, and any other `size`, such as an image side, is the source's own). A full pass over it reads
each of its rows once, as `rows(split, 0, start, stop)` with row numbers of the whole split, in
global batches. The last, partial batch is cut in two so that no row is
padded or seen twice: the rows that divide over the data-parallel devices are sharded like a train
batch, and the remainder (fewer rows than data shards) is held whole by every device. Those are
two more shapes, each compiled once. A split without a size (synthetic or random windows) is
evaluated in `batches` batches, batch i being `rows(split, i, start, stop)`.

Metrics are averaged over the batches weighed by the task's weight metric (its items, such as
tokens), else by each batch's rows. A task's loss that is a mean over its items then gives, over
a full pass, the mean over every item of the split.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from job.core.errors import ConfigError
from job.parallel import sharding
from job.train.batches import global_batch
from job.train.task import Rows

RESERVED_SPLITS = ("train", "hosts", "checkpoint")  # metric records the loop writes under these names
# a source's rows of a finite split: a name of the protocol's own (`size` is often an image side)
SPLIT_SIZE = "split_size"


@dataclasses.dataclass(frozen=True)
class Piece:
    """One eval batch: `rows` rows of `rows(split, step, ...)` from row `offset` on."""

    step: int
    offset: int
    rows: int
    whole: bool = False  # held whole by every device (a full pass's last few rows), else sharded over data


def size_of(source: object, split: str) -> int | None:
    """The rows of a finite split (the source's `split_size(split)`), None for a split without an end or a
    source without the method. A source's `size` is its own unless it is a method taking the split: the
    name this protocol had before, still read, with a FutureWarning."""
    kind = type(source).__name__
    method, name = getattr(source, SPLIT_SIZE, None), SPLIT_SIZE
    if method is None:
        method, name = _old_size(source), "size"
        if method is None:
            return None
    if not _takes_a_split(method):
        raise ConfigError(f"{kind}.{SPLIT_SIZE}", expected="a method split_size(split) -> rows or None",
                          found=repr(method), fix=f"define def {SPLIT_SIZE}(self, split) on {kind}, returning the "
                          "split's row count, or None for a split without an end")
    rows = method(split)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1):
        raise ConfigError(f"the size of eval split {split!r}", expected="a number of rows >= 1, or None (no end)",
                          found=rows, fix=f"return the split's row count from {kind}.{name}"
                          + (f", or define {SPLIT_SIZE}(split) if {kind}.size means something else"
                             if name == "size" else ""))
    return None if rows is None else int(rows)


def _takes_a_split(method: object) -> bool:
    """True for a callable that takes one positional argument (the split)."""
    if not callable(method):
        return False
    try:
        inspect.signature(method).bind("eval")
    except (TypeError, ValueError):  # another signature, or none that Python can read
        return False
    return True


def _old_size(source: object) -> Callable[[str], object] | None:
    """`source.size` when it is the split-size method under its old name (with a FutureWarning); None
    for anything else a source calls `size` (an image side, a shape, a method without the split)."""
    size = getattr(source, "size", None)
    if not _takes_a_split(size):
        return None
    kind = type(source).__name__
    warnings.warn(f"{kind}.size(split) as the rows of a finite split is deprecated: rename it "
                  f"{kind}.{SPLIT_SIZE}(split); a source's `size` is then its own (an image side, ...)",
                  FutureWarning, stacklevel=3)
    return size


def pieces(size: int | None, *, batch: int, divisor: int, batches: int, full: bool) -> list[Piece]:
    """The eval batches of one split: `batches` batches of an endless split; of a finite one of `size`
    rows, a full pass (`full`), else its first `batches` batches (the whole split when it is shorter)."""
    if size is None:
        return [part for step in range(batches) for part in _fitted(Piece(step, 0, batch), divisor)]
    whole_batches = size // batch
    count = whole_batches if full else min(batches, whole_batches)
    out = [part for i in range(count) for part in _fitted(Piece(0, i * batch, batch), divisor)]
    if full or batches > whole_batches:  # the whole split: its last rows too
        out += _fitted(Piece(0, whole_batches * batch, size - whole_batches * batch), divisor)
    return out


def _fitted(piece: Piece, divisor: int) -> list[Piece]:
    """`piece` as the pieces its rows take on `divisor` data-parallel shards: the rows that split evenly,
    sharded, then the few left, whole on every device (a full pass's tail; any batch of a run evaluated on
    devices its batch does not split over)."""
    sharded = piece.rows - piece.rows % divisor
    return [part for part in (dataclasses.replace(piece, rows=sharded),
                              Piece(piece.step, piece.offset + sharded, piece.rows % divisor, whole=True))
            if part.rows]


def check_splits(splits: Sequence[str], task_name: str) -> None:
    """A task's declared eval splits: distinct names that are not the loop's own record names."""
    bad = [s for s in splits if not isinstance(s, str) or not s.isidentifier() or s in RESERVED_SPLITS]
    if bad or len(set(splits)) != len(splits):
        raise ConfigError(f"Task.eval_splits of {task_name}", expected="distinct identifiers other than "
                          f"{', '.join(RESERVED_SPLITS)}", found=list(splits),
                          fix='declare e.g. eval_splits=("eval", "test")')


class Evaluator:
    """Evaluates a state on every declared split, each under its own name."""

    def __init__(self, eval_step: jax.stages.Wrapped, source: Rows, mesh: Mesh, *, splits: Sequence[str],
                 global_batch: int, batches: int, full: bool, weight: str | None) -> None:
        self._step, self._source, self._weight = eval_step, source, weight
        self._sharded = sharding.batch_sharding(mesh)
        self._whole = NamedSharding(mesh, PartitionSpec())
        self._batch = global_batch
        divisor = sharding.data_parallel_size(mesh)
        self.plan = {split: pieces(size_of(source, split), batch=global_batch, divisor=divisor,
                                   batches=batches, full=full) for split in (splits if batches else ())}

    def rows(self, split: str) -> int:
        """How many rows one evaluation of `split` reads."""
        return sum(p.rows for p in self.plan[split])

    def batch(self, split: str, piece: Piece) -> dict[str, jax.Array]:
        """The global arrays of one piece: sharded like a train batch, or whole on every device."""
        return global_batch(self._source, self._whole if piece.whole else self._sharded, split=split,
                            step=piece.step, size=piece.rows, offset=piece.offset)

    def lower(self, state: Any, step: jax.stages.Wrapped | None = None) -> list[jax.stages.Lowered]:
        """The eval step (or `step`, another jit of the same function) lowered for `state` (arrays or their
        abstract shapes) and every batch shape of the plan. Reads the rows of one batch per shape and split."""
        step = self._step if step is None else step
        return [step.lower(state, self.batch(split, piece)) for split, planned in self.plan.items()
                for piece in {(p.rows, p.whole): p for p in planned}.values()]

    def compile(self, state: Any) -> None:
        """Compile the eval step for `state` and every batch shape of the plan now, ahead of the first
        evaluation, whose calls then find it compiled. Reads the rows of one batch per shape and split."""
        for lowered in self.lower(state):
            lowered.compile()

    def use(self, step: jax.stages.Wrapped) -> None:
        """Evaluate with `step` from now: another jit of the same function, its programs compiled already
        (job/train/aside.py)."""
        self._step = step

    def run(self, state: Any, should_stop: Callable[[], bool] = lambda: False) -> dict[str, dict[str, float]] | None:
        """{split: metrics} of `state`; None when `should_stop` (the collective preemption check after
        each batch) says a signal came."""
        results = {}
        for split, planned in self.plan.items():
            sums: dict[str, float] = {}
            total = 0.0
            for piece in planned:
                metrics = {k: float(v) for k, v in jax.device_get(self._step(state, self.batch(split, piece))).items()}
                if should_stop():
                    return None
                w = metrics.pop(self._weight) if self._weight else piece.rows / self._batch
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value * w
                total += w
            results[split] = {name: value / total if total else 0.0 for name, value in sums.items()}
        return results


def summary_fields(splits: Sequence[str], results: Mapping[str, Mapping[str, float]], shown: Sequence[str],
                   ema: bool) -> dict[str, Any]:
    """The summary's eval entries: SPLIT_METRIC for the task's shown metrics (SPLIT_ema_METRIC beside),
    None for a split not evaluated."""
    out: dict[str, Any] = {}
    for split in splits:
        metrics = results.get(split, {})
        out.update({f"{split}_{name}": metrics.get(name) for name in shown})
        if ema:
            out.update({f"{split}_ema_{name}": metrics.get(f"ema_{name}") for name in shown})
    return out


__all__ = ["SPLIT_SIZE", "Evaluator", "Piece", "check_splits", "pieces", "size_of", "summary_fields"]
