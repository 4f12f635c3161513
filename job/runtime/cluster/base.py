"""The record `job.initialize` returns, the interface every environment implements, and `Single`, no cluster."""

from __future__ import annotations

import abc
import dataclasses
import socket
from collections.abc import Mapping
from typing import ClassVar

from job.core import values
from job.core.errors import ConfigError, as_config_error

Env = Mapping[str, str]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
# What Slurm writes when a job's GPUs have no device files: no GPU is visible.
_NO_DEVICE_FILES = "NoDevFiles"


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Where this process runs and how it joins the others."""

    kind: str  # "local" | "slurm" | "tpu" | "manual" | "single"
    process_id: int  # this process's index, 0..num_processes-1
    num_processes: int  # how many processes form the JAX cluster
    coordinator_address: str | None  # "host:port" of process 0's service; None when single
    local_device_ids: tuple[int, ...] | None  # devices this process owns; None = all it sees

    @property
    def is_coordinator(self) -> bool:
        return self.process_id == 0

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1

    def summary(self) -> str:
        devices = "all" if self.local_device_ids is None else ",".join(map(str, self.local_device_ids))
        return (
            f"{self.kind} cluster: process {self.process_id} of {self.num_processes}, "
            f"coordinator {self.coordinator_address or '-'}, local devices {devices}"
        )


def read_int(env: Env, name: str, *, minimum: int = 0, fix: str) -> int:
    """An integer environment variable (plain digits, as job.core.values reads every count), or one clear
    error naming it."""
    raw = env.get(name)
    with as_config_error(name, expected=f"an integer >= {minimum}", found=raw, fix=fix):
        return values.whole(raw if raw is not None else "", minimum=minimum)


def read_port(env: Env, name: str, *, fix: str) -> int:
    port = read_int(env, name, minimum=1, fix=fix)
    if port > 65535:
        raise ConfigError(name, expected="a TCP port 1..65535", found=env[name], fix=fix)
    return port


def read_id_list(env: Env, name: str, *, fix: str) -> tuple[int, ...]:
    """``"0,1,3"`` -> ``(0, 1, 3)``."""
    raw = env[name]
    with as_config_error(name, expected="comma-separated device ids such as '0,1'", found=raw, fix=fix):
        return tuple(values.whole(part) for part in raw.split(","))


PORT_OVERRIDE = "JOB_COORDINATOR_PORT"  # a coordinator port of the job's choosing, where a backend picks one
SKIP_GPU_CHECK = "JOB_SKIP_GPU_CHECK"  # on: the GPUs are stand-ins (tests, the local Slurm): do not check them


def read_switch(env: Env, name: str, *, fix: str) -> bool:
    """An on/off environment variable, read as job.core.values reads every on/off word (unset: off)."""
    with as_config_error(name, fix=fix):
        return values.switch(env.get(name, ""))


def skips_gpu_check(env: Env) -> bool:
    """JOB_SKIP_GPU_CHECK: the Slurm submission (the tasks' CUDA interpreter) and the job's preflight (jax on
    the GPUs given) both honour it."""
    return read_switch(env, SKIP_GPU_CHECK, fix=f"set {SKIP_GPU_CHECK}=1 only where the GPUs are stand-ins, "
                       "or unset it")


def visible_gpus(env: Env) -> tuple[str, ...] | None:
    """The GPUs CUDA_VISIBLE_DEVICES lets this process see, as listed (ids, UUIDs or MIG names).

    None when it is unset (the process sees every GPU of the machine). CUDA stops at the
    first invalid entry, so ``""``, ``"-1"`` and Slurm's ``"NoDevFiles"`` mean none.
    """
    raw = env.get(CUDA_VISIBLE_DEVICES)
    if raw is None:
        return None
    seen: list[str] = []
    for entry in (part.strip() for part in raw.split(",")):
        if not entry or entry.startswith("-") or entry == _NO_DEVICE_FILES:
            break
        seen.append(entry)
    return tuple(seen)


class ClusterEnv(abc.ABC):
    """One kind of environment. Subclasses read variables; they never talk to peers.

    Every method takes the environment as a mapping so detection can be tested
    from recorded tables. `describe` validates and builds the record. The library asks
    the rest (processes on this host, the array index, the node's name, the task's GPUs)
    of the detected class through job.runtime.cluster; the defaults say "not known here".
    """

    kind: ClassVar[str]
    # Variables that must all be present for `is_present` (documentation and detection).
    required: ClassVar[tuple[str, ...]] = ()
    # Variables set for each process by whoever starts it: a rerun never replays them.
    per_process: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def is_present(cls, env: Env) -> bool:
        return all(name in env for name in cls.required)

    @classmethod
    @abc.abstractmethod
    def process_id(cls, env: Env) -> int: ...

    @classmethod
    @abc.abstractmethod
    def num_processes(cls, env: Env) -> int: ...

    @classmethod
    @abc.abstractmethod
    def coordinator_address(cls, env: Env) -> str | None: ...

    @classmethod
    def local_device_ids(cls, env: Env) -> tuple[int, ...] | None:
        return None

    @classmethod
    def describe(cls, env: Env) -> ClusterInfo:
        process_id = cls.process_id(env)
        num_processes = cls.num_processes(env)
        if not 0 <= process_id < num_processes:
            raise ConfigError(
                f"{cls.kind} process id",
                expected=f"0 <= process id < {num_processes} (the process count)",
                found=process_id,
                fix=f"check the {cls.kind} variables {', '.join(cls.required)}",
            )
        return ClusterInfo(
            kind=cls.kind,
            process_id=process_id,
            num_processes=num_processes,
            coordinator_address=cls.coordinator_address(env),
            local_device_ids=cls.local_device_ids(env),
        )

    @classmethod
    def processes_on_this_host(cls, env: Env) -> int | None:
        """How many of the job's processes run on this host; None when the environment does not say."""
        return None

    @classmethod
    def array_index(cls, env: Env) -> int | None:
        """This job's index in its job array (a sweep's run each); None outside an array."""
        return None

    @classmethod
    def node_name(cls, env: Env) -> str:
        """This host's name as the environment's scheduler knows it; its host name when it names none."""
        return socket.gethostname()

    @classmethod
    def task_gpus(cls, env: Env) -> int:
        """How many GPUs the environment gave this process, for when CUDA_VISIBLE_DEVICES lists none; 0: it
        says nothing."""
        return 0


class Single(ClusterEnv):
    """No cluster: one process, no distributed runtime (what detection falls back to)."""

    kind: ClassVar[str] = "single"

    @classmethod
    def process_id(cls, env: Env) -> int:
        return 0

    @classmethod
    def num_processes(cls, env: Env) -> int:
        return 1

    @classmethod
    def coordinator_address(cls, env: Env) -> None:
        return None
