"""A free TCP port for a server this machine starts (the local launcher's coordinator), below the kernel's
ephemeral range.

portpicker's pick asks the kernel for a free port, and the kernel answers from its ephemeral range
(net.ipv4.ip_local_port_range, 32768-60999 by default): the range it also gives every outbound connection.
Between the pick and the server's bind, any process's next connection may be given that port, and the server
then fails with "Address already in use" (seen with two test workers' runs on one host). A port below the
range is never given to a connection; only a program that binds it on purpose can take it.

    free_port()    -> 23817    (free on TCP and UDP now; portpicker's pick where the range leaves no room)
"""

from __future__ import annotations

import random
from pathlib import Path

import portpicker

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default, where the file cannot be read
LOWEST = 15000  # as portpicker's own random ports: above the well-known and most registered services' ports
TRIES = 100


def ephemeral_low(path: Path = EPHEMERAL_RANGE) -> int:
    """The lowest port the kernel gives outbound connections."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_port(rng: random.Random | None = None, *, ephemeral_from: int | None = None) -> int:
    """A TCP port free on this machine now, in [LOWEST, the ephemeral range's start); portpicker's pick when
    that leaves fewer than 1,000 ports or none of TRIES random ones is free."""
    low = ephemeral_low() if ephemeral_from is None else ephemeral_from
    rng = rng or random.Random()
    if low - LOWEST >= 1000:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, low)
            if portpicker.is_port_free(port):
                return port
    return portpicker.pick_unused_port()


__all__ = ["ephemeral_low", "free_port"]
