"""The numpy baseline the checkpoint benchmarks (bench.scale, bench.tiers) compare with: one `.npy` per addressable
shard of every array, named `LEAF-SHARD.npy`, and read back onto the same devices and shardings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def write(folder: Path, leaves: list[Any], *, sync: bool = False) -> None:
    """Every shard of `leaves` with `np.save` into `folder` (made); with `sync`, each file fsynced."""
    folder.mkdir()
    for i, x in enumerate(leaves):
        for j, shard in enumerate(x.addressable_shards):
            with open(folder / f"{i}-{j}.npy", "wb") as fh:
                np.save(fh, np.asarray(shard.data))
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())


def read(folder: Path, leaves: list[Any]) -> list[Any]:
    """The arrays `write` saved, each shard `np.load`ed onto its device, laid out as `leaves` are."""
    import jax  # a benchmark's worker imports jax after setting its device count

    arrays = []
    for i, x in enumerate(leaves):
        shards = [jax.device_put(np.load(folder / f"{i}-{j}.npy"), shard.device)
                  for j, shard in enumerate(x.addressable_shards)]
        arrays.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards))
    return arrays
