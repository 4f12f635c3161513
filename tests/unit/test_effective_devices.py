"""The GPUs jax finally uses, after its own cluster detection, for every Slurm layout and the launcher.

`job.initialize` runs in a fresh interpreter (the unit process already has a jax
backend) with a recorded environment as its real `os.environ`. jax's runtime
service, client and preemption sync manager are inert stand-ins, so the real
`jax.distributed.initialize` / `State.initialize` runs, auto-detect branch
included, without a network. The harness reports `jax_cuda_visible_devices`:
what jax's CUDA backend will open ("all", or indices into CUDA_VISIBLE_DEVICES).

The "before" mode replays the old call (detection left on, local_device_ids
None) to show what this test guards against: jax's Slurm detection picks
[SLURM_LOCALID].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from tests.unit.test_cluster import ALL_FOUR, gpu_task

Env = dict[str, str]

HARNESS = textwrap.dedent(
    """
    import json, os, sys

    import jax
    from jax._src import distributed

    import job
    from job.core import internals


    class Inert:
        def __init__(self, *args, **kwargs): pass
        def connect(self): pass
        def shutdown(self): pass
        def initialize(self, client): pass


    distributed._jax.get_distributed_runtime_service = Inert
    distributed._jax.get_distributed_runtime_client = Inert
    distributed._jax.create_preemption_sync_manager = Inert
    current = jax.distributed.initialize


    def before(**kwargs):
        kwargs.pop("cluster_detection_method", None)
        return current(**{**kwargs, "local_device_ids": None})


    for case in json.load(sys.stdin):
        os.environ.clear()
        os.environ.update(case["env"])
        jax.config.update("jax_cuda_visible_devices", "all")
        jax.distributed.initialize = before if case["mode"] == "before" else current
        try:
            info = job.initialize(exit_on_uncaught=False)
            seen = {"kind": info.kind, "ids": info.local_device_ids, "started": jax.distributed.is_initialized(),
                    "jax": internals.cuda_visible_devices()}
        except Exception as exc:
            seen = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            jax.distributed.shutdown()
        print("SEEN " + json.dumps(seen), flush=True)
    if internals.backends_are_initialized():
        raise SystemExit("the harness started a jax backend")
    """
)


def effective_devices(cases: Sequence[tuple[Mapping[str, str], str]]) -> list[dict[str, Any]]:
    """For each (environment, mode "after" | "before"): what `job.initialize` and then jax decided.

    One interpreter runs every case; the runtime and jax's device setting are reset between them.
    """
    keep = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME", "TMPDIR") if k in os.environ}
    payload = json.dumps([{"env": {**keep, **env}, "mode": mode} for env, mode in cases])
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS], input=payload, capture_output=True, text=True, timeout=120,
        env={**keep, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, f"harness failed:\n{proc.stdout}\n{proc.stderr}"
    seen = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("SEEN ")]
    assert len(seen) == len(cases), proc.stdout + proc.stderr
    return seen


# (id, the task's environment, local_device_ids, jax_cuda_visible_devices, the same before: [SLURM_LOCALID])
LAYOUTS: tuple[tuple[str, Env, tuple[int, ...] | None, str, str], ...] = (
    ("a-one-task-per-node-all-gpus", gpu_task(1, 0, **ALL_FOUR), (0, 1, 2, 3), "0,1,2,3", "0"),
    ("b-gpus-per-task-2-srun", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_ON_NODE="4",
                                        SLURM_STEP_GPUS="2,3"), (0, 1), "0,1", "1"),
    ("b-gpus-per-task-2-sbatch", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_ON_NODE="4",
                                          SLURM_STEP_GPUS="2,3", SLURM_JOB_GPUS="0,1,2,3",
                                          SLURM_GPUS_PER_TASK="2"), (0, 1), "0,1", "1"),
    ("b-gpus-per-task-1-task-3", gpu_task(4, 3, CUDA_VISIBLE_DEVICES="3", SLURM_GPUS_ON_NODE="4",
                                          SLURM_STEP_GPUS="3"), (0,), "0", "3"),
    ("c-cgroups-gpus-per-task-2", gpu_task(2, 1, CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE="4",
                                           SLURM_STEP_GPUS="2,3"), (0, 1), "0,1", "1"),
    ("c-cgroups-gpus-per-task-1", gpu_task(4, 2, CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_ON_NODE="4",
                                           SLURM_STEP_GPUS="2", SLURM_GPUS_PER_TASK="1"), (0,), "0", "2"),
    ("d-four-tasks-share-four-gpus", gpu_task(4, 2, **ALL_FOUR), (2,), "2", "2"),
    ("d-two-tasks-share-four-gpus", gpu_task(2, 1, **ALL_FOUR), (2, 3), "2,3", "1"),
    ("e-cpu-one-task-per-node", gpu_task(1, 0), None, "all", "0"),
    ("no-gres-several-tasks", gpu_task(4, 3), (3,), "3", "3"),
    ("jax-local-device-ids-wins", {**gpu_task(4, 2, **ALL_FOUR), "JAX_LOCAL_DEVICE_IDS": "0,1"}, (0, 1), "0,1", "0,1"),
)


@pytest.fixture(scope="module")
def seen() -> dict[tuple[str, str], dict[str, Any]]:
    cases = [(name, env, mode) for name, env, *_ in LAYOUTS for mode in ("after", "before")]
    uneven = gpu_task(3, 1, **ALL_FOUR)
    cases += [("uneven", uneven, "after"), ("uneven-overridden", {**uneven, "JAX_LOCAL_DEVICE_IDS": "1"}, "after")]
    results = effective_devices([(env, mode) for _, env, mode in cases])
    return {(name, mode): result for (name, _, mode), result in zip(cases, results, strict=True)}


@pytest.mark.parametrize(("name", "ids", "jax_value"), [(r[0], r[2], r[3]) for r in LAYOUTS],
                         ids=[r[0] for r in LAYOUTS])
def test_jax_opens_the_gpus_this_slurm_task_was_given(
    seen: dict[tuple[str, str], dict[str, Any]], name: str, ids: tuple[int, ...] | None, jax_value: str
) -> None:
    result = seen[(name, "after")]
    assert result == {"kind": "slurm", "ids": None if ids is None else list(ids), "started": True, "jax": jax_value}


@pytest.mark.parametrize(("name", "before"), [(r[0], r[4]) for r in LAYOUTS], ids=[r[0] for r in LAYOUTS])
def test_before_jax_own_detection_picked_the_local_id(
    seen: dict[tuple[str, str], dict[str, Any]], name: str, before: str
) -> None:
    """The same harness with detection on and local_device_ids None: jax takes [SLURM_LOCALID]."""
    assert seen[(name, "before")]["jax"] == before


def test_the_old_failures_are_what_the_layouts_now_avoid(seen: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert seen[("a-one-task-per-node-all-gpus", "before")]["jax"] == "0"  # 1 GPU of the node's 4
    assert seen[("b-gpus-per-task-1-task-3", "before")]["jax"] == "3"  # device 3 of the 1 it sees


def test_an_uneven_split_stops_initialize_and_jax_local_device_ids_fixes_it(
    seen: dict[tuple[str, str], dict[str, Any]],
) -> None:
    assert seen[("uneven", "after")]["error"].startswith("ConfigError: Slurm GPUs per task: expected the 4 GPUs")
    assert seen[("uneven-overridden", "after")]["jax"] == "1"
