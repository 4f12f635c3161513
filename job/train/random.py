"""The randomness a task draws its rows from: uniform words that are a pure function of the row.

    from job.random import below, row_bits, uniform

    bits = row_bits(seed, split_id, step, start, stop, width)   # uint64 [stop - start, width]
    label = below(bits[:, 0], classes)                          # int64 in [0, classes)
    t = uniform(bits[:, 1])                                     # float64 in [0, 1)

`row_bits` is a counter-based hash (splitmix64) of (seed, split, step, row, position),
computed for a whole block of rows at once. Bit j of row r never depends on which other
rows are asked for, so a source's `rows(split, step, start, stop)` built on it is the pure
function the loop needs: every topology sees the same global batches, and a resumed run
the very batches an uninterrupted one would. Pass `job.task.SPLITS.index(split)` (or any
number of your own per split) as `split_id`.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser constants


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (exact, no overflow warnings): a bijection of 64-bit words."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """The same finaliser on a uint64 array (multiplication wraps modulo 2**64), in place."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def row_bits(seed: int, split_id: int, step: int, start: int, stop: int, width: int) -> np.ndarray:
    """uint64 [stop - start, width]: uniform random words, a pure function of (seed, split_id, step, row, position).

    Row r's key is the chained hash of (seed, split_id, step, r); its words are the
    splitmix64 stream of that key (word j = mix(key + (j + 1) * golden)).
    """
    key = _mix_int(_mix_int(_mix_int(seed + _GOLDEN) ^ split_id) ^ step)
    rows = _mix(np.arange(start, stop, dtype=np.uint64) ^ np.uint64(key))
    steps = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    return _mix(rows[:, None] + steps[None, :])


def uniform(bits: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) from the top 53 bits of each word."""
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def below(bits: np.ndarray, n: int) -> np.ndarray:
    """int64 in [0, n) from each word (bias at most n / 2**64)."""
    return (bits % np.uint64(n)).astype(np.int64)


__all__ = ["below", "row_bits", "uniform"]
