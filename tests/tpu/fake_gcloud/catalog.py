"""What each simulated zone offers: its accelerator types and TPU runtime versions.

The table follows Cloud TPU's "regions and zones" page (2026): v4 only in
us-central2-b, v5p in us-central1-a and us-east5-a, v5e (v5litepod) in
us-central1-a, us-west4-a, ..., so a request the real cloud refuses (v5p-8 in
us-central2-b) is refused here too. A zone not in the table offers nothing (the
real API lists nothing for a zone without TPUs). Tests may replace a zone's
offer with `state.set_offer` (its control file), e.g. to withdraw a runtime
version.

Every runtime version is offered in every TPU zone (the real API lists them
all; whether one suits the generation is found only when the VM boots).
"""

from __future__ import annotations

# zone -> generations with slices there
ZONES: dict[str, tuple[str, ...]] = {
    "us-central1-a": ("v2", "v3", "v5p", "v5litepod"),
    "us-central1-b": ("v2", "v3", "v6e"),
    "us-central2-b": ("v4",),
    "us-east1-d": ("v6e",),
    "us-east5-a": ("v5p", "v5litepod", "v6e"),
    "us-south1-a": ("v5litepod",),
    "us-west4-a": ("v5litepod",),
    "europe-west4-a": ("v2", "v3", "v5litepod", "v6e"),
}
# The sizes listed for each generation (the number in the type's name: TensorCores up to v5p, chips after);
# the simulator's own table, not the launcher's, so that a mistake there is not copied here.
_CORES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_CHIPS = (1, 4, 8, 16, 32, 64, 128, 256)
SIZES: dict[str, tuple[int, ...]] = {"v2": _CORES[:7], "v3": _CORES[:9], "v4": _CORES, "v5p": _CORES,
                                     "v5litepod": _CHIPS, "v6e": _CHIPS}
RUNTIME_VERSIONS = (
    "tpu-ubuntu2204-base", "tpu-vm-base", "tpu-vm-v4-base", "tpu-vm-tf-2.18.0-pjrt", "tpu-vm-tf-2.18.0-pod-pjrt",
    "v2-alpha-tpuv5", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e",
)


def accelerator_types(zone: str) -> list[str]:
    """Every accelerator type the zone offers, as the API names them (v4-8, v4-16, ...)."""
    return [f"{name}-{size}" for name in ZONES.get(zone, ()) for size in SIZES[name]]


def runtime_versions(zone: str) -> list[str]:
    return list(RUNTIME_VERSIONS) if zone in ZONES else []
