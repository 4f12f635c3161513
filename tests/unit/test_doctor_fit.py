"""The doctor's fit line (deploy/tpu/fit.py) compiles the run's train step once for each target: under --rule fsdp
the slice's own step, compiled for its fit, is the small side of the bytes-per-chip comparison (job/train/fit.py
`scaling`), not compiled again. The slice and the larger one are CPU devices here (libtpu makes a TPU's where it is
installed: tests/tpu/test_fit.py), disjoint, so each compile is known by its program and its devices."""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import jax
import pytest

from deploy.tpu import fit as tpu_fit
from deploy.tpu.accelerators import Accelerator
from deploy.tpu.config import TpuConfig
from job.train import fit

FIRST = {"v5litepod-1": 0, "v5litepod-4": 4}  # the first CPU device of each type's fake slice: no two share one


def cpu_target(accel: Accelerator, slices: int = 1) -> fit.Target:
    """A Target of CPU devices standing for the slice of `accel` (up to the 8 the unit tests see)."""
    cpus = jax.devices("cpu")
    first = FIRST.get(accel.type, 0)
    found = tuple(cpus[first:first + accel.size])
    return fit.Target(accel.type, f"{len(found)} chips (cpu)", found)


def counting_compiles(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[tuple[str, frozenset[int]]]:
    """Every ahead-of-time compile from now on, counted by (its program's sha256, the ids of its devices)."""
    compiles: collections.Counter[tuple[str, frozenset[int]]] = collections.Counter()
    original = jax.stages.Lowered.compile

    def compile(self: jax.stages.Lowered, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        compiled = original(self, *args, **kwargs)
        devices = frozenset(device.id for sharding in jax.tree.leaves(compiled.input_shardings)
                            for device in sharding.device_set)
        compiles[(hashlib.sha256(self.as_text().encode()).hexdigest(), devices)] += 1
        return compiled

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    return compiles


def test_the_fit_line_under_fsdp_compiles_the_slices_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tpu_fit, "libtpu_version", lambda: "0.0-cpu")
    monkeypatch.setattr(tpu_fit, "target", cpu_target)
    cfg = TpuConfig(name="pod-x", zone="us-central2-b", accelerator="v5litepod-1",
                    job_args=("train", "--steps", "10", "--rule", "fsdp", "--data.global-batch", "8"))
    check = tpu_fit.prepare(cfg)  # imports what compiles the step, as the doctor does before its threads
    compiles = counting_compiles(monkeypatch)
    line = check().line()
    assert line.startswith("ok    fit: the train step needs "), line
    twice = {key: count for key, count in compiles.items() if count > 1}
    assert not twice, f"compiled more than once for the same devices: {twice} (every compile: {dict(compiles)})"
    steps = {devices for (_, devices) in compiles if len(devices) > 1}
    assert steps == {frozenset(range(4, 8))}, compiles  # the larger slice's step compiled too: the scaling's side
