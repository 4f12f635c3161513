"""Tasks started by Slurm's `srun` (directly, from sbatch, or through submitit).

Every task reads the same variables, so every task derives the same
coordinator (first node of the step) and port (from the job and step ids)
without talking to the others.
"""

from __future__ import annotations

from typing import ClassVar

from job.core import values
from job.core.errors import ConfigError
from job.runtime.cluster.base import (
    CUDA_VISIBLE_DEVICES,
    PORT_OVERRIDE,
    ClusterEnv,
    Env,
    read_int,
    read_port,
    visible_gpus,
)
from job.runtime.cluster.nodelist import expand_tasks_per_node, first_node

JOB_ID = "SLURM_JOB_ID"
STEP_ID = "SLURM_STEP_ID"
NODELIST = "SLURM_STEP_NODELIST"
NTASKS = "SLURM_NTASKS"
STEP_NTASKS = "SLURM_STEP_NUM_TASKS"
PROCID = "SLURM_PROCID"
LOCALID = "SLURM_LOCALID"
NODEID = "SLURM_NODEID"
NODENAME = "SLURMD_NODENAME"  # the node as Slurm names it (every node of a test cluster has one host name)
TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"  # a job array element's index (sbatch --array)
_GPUS_PER_TASK = "SLURM_GPUS_PER_TASK"  # set in a task only inside an sbatch that asked for it
_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"  # how many GPUs the step has on this node
_STEP_GPUS = "SLURM_STEP_GPUS"  # the ids of this task's GPUs (all the step's, when Slurm does not bind)
_JOB_GPUS = "SLURM_JOB_GPUS"  # the ids of the job's GPUs on this node

# Ports in [61440, 65535]; 31 is coprime with 4096, so consecutive job ids
# never share a port and steps of one job land far apart.
_PORT_BASE = 61440
_PORT_SPAN = 4096

_FIX = "run the program under `srun` (inside sbatch or salloc), not directly in the batch script"


def _count_ids(ids: str) -> int:
    """``"0,1,3"`` -> 3."""
    return len([part for part in ids.split(",") if part.strip()])


def slurm_port(job_id: int, step_id: int) -> int:
    return _PORT_BASE + (job_id * 31 + step_id) % _PORT_SPAN


class SlurmJob(ClusterEnv):
    kind: ClassVar[str] = "slurm"
    required: ClassVar[tuple[str, ...]] = (JOB_ID, NODELIST, NTASKS, PROCID, LOCALID)
    per_process: ClassVar[tuple[str, ...]] = (PROCID, LOCALID, NODEID, NODENAME, _STEP_GPUS)

    @classmethod
    def process_id(cls, env: Env) -> int:
        return read_int(env, PROCID, fix=_FIX)

    @classmethod
    def node_name(cls, env: Env) -> str:
        """This task's node as Slurm names it (SLURMD_NODENAME), else the host's name."""
        return env.get(NODENAME) or super().node_name(env)

    @classmethod
    def num_processes(cls, env: Env) -> int:
        name = STEP_NTASKS if STEP_NTASKS in env else NTASKS
        return read_int(env, name, minimum=1, fix=_FIX)

    @classmethod
    def coordinator_address(cls, env: Env) -> str:
        host = first_node(env[NODELIST], NODELIST)
        if PORT_OVERRIDE in env:
            port = read_port(env, PORT_OVERRIDE, fix="unset it, or give a free port such as 61440")
        else:
            job_id = read_int(env, JOB_ID, fix=_FIX)
            port = slurm_port(job_id, _step(env))
        return f"{host}:{port}"

    @classmethod
    def local_device_ids(cls, env: Env) -> tuple[int, ...] | None:
        """The GPUs this task uses, as indices into the GPUs it sees (after CUDA_VISIBLE_DEVICES).

        - CUDA_VISIBLE_DEVICES lists no GPU (``""``, ``NoDevFiles``) -> None.
        - It is unset (a CPU job, or a GPU node without GRES): several tasks on the node ->
          ``(SLURM_LOCALID,)``, jax's own habit; otherwise None (every device).
        - It lists one GPU, or Slurm bound GPUs to the task (SLURM_GPUS_PER_TASK is set, or
          the task sees fewer GPUs than the step has on its node, `gpus_on_node`), or the
          task is alone on its node -> every GPU it sees.
        - Otherwise the node's tasks share the GPUs they all see: as many GPUs as tasks ->
          ``(SLURM_LOCALID,)``; a multiple -> the task's contiguous block; anything else ->
          ConfigError; tasks on the node that cannot be counted -> ``(SLURM_LOCALID,)``.
        """
        visible = visible_gpus(env)
        tasks_here = cls.processes_on_this_host(env)
        if visible is None:
            return (cls._local_id(env),) if tasks_here is not None and tasks_here > 1 else None
        seen = len(visible)
        if seen == 0:
            return None
        on_node = cls.gpus_on_node(env)
        bound = _GPUS_PER_TASK in env or (on_node is not None and seen < on_node)
        if bound or seen == 1 or tasks_here == 1:
            return tuple(range(seen))
        local_id = cls._local_id(env)
        if tasks_here is None:
            return (local_id,)
        if local_id >= tasks_here:
            raise ConfigError(LOCALID, expected=f"0..{tasks_here - 1} (the tasks on this node)", found=local_id,
                              fix=_FIX)
        if seen % tasks_here:
            raise ConfigError(
                "Slurm GPUs per task",
                expected=f"the {seen} GPUs that each of this node's {tasks_here} tasks sees "
                         f"(CUDA_VISIBLE_DEVICES={env[CUDA_VISIBLE_DEVICES]}) to split evenly between them",
                found=f"{seen} GPUs for {tasks_here} tasks",
                fix="ask Slurm for whole GPUs per task (--gpus-per-task=K), or for as many tasks per node as "
                    "GPUs (or a divisor), or set JAX_LOCAL_DEVICE_IDS in each task",
            )
        share = seen // tasks_here
        return tuple(range(local_id * share, (local_id + 1) * share))

    @classmethod
    def gpus_on_node(cls, env: Env) -> int | None:
        """How many GPUs the step has on this node: SLURM_GPUS_ON_NODE, else the length of
        SLURM_JOB_GPUS; None when Slurm says neither."""
        if _GPUS_ON_NODE in env:
            return read_int(env, _GPUS_ON_NODE, fix="unset it, or run under srun with GPUs (--gpus-per-node=N)")
        return _count_ids(env[_JOB_GPUS]) if _JOB_GPUS in env else None

    @classmethod
    def task_gpus(cls, env: Env) -> int:
        """How many GPUs Slurm gave this task: SLURM_STEP_GPUS, else `gpus_on_node`; 0 for none."""
        if _STEP_GPUS in env:
            return _count_ids(env[_STEP_GPUS])
        return cls.gpus_on_node(env) or 0

    @classmethod
    def _local_id(cls, env: Env) -> int:
        return read_int(env, LOCALID, fix=_FIX)

    @classmethod
    def array_index(cls, env: Env) -> int | None:
        """SLURM_ARRAY_TASK_ID: this element's index in its `sbatch --array`; None outside an array."""
        if ARRAY_TASK_ID not in env:
            return None
        return read_int(env, ARRAY_TASK_ID, fix="let Slurm set it (sbatch --array), or unset it")

    @classmethod
    def processes_on_this_host(cls, env: Env) -> int | None:
        """The tasks on this node, from the step's tasks per node and SLURM_NODEID; when every node runs
        the same number of tasks, SLURM_NODEID is not needed."""
        name = next((name for name in TASKS_PER_NODE if name in env), None)
        if name is None:
            return None
        counts = expand_tasks_per_node(env[name], name)
        if NODEID not in env:
            return counts[0] if len(set(counts)) == 1 else None
        node = read_int(env, NODEID, fix=_FIX)
        return counts[node] if node < len(counts) else None


def _step(env: Env) -> int:
    """SLURM_STEP_ID as a number; 0 when it is unset or not one (the batch script's own steps)."""
    try:
        return values.whole(env.get(STEP_ID, "0"))
    except values.BadValue:
        return 0
