"""Environment detection: which cluster is this process part of?

Detection order (first match wins), overridable with ``JOB_CLUSTER``:

1. ``local``  - our launcher, ``python -m job.launch`` (JOB_LAUNCH_* variables)
2. ``slurm``  - a task started by ``srun`` (SLURM_JOB_ID, SLURM_STEP_NODELIST, ...)
3. ``tpu``    - a TPU pod worker with TPU_WORKER_ID / TPU_WORKER_HOSTNAMES
4. ``tpu``    - a GCE TPU VM (metadata server, through jax's own detection)
5. ``single`` - none of the above: one process, no distributed runtime

The launcher comes first so ``srun python -m job.launch ...`` inside an
allocation behaves like the launcher says.
"""

from __future__ import annotations

import os
import socket

from job.core.errors import ConfigError
from job.runtime.cluster.base import ClusterEnv, ClusterInfo, Env
from job.runtime.cluster.local import LocalLauncher
from job.runtime.cluster.slurm import SlurmJob
from job.runtime.cluster.tpu import CloudTpuVm, TpuPod

DETECTION_ORDER: tuple[type[ClusterEnv], ...] = (LocalLauncher, SlurmJob, TpuPod, CloudTpuVm)
FORCE_KIND = "JOB_CLUSTER"
SINGLE = ClusterInfo(kind="single", process_id=0, num_processes=1, coordinator_address=None, local_device_ids=None)
KINDS = tuple(dict.fromkeys([*(cls.kind for cls in DETECTION_ORDER), SINGLE.kind]))  # what JOB_CLUSTER may force


def detect(env: Env) -> ClusterInfo:
    """The cluster this environment describes (no network, no JAX backend)."""
    forced = env.get(FORCE_KIND)
    if forced is not None and forced not in KINDS:
        raise ConfigError(
            FORCE_KIND, expected=f"one of {', '.join(KINDS)}", found=forced,
            fix=f"unset {FORCE_KIND} to detect the environment, or pick a listed kind",
        )
    if forced == "single":
        return SINGLE
    for cls in DETECTION_ORDER:
        if forced is not None and cls.kind != forced:
            continue
        if cls.is_present(env):
            return cls.describe(env)
    if forced is not None:
        needed = " or ".join(
            "{" + ", ".join(c.required) + "}" for c in DETECTION_ORDER if c.kind == forced and c.required
        )
        raise ConfigError(
            f"{FORCE_KIND}={forced}", expected=f"the {forced} variables {needed} to be set",
            found="some of them missing", fix=f"run under {forced}, or unset {FORCE_KIND}",
        )
    return SINGLE


def node_name(env: Env = os.environ) -> str:
    """This host's name as its scheduler knows it (Slurm's node name), else its host name."""
    return SlurmJob.node_name(env) or socket.gethostname()


__all__ = ["DETECTION_ORDER", "ClusterEnv", "ClusterInfo", "detect", "node_name", "SINGLE", "KINDS"]
