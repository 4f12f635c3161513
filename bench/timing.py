"""Timing helpers shared by every benchmark: medians, interleaved repetitions, ratios.

    from bench.timing import interleave, median, ratio
    times = interleave({"template": run_template, "baseline": run_baseline}, reps=7, warmup=1)
    print(ratio(times["template"], times["baseline"]))   # ratio of medians

The machine is shared and noisy, so no figure stands alone: a variant is always
timed in the same run as its baseline, repetitions alternate between variants
(A B A B ...) so that drifting load hits both, and the median is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence


def median(values: Sequence[float]) -> float:
    """The median; NaN for no values."""
    return statistics.median(values) if values else float("nan")


def ratio(values: Sequence[float], baseline: Sequence[float]) -> float:
    """median(values) / median(baseline)."""
    base = median(baseline)
    return median(values) / base if base else float("nan")


def pair_ratios(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """value_i / baseline_i for each interleaved pair of repetitions."""
    return [a / b for a, b in zip(values, baseline) if b]


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile; both NaN for fewer than 2 values."""
    if len(values) < 2:
        return float("nan"), float("nan")
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes (wall clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(variants: Mapping[str, Callable[[], float | None]], reps: int,
               warmup: int = 1) -> dict[str, list[float]]:
    """Run every variant `reps` times, alternating A B A B ...; return seconds per variant.

    A variant returns the seconds it measured itself (e.g. per step over a
    block of steps); a variant returning None is timed around its call.
    `warmup` rounds run first, in the same order, and are not recorded.
    """
    out: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            measured = fn()
            seconds = time.perf_counter() - start if measured is None else float(measured)
            if i >= warmup:
                out[name].append(seconds)
    return out


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(min, max) of the values, for a table's "range" column."""
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def fmt_s(seconds: float) -> str:
    """A duration with a unit that keeps 3 significant figures (ns .. s)."""
    if seconds != seconds:  # NaN
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{seconds} s"


def fmt_x(value: float) -> str:
    """A ratio such as 1.02x."""
    return "n/a" if value != value else f"{value:.2f}x"


def fmt_ratio(values: Sequence[float], baseline: Sequence[float]) -> str:
    """Ratio of medians, with the interquartile range of the pairwise ratios: "1.02x (1.00-1.05)"."""
    lo, hi = quartiles(pair_ratios(values, baseline))
    spread = "" if lo != lo else f" ({lo:.2f}-{hi:.2f})"
    return fmt_x(ratio(values, baseline)) + spread


def fmt_pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.1f}%"


def fmt_mb(nbytes: float) -> str:
    return "n/a" if nbytes != nbytes else f"{nbytes / 2**20:.0f} MiB"
