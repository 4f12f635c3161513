"""Cloud TPU accelerator types: how many worker hosts (VMs) a slice has.

    from deploy.tpu.accelerators import parse_accelerator
    parse_accelerator("v4-32").hosts        # 4

An accelerator type is ``GENERATION-SIZE``. What SIZE counts depends on the
generation, which is why this is a table and not one formula:

| generation | SIZE counts                | hosts                         | examples                          |
|------------|----------------------------|-------------------------------|-----------------------------------|
| v2, v3     | TensorCores (8 per host)   | SIZE / 8                      | v3-8 = 1, v3-32 = 4               |
| v4, v5p    | TensorCores (2 per chip)   | SIZE / 8 (4 chips per host)   | v4-8 = 1, v4-32 = 4, v5p-16 = 2   |
| v5litepod  | chips (v5e)                | 1 if SIZE <= 8, else SIZE / 4 | v5litepod-8 = 1, v5litepod-16 = 4 |
| v6e        | chips                      | 1 if SIZE <= 8, else SIZE / 4 | v6e-8 = 1, v6e-32 = 8             |

The gcloud simulator in tests/tpu uses this same table, so a ``v4-32`` slice
runs the job as 4 simulated workers. An unknown generation is an error that
names the known ones; add a row to GENERATIONS to support a new one.
"""

from __future__ import annotations

import dataclasses
import re

from job.errors import ConfigError

_FORM = re.compile(r"^([a-z][a-z0-9]*)-([1-9][0-9]*)$")
_EXAMPLES = "v4-32, v5p-16, v5litepod-16 or v6e-8"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One row of the table."""

    name: str  # the accelerator type's prefix, e.g. "v4"
    counts: str  # what SIZE counts: "cores" or "chips"
    runtime: str  # default TPU software version (`--version` / `--runtime-version`)
    sizes: str  # the valid sizes, in words, for error messages

    def hosts(self, size: int) -> int | None:
        """Worker hosts of a slice of this size; None when no such slice exists."""
        if self.counts == "cores":  # 2 cores per chip, 4 chips per host
            return size // 8 if size % 8 == 0 else None
        if size in (1, 4, 8):  # single-host v5e / v6e machines
            return 1
        return size // 4 if size % 4 == 0 and 16 <= size <= 256 else None


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v2", "cores", "tpu-ubuntu2204-base", "a multiple of 8 TensorCores (v2-8, v2-32, ...)"),
        Generation("v3", "cores", "tpu-ubuntu2204-base", "a multiple of 8 TensorCores (v3-8, v3-32, ...)"),
        Generation("v4", "cores", "tpu-ubuntu2204-base", "a multiple of 8 TensorCores (v4-8, v4-16, v4-32, ...)"),
        Generation("v5p", "cores", "v2-alpha-tpuv5", "a multiple of 8 TensorCores (v5p-8, v5p-16, ...)"),
        Generation("v5litepod", "chips", "v2-alpha-tpuv5-lite", "1, 4, 8 or a multiple of 4 from 16 to 256 chips"),
        Generation("v6e", "chips", "v2-alpha-tpuv6e", "1, 4, 8 or a multiple of 4 from 16 to 256 chips"),
    )
}


@dataclasses.dataclass(frozen=True)
class Accelerator:
    type: str  # as gcloud spells it, e.g. "v4-32"
    generation: Generation  # the table row
    size: int  # the number after the dash
    hosts: int  # worker VMs of the slice: one JAX process each

    @property
    def default_runtime(self) -> str:
        return self.generation.runtime


def parse_accelerator(text: str, *, what: str = "ACCELERATOR (--accelerator)") -> Accelerator:
    """``"v4-32"`` -> Accelerator(hosts=4); a clear ConfigError for anything else."""
    match = _FORM.fullmatch(text or "")
    if match is None:
        raise ConfigError(
            what, expected=f"GENERATION-SIZE, such as {_EXAMPLES}", found=text,
            fix="write the type as gcloud does, with a dash and a number: ACCELERATOR=v4-32",
        )
    name, size = match.group(1), int(match.group(2))
    generation = GENERATIONS.get(name)
    if generation is None:
        raise ConfigError(
            what, expected=f"a known TPU generation ({', '.join(GENERATIONS)})", found=text,
            fix="use one of those, or add the generation to GENERATIONS in deploy/tpu/accelerators.py",
        )
    hosts = generation.hosts(size)
    if hosts is None:
        raise ConfigError(
            what, expected=f"a {name} size of {generation.sizes}", found=text,
            fix=f"pick an existing {name} slice size",
        )
    return Accelerator(type=text, generation=generation, size=size, hosts=hosts)
