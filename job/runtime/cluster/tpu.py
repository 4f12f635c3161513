"""Cloud TPU pod slices: one process per TPU VM worker.

`TpuPod` reads the variables a TPU VM's runtime exposes on GKE (and that our
gcloud launcher and simulator export): TPU_WORKER_ID and the worker list, plus
the MEGASCALE_* variables of multislice jobs. The worker list is looked up as
jax 0.12 looks it up: the file named by TPU_PROCESS_ADDRESSES_PATH, then
TPU_PROCESS_ADDRESSES, then TPU_WORKER_HOSTNAMES. `CloudTpuVm` covers plain
GCE TPU VMs, whose facts live in the metadata server: there jax's own
detection is asked.
"""

from __future__ import annotations

from typing import ClassVar

from job.core import internals
from job.core.errors import ConfigError
from job.runtime.cluster.base import PORT_OVERRIDE, ClusterEnv, Env, read_int, read_port

WORKER_ID = "TPU_WORKER_ID"
ADDRESSES_PATH = "TPU_PROCESS_ADDRESSES_PATH"  # a file holding the list (newer GKE runtimes; jax >= 0.11 reads it)
HOSTNAMES = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
NUM_SLICES = "MEGASCALE_NUM_SLICES"
SLICE_ID = "MEGASCALE_SLICE_ID"
MEGASCALE_COORDINATOR = "MEGASCALE_COORDINATOR_ADDRESS"
DEFAULT_PORT = 8482  # the port jax's own TPU detection uses

_FIX = "let the TPU runtime (or `make tpu-pod`) set TPU_WORKER_ID and TPU_WORKER_HOSTNAMES"


def _without_port(entry: str) -> str:
    """``host:8476`` -> ``host``; ``[fd00::1]:8476`` -> ``[fd00::1]``; a bare IPv6 address stays."""
    entry = entry.strip()
    if entry.startswith("["):
        return entry[: entry.index("]") + 1] if "]" in entry else entry
    return entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry


class TpuPod(ClusterEnv):
    kind: ClassVar[str] = "tpu"
    required: ClassVar[tuple[str, ...]] = (WORKER_ID, "TPU_WORKER_HOSTNAMES")
    per_process: ClassVar[tuple[str, ...]] = (WORKER_ID, SLICE_ID)

    @classmethod
    def is_present(cls, env: Env) -> bool:
        return WORKER_ID in env and any(name in env for name in (ADDRESSES_PATH, *HOSTNAMES))

    @classmethod
    def _worker_list(cls, env: Env) -> tuple[str, str]:
        """(where it came from, the comma-separated list)."""
        if ADDRESSES_PATH in env:
            path = env[ADDRESSES_PATH]
            where = f"{ADDRESSES_PATH}={path}"
            try:
                with open(path, encoding="utf-8") as f:
                    return where, f.read().strip()
            except OSError as exc:
                raise ConfigError(ADDRESSES_PATH, expected="a readable file of comma-separated worker addresses",
                                  found=f"{path} ({exc.strerror})", fix=f"unset {ADDRESSES_PATH}, or {_FIX}") from exc
        name = next(name for name in HOSTNAMES if name in env)
        return name, env[name]

    @classmethod
    def workers(cls, env: Env) -> list[str]:
        where, listed = cls._worker_list(env)
        hosts = [_without_port(entry) for entry in listed.split(",")]
        if not all(hosts):
            raise ConfigError(where, expected="comma-separated worker host names", found=listed or "''", fix=_FIX)
        return hosts

    @classmethod
    def _slices(cls, env: Env) -> tuple[int, int]:
        fix = "set MEGASCALE_NUM_SLICES and MEGASCALE_SLICE_ID together, or neither"
        num = read_int(env, NUM_SLICES, minimum=1, fix=fix) if NUM_SLICES in env else 1
        slice_id = read_int(env, SLICE_ID, fix=fix) if SLICE_ID in env else 0
        if slice_id >= num:
            raise ConfigError(SLICE_ID, expected=f"a slice id below {num}", found=slice_id, fix=fix)
        return num, slice_id

    @classmethod
    def process_id(cls, env: Env) -> int:
        worker = read_int(env, WORKER_ID, fix=_FIX)
        per_slice = len(cls.workers(env))
        if worker >= per_slice:
            raise ConfigError(
                WORKER_ID, expected=f"a worker id below {per_slice} (the number of worker hosts)",
                found=worker, fix=_FIX,
            )
        return worker + cls._slices(env)[1] * per_slice

    @classmethod
    def num_processes(cls, env: Env) -> int:
        return len(cls.workers(env)) * cls._slices(env)[0]

    @classmethod
    def coordinator_address(cls, env: Env) -> str:
        host = _without_port(env.get(MEGASCALE_COORDINATOR) or cls.workers(env)[0])
        port = _port_override(env) or DEFAULT_PORT
        return f"{host}:{port}"


class CloudTpuVm(ClusterEnv):
    """A GCE TPU VM: the worker list is in the metadata server, which jax reads."""

    kind: ClassVar[str] = "tpu"

    @classmethod
    def is_present(cls, env: Env) -> bool:
        return internals.in_cloud_tpu_vm()

    @classmethod
    def _jax_env(cls):  # noqa: ANN206 - jax private class
        return internals.gce_tpu_cluster()

    @classmethod
    def process_id(cls, env: Env) -> int:
        return cls._jax_env().get_process_id()

    @classmethod
    def num_processes(cls, env: Env) -> int:
        return cls._jax_env().get_process_count()

    @classmethod
    def coordinator_address(cls, env: Env) -> str:
        port = _port_override(env)
        return cls._jax_env().get_coordinator_address(timeout_secs=60,
                                                      override_coordinator_port=str(port) if port else None)


def _port_override(env: Env) -> int | None:
    """JOB_COORDINATOR_PORT, read as every port is; None when unset."""
    return read_port(env, PORT_OVERRIDE, fix="unset it or give a free port") if PORT_OVERRIDE in env else None
