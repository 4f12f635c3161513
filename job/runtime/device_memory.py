"""What a device's memory is: the one place the library asks it (the fit check, remat auto's choice and the
out-of-memory error all come here; a save holds none of it).

    device_memory.limit(device)       # bytes it may use: its runtime's bytes_limit; None where it does not say
    device_memory.compiler_limit(device)   # what its compiler says it holds (a device compiled for ahead of time)

A running GPU or TPU reports `memory_stats()`; a CPU does not (its arrays are the host's); a device made by
libtpu for compiling ahead of time has no runtime, and its compiler names what it holds only when a program is
too big for it (`compiler_limit`). What a program needs is the compiler's too: `from_compiled` reads
`compiled.memory_analysis()`, `from_message` XLA's out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

GIB = 1 << 30
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(?:i?B)?"
# (needed, available) as each of XLA's messages gives them; XLA writes sizes with 1024-based units ("15.75G")
_SAID = (
    re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)"),  # TPU, at compile time
    re.compile(rf"Attempting to allocate {_SIZE}\. That was not possible\. There are {_SIZE} free"),  # TPU runtime
    # TPU, loading a program whose temporaries no longer fit beside what is in use (seen on a v5e chip:
    # "RuntimeProgramAllocationFailure: Attempting to reserve 13.81G at the bottom of memory ... 12.33G free")
    re.compile(rf"Attempting to reserve {_SIZE} at the bottom of memory.*?{_SIZE} free", re.DOTALL),
)
# TPU, at compile time, the other form: "Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 6.69M." (the use capped
# at the capacity), then "Total hbm usage >= 16.01G:" and the largest allocations
_USED = re.compile(rf"Used {_SIZE} of {_SIZE} hbm")
_TOTAL = re.compile(rf"Total hbm usage >= {_SIZE}")
_EXCEEDED = re.compile(rf"Exceeded hbm capacity by {_SIZE}")
_ALLOCATE = re.compile(r"trying to allocate ([0-9]+) bytes")  # the allocator of a GPU (or a CPU): one buffer
SHOWN = 200  # characters of the compiler's message in an error: its first sentence, the figures in it
# a program no device holds (the outer product of 2**19 float32s, sorted: 1 TiB of temporaries): the compiler's
# refusal names what one device has
_TOO_BIG = 1 << 19


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Need:
    """The memory of one program per device, as far as it is known."""

    fits: bool  # False: the compiler or the allocator ran out
    needed: int | None  # bytes per device: memory_analysis()'s peak where it compiled, else the compiler's figure
    available: int | None  # bytes per device: the compiler's figure, or the device's memory limit; None: unknown
    said: str = ""  # where it did not fit: the compiler's (or the allocator's) words, shortened
    # bytes per device the program reserves beyond its arguments when it loads (temporaries, code, new outputs):
    # what must stay free between steps for it to run again; None: not known
    program: int | None = None

    def found(self, what: str = "") -> str:
        """'29.26 GiB per device (compiling the train step: RESOURCE_EXHAUSTED: ...)'."""
        figure = "an unknown amount of memory" if self.needed is None else f"{gib(self.needed)} per device"
        words = ": ".join(part for part in (what, self.said) if part)
        return f"{figure} ({words})" if words else figure


def is_out_of_memory(exc: BaseException) -> bool:
    """XLA's error for a program that does not fit (at compile time, at a run, or as it loads: the TPU runtime's
    RuntimeProgramAllocationFailure, which reaches the caller as a ValueError), not any other error."""
    text = str(exc)
    if isinstance(exc, ValueError) and not isinstance(exc, jax.errors.JaxRuntimeError):
        return "RuntimeProgramAllocationFailure" in text
    return isinstance(exc, jax.errors.JaxRuntimeError) and (
        text.startswith("RESOURCE_EXHAUSTED") or "CompileTimeHbmOom" in text or "Out of memory" in text
        or "RuntimeProgramAllocationFailure" in text)


def from_message(text: str, available: int | None = None) -> Need:
    """What XLA's out-of-memory message says: the bytes needed and available where it names them (`available`,
    the device's own limit, where it does not)."""
    for pattern in _SAID:
        match = pattern.search(text)
        if match:
            return Need(False, _bytes(*match.group(1, 2)), _bytes(*match.group(3, 4)), _shortened(text))
    used, total, over = _USED.search(text), _TOTAL.search(text), _EXCEEDED.search(text)
    if used:
        capacity = _bytes(*used.group(3, 4))
        needed = (_bytes(*total.group(1, 2)) if total else capacity + _bytes(*over.group(1, 2)) if over
                  else _bytes(*used.group(1, 2)))
        return Need(False, needed, capacity, _shortened(text))
    one = _ALLOCATE.search(text)
    return Need(False, int(one.group(1)) if one else None, available, _shortened(text))


def _shortened(text: str) -> str:
    first = " ".join(text.split("\n", 1)[0].split())
    return first if len(first) <= SHOWN else first[:SHOWN - 3] + "..."


def from_compiled(compiled: jax.stages.Compiled, available: int | None) -> Need:
    """A program that compiled: its peak bytes per device (XLA's memory_analysis), against `available`."""
    stats = compiled.memory_analysis()
    if stats is None:
        return Need(True, None, available)
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    program = (stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
               + stats.generated_code_size_in_bytes)
    needed = peak or stats.argument_size_in_bytes + program
    return Need(available is None or needed <= available, needed, available, program=program)


def _stats(device: Any) -> dict[str, int]:
    try:
        return dict(device.memory_stats() or {})
    except Exception:  # noqa: BLE001 - a device without the call, or a compile-only one: not known
        return {}


def limit(device: Any) -> int | None:
    """The bytes `device` may use, as its runtime says (`memory_stats()["bytes_limit"]`); None where it does not."""
    found = _stats(device).get("bytes_limit")
    return int(found) if found else None


def compiler_limit(device: Any) -> int | None:
    """The bytes one device holds, as its compiler says when a program is too big for it; None if it does not
    say (a CPU device, another message)."""
    mesh = jax.sharding.Mesh(np.array([device]), ("one",))
    small = jax.ShapeDtypeStruct((_TOO_BIG,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    try:
        jax.jit(lambda x: jnp.sort(jnp.outer(x, x), axis=0)[:1]).lower(small).compile()
    except jax.errors.JaxRuntimeError as exc:
        return from_message(str(exc)).available if is_out_of_memory(exc) else None
    return None


__all__ = ["GIB", "Need", "compiler_limit", "from_compiled", "from_message", "gib", "is_out_of_memory",
           "limit"]
