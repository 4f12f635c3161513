"""Environment detection: which cluster is this process part of?

Detection order (first match wins), overridable with ``JOB_CLUSTER``:

1. ``local``  - our launcher, ``python -m job.launch`` (JOB_LAUNCH_* variables)
2. ``slurm``  - a task started by ``srun`` (SLURM_JOB_ID, SLURM_STEP_NODELIST, ...)
3. ``tpu``    - a TPU pod worker with TPU_WORKER_ID / TPU_WORKER_HOSTNAMES
4. ``tpu``    - a GCE TPU VM (metadata server, through jax's own detection)
5. ``single`` - none of the above: one process, no distributed runtime

The launcher comes first so ``srun python -m job.launch ...`` inside an
allocation behaves like the launcher says. What the library asks of a cluster
beyond `detect` (processes on this host, a job array's index, the node's name,
the task's GPUs) it asks the class `environment` finds:

    environment(os.environ).processes_on_this_host(os.environ)
"""

from __future__ import annotations

import os

from job.core.errors import ConfigError
from job.runtime.cluster.base import ClusterEnv, ClusterInfo, Env, Single
from job.runtime.cluster.local import LocalLauncher
from job.runtime.cluster.slurm import SlurmJob
from job.runtime.cluster.tpu import CloudTpuVm, TpuPod

DETECTION_ORDER: tuple[type[ClusterEnv], ...] = (LocalLauncher, SlurmJob, TpuPod, CloudTpuVm)
FORCE_KIND = "JOB_CLUSTER"
SINGLE = Single.describe({})
KINDS = tuple(dict.fromkeys([*(cls.kind for cls in DETECTION_ORDER), SINGLE.kind]))  # what JOB_CLUSTER may force
PER_PROCESS = frozenset(name for cls in DETECTION_ORDER for name in cls.per_process)  # never replayed by a rerun


def environment(env: Env) -> type[ClusterEnv]:
    """The class of the environment this process runs in (JOB_CLUSTER may force one), `Single` when none is
    present; no network, no JAX backend."""
    forced = env.get(FORCE_KIND)
    if forced is not None and forced not in KINDS:
        raise ConfigError(
            FORCE_KIND, expected=f"one of {', '.join(KINDS)}", found=forced,
            fix=f"unset {FORCE_KIND} to detect the environment, or pick a listed kind",
        )
    if forced == Single.kind:
        return Single
    for cls in DETECTION_ORDER:
        if forced is not None and cls.kind != forced:
            continue
        if cls.is_present(env):
            return cls
    if forced is not None:
        needed = " or ".join(
            "{" + ", ".join(c.required) + "}" for c in DETECTION_ORDER if c.kind == forced and c.required
        )
        raise ConfigError(
            f"{FORCE_KIND}={forced}", expected=f"the {forced} variables {needed} to be set",
            found="some of them missing", fix=f"run under {forced}, or unset {FORCE_KIND}",
        )
    return Single


def detect(env: Env) -> ClusterInfo:
    """The cluster this environment describes (no network, no JAX backend); SINGLE itself when none."""
    found = environment(env)
    return SINGLE if found is Single else found.describe(env)


def node_name(env: Env = os.environ) -> str:
    """This host's name as its scheduler knows it, else its host name."""
    return environment(env).node_name(env)


__all__ = ["DETECTION_ORDER", "ClusterEnv", "ClusterInfo", "detect", "environment", "node_name", "SINGLE", "KINDS",
           "PER_PROCESS"]
