"""The rule `make rehearse`'s topology check enforces, checked on a task's own rows.

A row's values are a function of (split, step, its global row index), never of the range [start, stop) a
process asks for: 2 processes ask for [0, B/2) and [B/2, B) of batch `step`, 1 process for [0, B), and both
must see the same rows. A source seeded by its range (`np.random.default_rng([step, start])`) breaks it;
one seeded by each row's index (`job.random.row_bits(seed, split, step, row)`) keeps it.

    first_difference(task.source(cfg.data, cfg.model), global_batch=32, steps=6)
    # "step 0, global row 16, field 'tokens': asked as rows [0, 32) and as [16, 32) (the 2nd of 2 ranges)"
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from job.core import renamed
from job.train.task import Rows

CONTRACT = ("a row's values are a function of split, step and its global row index, never of the range "
            "[start, stop) a process asks for")
PROCESS_COUNTS = (2, 4)  # how the whole batch is cut: a range per process of 2, then of 4


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    floats = a.dtype.kind in "fc" and b.dtype.kind in "fc"
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=floats))


def _first_row(whole: Mapping[str, Any], pieces: Sequence[Mapping[str, Any]],
               ranges: Sequence[tuple[int, int]]) -> tuple[int, str, int] | None:
    """(global row, field, index of the range holding it) of the first row the pieces give otherwise."""
    found: tuple[int, str, int] | None = None
    for field in whole:
        expected = np.asarray(whole[field])
        for index, ((start, stop), piece) in enumerate(zip(ranges, pieces, strict=True)):
            got = np.asarray(piece[field]) if field in piece else None
            for row in range(start, stop):
                if found is not None and row >= found[0]:
                    break
                if got is None or len(got) != stop - start or not _same(expected[row], got[row - start]):
                    found = (row, field, index)
                    break
    return found


def first_difference(source: Rows, global_batch: int, steps: int, split: str = "train") -> str | None:
    """Where `source` breaks the contract for steps 0..`steps` of `split`: the step, the first global row and
    field whose values depend on the range asked for, and the two ranges; None when every cut agrees."""
    for step in range(steps + 1):
        whole = source.rows(split, step, 0, global_batch)
        for parts in PROCESS_COUNTS:
            if global_batch % parts:
                continue
            ranges = [(i * global_batch // parts, (i + 1) * global_batch // parts) for i in range(parts)]
            found = _first_row(whole, [source.rows(split, step, a, b) for a, b in ranges], ranges)
            if found is not None:
                row, field, index = found
                start, stop = ranges[index]
                return (f"step {step}, global row {row}, field {field!r}: asked as rows [0, {global_batch}) and as "
                        f"[{start}, {stop}) (the {_ordinal(index + 1)} of {parts} ranges) it differs")
    return None


def fix(rows: Callable[[], str | None] | None, steps: int) -> str:
    """The topology check's fix: the contract, and what `rows()` (`first_difference` of the task's own rows) says
    of it where they could be asked."""
    try:
        found = rows() if rows is not None else ""
    except Exception:  # noqa: BLE001 (a task's source may raise anything; the contract is still the fix)
        found = ""
    if found is None:
        return (f"{CONTRACT}; the task's rows keep it (steps 0-{steps} asked whole, in halves and in "
                "quarters), so look in the model for what depends on the devices or the process (an rng drawn per "
                "device, a sum in another order beyond float noise)")
    if found:
        return (f"{CONTRACT}; the task's rows break it at {found}: draw each row's randomness from its "
                "global row index (job.random.row_bits(seed, split_id, step, start, stop, width) gives row r the "
                "same words whatever range holds it)")
    return CONTRACT


__getattr__ = renamed.answer(__name__, {"PARTS": "PROCESS_COUNTS"})  # the old name warns

__all__ = ["CONTRACT", "PROCESS_COUNTS", "first_difference", "fix"]
