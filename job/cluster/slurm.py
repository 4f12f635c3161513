"""Tasks started by Slurm's `srun` (directly, from sbatch, or through submitit).

Every task reads the same variables, so every task derives the same
coordinator (first node of the step) and port (from the job and step ids)
without talking to the others.
"""

from __future__ import annotations

from typing import ClassVar

from job.cluster.base import ClusterEnv, Env, read_int, read_port
from job.cluster.nodelist import expand_tasks_per_node, first_node

JOB_ID = "SLURM_JOB_ID"
STEP_ID = "SLURM_STEP_ID"
NODELIST = "SLURM_STEP_NODELIST"
NTASKS = "SLURM_NTASKS"
STEP_NTASKS = "SLURM_STEP_NUM_TASKS"
PROCID = "SLURM_PROCID"
LOCALID = "SLURM_LOCALID"
NODEID = "SLURM_NODEID"
TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
GPUS_PER_TASK = "SLURM_GPUS_PER_TASK"
PORT_OVERRIDE = "JOB_COORDINATOR_PORT"

# Ports in [61440, 65535]; 31 is coprime with 4096, so consecutive job ids
# never share a port and steps of one job land far apart.
_PORT_BASE = 61440
_PORT_SPAN = 4096

_FIX = "run the program under `srun` (inside sbatch or salloc), not directly in the batch script"


def slurm_port(job_id: int, step_id: int) -> int:
    return _PORT_BASE + (job_id * 31 + step_id) % _PORT_SPAN


class SlurmJob(ClusterEnv):
    kind: ClassVar[str] = "slurm"
    required: ClassVar[tuple[str, ...]] = (JOB_ID, NODELIST, NTASKS, PROCID, LOCALID)

    @classmethod
    def process_id(cls, env: Env) -> int:
        return read_int(env, PROCID, fix=_FIX)

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
            step = env.get(STEP_ID, "0")
            port = slurm_port(job_id, int(step) if step.isdigit() else 0)
        return f"{host}:{port}"

    @classmethod
    def local_device_ids(cls, env: Env) -> tuple[int, ...] | None:
        """One device per task when several tasks share a node (one task per GPU).

        When Slurm already bound GPUs to the task (``--gpus-per-task=N`` sets
        SLURM_GPUS_PER_TASK and narrows CUDA_VISIBLE_DEVICES) the task keeps all it sees.
        """
        tasks_here = cls._tasks_on_this_node(env)
        if tasks_here is None or tasks_here <= 1 or GPUS_PER_TASK in env:
            return None
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and len(visible.split(",")) <= 1:
            return None
        return (read_int(env, LOCALID, fix=_FIX),)

    @classmethod
    def _tasks_on_this_node(cls, env: Env) -> int | None:
        name = next((name for name in TASKS_PER_NODE if name in env), None)
        if name is None or NODEID not in env:
            return None
        counts = expand_tasks_per_node(env[name], name)
        node = read_int(env, NODEID, fix=_FIX)
        return counts[node] if node < len(counts) else None
