"""The local launcher's coordinator port: free, and below the kernel's ephemeral range (job/core/ports.py)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import portpicker

from job.core import ports


class Scripted(random.Random):
    """randrange answers these ports in turn."""

    def __init__(self, *answers: int) -> None:
        super().__init__(0)
        self.answers = list(answers)
        self.asked: list[tuple[int, int]] = []

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:  # noqa: ARG002
        self.asked.append((start, stop))
        return self.answers.pop(0)


def test_a_port_is_free_and_below_the_ephemeral_range() -> None:
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low and portpicker.is_port_free(port)


def test_a_port_in_use_is_passed_over() -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = next(p for p in range(20000, 21000) if portpicker.is_port_free(p))
        rng = Scripted(taken, free)
        assert ports.free_port(rng, ephemeral_from=40000) == free
    assert rng.asked == [(ports.LOWEST, 40000)] * 2


def test_a_range_that_leaves_no_room_falls_back_to_portpicker() -> None:
    rng = Scripted()
    port = ports.free_port(rng, ephemeral_from=ports.LOWEST + 10)
    assert rng.asked == [] and portpicker.is_port_free(port)


def test_the_ephemeral_range_is_read_from_the_kernel_or_linux_default(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ports.ephemeral_low(tmp_path / "range") == 40000
    assert ports.ephemeral_low(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL_LOW
    (tmp_path / "bad").write_text("")
    assert ports.ephemeral_low(tmp_path / "bad") == ports.DEFAULT_EPHEMERAL_LOW
