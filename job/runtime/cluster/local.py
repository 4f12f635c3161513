"""Processes started by our own launcher, `python -m job.launch`."""

from __future__ import annotations

from typing import ClassVar

from job.runtime.cluster.base import ClusterEnv, Env, read_int

COORDINATOR = "JOB_LAUNCH_COORDINATOR"
NUM_PROCESSES = "JOB_LAUNCH_NUM_PROCESSES"
PROCESS_ID = "JOB_LAUNCH_PROCESS_ID"

_FIX = "start the program with `python -m job.launch -n N -- ...` instead of setting JOB_LAUNCH_* by hand"


class LocalLauncher(ClusterEnv):
    kind: ClassVar[str] = "local"
    required: ClassVar[tuple[str, ...]] = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
    per_process: ClassVar[tuple[str, ...]] = required

    @classmethod
    def process_id(cls, env: Env) -> int:
        return read_int(env, PROCESS_ID, fix=_FIX)

    @classmethod
    def num_processes(cls, env: Env) -> int:
        return read_int(env, NUM_PROCESSES, minimum=1, fix=_FIX)

    @classmethod
    def coordinator_address(cls, env: Env) -> str:
        return env[COORDINATOR]

    @classmethod
    def processes_on_this_host(cls, env: Env) -> int:
        """The launcher starts every process of the job on its own machine."""
        return cls.num_processes(env)

    @staticmethod
    def variables(coordinator: str, num_processes: int, process_id: int) -> dict[str, str]:
        """What the launcher exports to each child: the inverse of detection."""
        return {
            COORDINATOR: coordinator,
            NUM_PROCESSES: str(num_processes),
            PROCESS_ID: str(process_id),
        }
