"""Whether this machine has a TPU chip, read from sysfs without starting libtpu (whose start alone took 13 s on a
v5e VM, a test's worth of the tier's one sitting)."""

from __future__ import annotations

from pathlib import Path

GOOGLE = "0x1ae0"  # the PCI vendor id of a TPU chip
# the PCI device ids of TPU chips, as jax's own start-up finds them (jax/_src/hardware_utils.py): v3, v4, v5p, v5e,
# v6e and TPU7x
TPU_DEVICE_IDS = frozenset({"0x0027", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def tpu_chips(devices: Path = Path("/sys/bus/pci/devices")) -> list[str]:
    """The PCI addresses of this machine's TPU chips (a VM may list more than the chips it was given: the v5e VM
    with one chip listed four)."""
    found = []
    for vendor in sorted(devices.glob("*/vendor")):
        try:
            if (vendor.read_text().strip() == GOOGLE
                    and (vendor.parent / "device").read_text().strip() in TPU_DEVICE_IDS):
                found.append(vendor.parent.name)
        except OSError:  # a device removed while it is read
            continue
    return found
