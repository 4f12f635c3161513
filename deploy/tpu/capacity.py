"""Stock-outs, and how a creation waits for capacity.

A stock-out is Cloud TPU saying it has no capacity right now: `tpu-vm create`
fails with `There is no more capacity in the zone "Z"` (code 8, RESOURCE_EXHAUSTED),
or a queued resource ends FAILED with such a `state.failedData.error.message`.
Spot and queued creations wait and try again until CREATE_DEADLINE
(`deploy.tpu.slice` does the waiting; the options are checked in `deploy.tpu.config`).
"""

from __future__ import annotations

BACKOFF_CAP_S = 600.0  # waits between stock-out retries double up to 10 minutes
DEFAULT_DEADLINE_S = 2 * 3600.0  # CREATE_DEADLINE=2h
DEFAULT_BACKOFF_S = 60.0  # the first wait after a stock-out
# Lowercase, as found in gcloud's messages once lowercased.
STOCKOUT_MARKERS = ("no more capacity", "resource_exhausted", "stockout", "stock-out", "insufficient capacity",
                    '"code": 8,')


def is_stockout(message: str | None) -> bool:
    """Whether gcloud's message (or a FAILED queued resource's reason) says there is no capacity."""
    text = (message or "").lower()
    return any(marker in text for marker in STOCKOUT_MARKERS)


def backoff_s(first: float, retry: int) -> float:
    """Seconds to wait before retry number `retry` (1, 2, ...): doubling from `first`, at most 10 minutes."""
    return min(first * 2.0 ** (retry - 1), max(first, BACKOFF_CAP_S))
