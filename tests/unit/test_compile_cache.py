"""The persistent compilation cache's key on CPU (job/runtime/compile_cache.py, job/core/internals.py): the same
on every process of every node, so that process 0's entries serve them all, and still apart where the program
runs elsewhere (another layout of the devices over processes, another CPU)."""

from __future__ import annotations

import hashlib
import types
from pathlib import Path
from typing import Any

import numpy as np

from job.core import internals
from job.runtime import compile_cache

ACCELERATOR_CONFIG = f"{internals.JAX_CACHE_KEY}:_hash_accelerator_config"


def _devices(processes: int, each: int, platform: str = "cpu") -> Any:
    """Stand-ins for the job's devices, as every process sees them: `each` on each of `processes` processes."""
    return np.array([types.SimpleNamespace(platform=platform, device_kind=platform, process_index=p)
                     for p in range(processes) for _ in range(each)])


def _key(devices: Any) -> str:
    """What jax's cache key hashes of the devices, as the job has it."""
    hashed = hashlib.sha256()
    internals.lookup(ACCELERATOR_CONFIG)(hashed, devices)
    return hashed.hexdigest()


def test_a_cpu_programs_key_holds_the_devices_and_the_cpu_never_the_process_computing_it(tmp_path: Path) -> None:
    """jax's own key fingerprints this process's topology, which on CPU holds its own devices only (process 1's
    fingerprint is not process 0's): process 1, on its node or a spare, never loaded what process 0 wrote."""
    assert compile_cache.enable(str(tmp_path / "cache"), env={}) == str(tmp_path / "cache")
    two_by_two = _key(_devices(2, 2))
    assert two_by_two == _key(_devices(2, 2))  # from the devices alone: any process, any node of this CPU
    assert two_by_two != _key(_devices(1, 4))  # 2 processes x 2 devices is not 1 x 4
    internals.share_cpu_cache_keys("another CPU")
    try:
        assert _key(_devices(2, 2)) != two_by_two  # code compiled for one CPU is never loaded on another
    finally:
        internals.share_cpu_cache_keys(compile_cache.machine())
    assert _key(_devices(2, 2)) == two_by_two


def test_other_platforms_keep_jaxs_own_key(tmp_path: Path) -> None:
    compile_cache.enable(str(tmp_path / "cache"), env={})
    asked = []
    shared = internals.lookup(ACCELERATOR_CONFIG)
    shared.jax_own, jax_own = (lambda _hash, devices: asked.append(devices)), shared.jax_own
    try:
        tpus = _devices(2, 4, platform="tpu")
        _key(tpus)
    finally:
        shared.jax_own = jax_own
    assert len(asked) == 1 and asked[0] is tpus


def test_the_machine_is_the_first_processors_model_and_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon A\nflags\t\t: sse avx\n\nprocessor\t: 1\n"
                       "model name\t: Xeon B\nflags\t\t: sse\n")
    said = compile_cache.machine(str(cpuinfo)).split("\n")
    assert said[2:4] == ["Xeon A", "sse avx"]
    assert compile_cache.machine(str(tmp_path / "none")).split("\n")[2:] == ["", "", "", ""]
