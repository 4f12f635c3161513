"""Capacity and network options of a slice, and what a stock-out looks like.

    make tpu-create TPU_NAME=my-pod ZONE=us-central2-b ACCELERATOR=v4-32 RESERVED=1 INTERNAL_IP=1 \\
        NETWORK=my-vpc SUBNETWORK=my-subnet SERVICE_ACCOUNT=job@my-proj.iam.gserviceaccount.com TAGS=tpu,train
    make tpu-create ... QUEUED=1 SLICES=2 CREATE_DEADLINE=2h   # 2 slices: my-pod-0, my-pod-1

A stock-out is Cloud TPU saying it has no capacity right now: `tpu-vm create`
fails with `There is no more capacity in the zone "Z"` (code 8, RESOURCE_EXHAUSTED),
or a queued resource ends FAILED with such a `state.failedData.error.message`.
Spot and queued creations wait and try again until CREATE_DEADLINE.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

from job.errors import ConfigError, require

if TYPE_CHECKING:
    from deploy.tpu_config import TpuConfig

BACKOFF_CAP_S = 600.0  # waits between stock-out retries double up to 10 minutes
DEFAULT_DEADLINE_S = 2 * 3600.0  # CREATE_DEADLINE=2h
DEFAULT_BACKOFF_S = 60.0  # the first wait after a stock-out
# Lowercase, as found in gcloud's messages once lowercased.
STOCKOUT_MARKERS = ("no more capacity", "resource_exhausted", "stockout", "stock-out", "insufficient capacity",
                    '"code": 8,')

_NAME = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"  # GCE names: networks, subnetworks, tags
_NETWORK = re.compile(rf"^(projects/[a-z][-a-z0-9.:]*/global/networks/)?{_NAME}$")
_SUBNETWORK = re.compile(rf"^(projects/[a-z][-a-z0-9.:]*/regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?{_NAME}$")
_TAG = re.compile(rf"^{_NAME}$")
_EMAIL = re.compile(r"^[a-z0-9][-a-z0-9._+]*@[a-z0-9][-a-z0-9]*(\.[a-z0-9][-a-z0-9]*)+$")
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?)([smhd]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_TAGS = 64  # Compute Engine's limit per VM
MAX_NAME = 63


def duration_seconds(text: str) -> float:
    """CREATE_DEADLINE: `2h`, `30m`, `90s`, `1d` or plain seconds; > 0."""
    found = _DURATION.fullmatch(text.strip())
    value = float(found.group(1)) * _UNIT_S[found.group(3)] if found else math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a duration > 0 such as 2h, 30m or 900 (seconds), found {text!r}")
    return value


def tag_list(text: str) -> tuple[str, ...]:
    """TAGS: a comma-separated list (empty: none)."""
    return tuple(word.strip() for word in text.split(",")) if text.strip() else ()


def is_stockout(message: str | None) -> bool:
    """Whether gcloud's message (or a FAILED queued resource's reason) says there is no capacity."""
    text = (message or "").lower()
    return any(marker in text for marker in STOCKOUT_MARKERS)


def backoff_s(first: float, retry: int) -> float:
    """Seconds to wait before retry number `retry` (1, 2, ...): doubling from `first`, at most 10 minutes."""
    return min(first * 2.0 ** (retry - 1), max(first, BACKOFF_CAP_S))


def slice_names(name: str, slices: int) -> tuple[str, ...]:
    """The node of each slice: NAME alone, or NAME-0 .. NAME-(N-1) (gcloud's --node-prefix naming)."""
    return (name,) if slices == 1 else tuple(f"{name}-{i}" for i in range(slices))


def validate_capacity(cfg: TpuConfig) -> None:
    """The capacity, network and multislice options; ConfigError on the first bad value."""
    if cfg.spot and cfg.reserved:
        raise ConfigError("SPOT (--spot) and RESERVED (--reserved)",
                          expected="one kind of capacity: gcloud takes --spot or --reserved, not both",
                          found="SPOT=1 RESERVED=1", fix="keep RESERVED=1 to use your reservation, or SPOT=1")
    if cfg.network is not None:
        require(bool(_NETWORK.fullmatch(cfg.network)), "NETWORK (--network)",
                "a VPC network name such as my-vpc (or projects/P/global/networks/my-vpc)", cfg.network,
                "leave NETWORK empty for the project's default network")
    if cfg.subnetwork is not None:
        require(bool(_SUBNETWORK.fullmatch(cfg.subnetwork)), "SUBNETWORK (--subnetwork)",
                "a subnetwork name such as my-subnet (or projects/P/regions/R/subnetworks/my-subnet)",
                cfg.subnetwork, "leave SUBNETWORK empty for the network's subnetwork in the zone's region")
    if cfg.service_account is not None:
        require(bool(_EMAIL.fullmatch(cfg.service_account)), "SERVICE_ACCOUNT (--service-account)",
                "a service account's email such as job@my-proj.iam.gserviceaccount.com", cfg.service_account,
                "leave SERVICE_ACCOUNT empty for the Compute Engine default service account")
    bad_tags = [t for t in cfg.tags if not _TAG.fullmatch(t)]
    require(not bad_tags and len(cfg.tags) <= MAX_TAGS, "TAGS (--tags)",
            f"at most {MAX_TAGS} comma-separated network tags, each lowercase letters, digits and hyphens "
            "starting with a letter (RFC 1035)", bad_tags or f"{len(cfg.tags)} tags", "TAGS=tpu,train")
    require(cfg.slices >= 1, "SLICES (--slices)", "a whole number of slices >= 1", cfg.slices, "SLICES=2")
    if cfg.slices > 1:
        require(cfg.queued, "SLICES (--slices)",
                "QUEUED=1 with SLICES > 1 (gcloud creates several slices only through one queued resource)",
                f"SLICES={cfg.slices} QUEUED=0", f"make tpu-create QUEUED=1 SLICES={cfg.slices} ...")
        last = slice_names(cfg.name, cfg.slices)[-1]
        require(len(last) <= MAX_NAME, "TPU_NAME (--name)",
                f"a name short enough for its slices' names (NAME-0 .. NAME-{cfg.slices - 1}, at most {MAX_NAME})",
                last, "use a shorter TPU_NAME")
    require(0 < cfg.create_deadline_s < math.inf, "CREATE_DEADLINE (--create-deadline)",
            "a duration > 0 such as 2h", cfg.create_deadline_s, "CREATE_DEADLINE=2h")
    require(0 < cfg.stockout_backoff_s < math.inf, "--stockout-backoff", "a finite number of seconds > 0",
            cfg.stockout_backoff_s, "pass --stockout-backoff 60")
