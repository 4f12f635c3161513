"""The TPU tier's probe (tests/chip/probe.py): a TPU chip found among the PCI devices from sysfs alone."""

from __future__ import annotations

from pathlib import Path

from tests.chip.probe import tpu_chips


def _device(root: Path, address: str, vendor: str, device: str) -> None:
    (root / address).mkdir(parents=True)
    (root / address / "vendor").write_text(f"{vendor}\n")
    (root / address / "device").write_text(f"{device}\n")


def test_a_v5e_chip_is_found_among_other_pci_devices_and_nothing_else_is(tmp_path: Path) -> None:
    _device(tmp_path, "0000:00:04.0", "0x1af4", "0x1000")  # a virtio network card
    _device(tmp_path, "0000:00:05.0", "0x1ae0", "0x0042")  # Google's, not a TPU
    assert tpu_chips(tmp_path) == []
    _device(tmp_path, "0000:00:08.0", "0x1ae0", "0x0063")  # a v5e chip, as the VM lists it
    _device(tmp_path, "0000:00:09.0", "0x1ae0", "0x005e")  # a v4 chip
    assert tpu_chips(tmp_path) == ["0000:00:08.0", "0000:00:09.0"]


def test_a_device_without_its_id_file_is_skipped(tmp_path: Path) -> None:
    _device(tmp_path, "0000:00:08.0", "0x1ae0", "0x0063")
    (tmp_path / "0000:00:09.0").mkdir()
    (tmp_path / "0000:00:09.0" / "vendor").write_text("0x1ae0\n")
    assert tpu_chips(tmp_path) == ["0000:00:08.0"]
    assert tpu_chips(tmp_path / "missing") == []  # no sysfs at all (a container): no chip
