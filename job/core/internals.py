"""The one place the job reaches other libraries' private names (jax, orbax, tensorstore, submitit, Python's atexit).

Each name below is not part of its library's API and may move in any release. Every one
says the versions it was checked against (the ones requirements.lock pins: jax 0.10.2 on
Python 3.11, jax 0.12.0.1 on 3.12 and newer, orbax-checkpoint 0.12.8, tensorstore 0.1.86, submitit 1.5.4),
and tests/unit/test_internals.py looks each one up in the installed libraries: when a
version bump removes one, that test fails naming it and this file, instead of the job
silently losing what it did (a save that hangs, a GPU check that reads nothing).
No other module of job/ or deploy/ names a private module or attribute (the test checks).

Names are looked up when called, not when this module is imported: importing it
imports no backend.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
from collections.abc import Iterator
from types import CodeType
from typing import TYPE_CHECKING, Any
from unittest import mock

if TYPE_CHECKING:
    import jax

# Every private name used here, "module:attribute" (dotted attribute paths allowed).
JAX_XLA_BRIDGE = "jax._src.xla_bridge"
JAX_API = "jax._src.api"
JAX_DISTRIBUTED = "jax._src.distributed"
JAX_CLOUD_TPU = "jax._src.clusters.cloud_tpu_cluster"
JAX_CACHE_KEY = "jax._src.cache_key"
ORBAX_MULTIHOST = "orbax.checkpoint._src.multihost.multihost"
ORBAX_SIGNALING = "orbax.checkpoint._src.futures.signaling_client"
ORBAX_ASYNC = "orbax.checkpoint._src.checkpointers.async_checkpointer"
ORBAX_TS_UTILS = "orbax.checkpoint._src.serialization.tensorstore_utils"
ORBAX_SERIALIZATION_TYPES = "orbax.checkpoint._src.serialization.types"
ORBAX_ARRAY_METADATA = "orbax.checkpoint._src.metadata.array_metadata_store"
SUBMITIT_SLURM = "submitit.slurm.slurm"
# what sys.exit runs before the interpreter's teardown: every function atexit holds, last registered first
# (job.runtime.leaving runs them, then ends the process without the teardown); CPython 3.11.7, 3.12.1, 3.13.0
PYTHON_EXIT_HANDLERS = "atexit:_run_exitfuncs"
# submitit 1.5.4: the module each Slurm task runs (`python -m ...` FOLDER: unpickles and runs the job)
SUBMITIT_TASK_MODULE = "submitit.core._submit"
# submitit 1.5.4 (core/utils.py, temporary_save_path): a task writes its result to FOLDER/JOBID_TASK_result.pkl
# under this suffix first, and refuses to start where such a file is left ('A temporary saved file already exists')
SUBMITIT_HALF_WRITTEN = "_result.pkl.save_tmp"
# orbax-checkpoint 0.12.8: the function its background save thread runs (and logs a failure from)
ORBAX_SAVE_THREAD = f"{ORBAX_ASYNC}:_AsyncManager._thread_func"
PRIVATE = (
    PYTHON_EXIT_HANDLERS,
    # jax 0.10.2, 0.12.0.1: the CUDA_VISIBLE_DEVICES jax itself honours (flag or variable)
    f"{JAX_XLA_BRIDGE}:CUDA_VISIBLE_DEVICES",
    # jax 0.10.2, 0.12.0.1: whether a backend exists yet (jax.distributed.initialize must come first)
    f"{JAX_XLA_BRIDGE}:backends_are_initialized",
    # jax 0.10.2, 0.12.0.1: the coordination service client (key-value store and named barriers)
    f"{JAX_DISTRIBUTED}:global_state",
    # jax 0.10.2, 0.12.0.1: the preemption sync manager, whose notifier holds SIGTERM
    f"{JAX_DISTRIBUTED}:global_state.preemption_sync_manager",
    # clears the backends (a TPU runtime letting go of the chip: seconds), then shuts the distributed system down;
    # jax 0.10.2, 0.12.0.1: jax's exit handler
    f"{JAX_API}:clean_up",
    # what a persistent-cache key hashes of the devices (on CPU, this process's topology's fingerprint, which
    # differs from process to process), and the devices' kinds hashed (its fallback); jax 0.10.2, 0.12.0.1
    f"{JAX_CACHE_KEY}:_hash_accelerator_config",
    f"{JAX_CACHE_KEY}:_hash_devices",
    # jax 0.10.2, 0.12.0.1: jax's own Cloud TPU VM detection (the metadata server's worker list)
    f"{JAX_CLOUD_TPU}:running_in_cloud_tpu_vm",
    f"{JAX_CLOUD_TPU}:GceTpuCluster.is_env_present",
    f"{JAX_CLOUD_TPU}:GceTpuCluster.get_process_id",
    f"{JAX_CLOUD_TPU}:GceTpuCluster.get_process_count",
    f"{JAX_CLOUD_TPU}:GceTpuCluster.get_coordinator_address",
    # orbax-checkpoint 0.12.8: the cross-host sync it skips when this says so
    f"{ORBAX_MULTIHOST}:should_skip_process_sync",
    # orbax-checkpoint 0.12.8: the key-value store its async saves signal their stages through
    f"{ORBAX_SIGNALING}:get_signaling_client",
    f"{ORBAX_SIGNALING}:ThreadSafeKeyValueSignalingClient",
    ORBAX_SAVE_THREAD,
    # the tensorstore contexts its array handlers open (bench.ckpt.options turns their file sync off to measure
    # what the sync costs); orbax-checkpoint 0.12.8
    f"{ORBAX_TS_UTILS}:_BASE_TS_CONTEXT",
    f"{ORBAX_TS_UTILS}:_DEFAULT_OCDBT_TS_CONTEXT",
    # how an ArrayHandler's callback schedules an array's copy to the host (its default: every array at once, which
    # no memory bound reaches); orbax-checkpoint 0.12.8
    f"{ORBAX_SERIALIZATION_TYPES}:TransferPriority",
    # the store of per-array metadata orbax's default ArrayHandler writes (a typed PRNG key's implementation, which
    # plain orbax needs to give the key back typed); orbax-checkpoint 0.12.8
    f"{ORBAX_ARRAY_METADATA}:Store",
    # submitit 1.5.4: the batch script SlurmExecutor writes, for a dry run and the golden files
    f"{SUBMITIT_SLURM}:_make_sbatch_string",
    f"{SUBMITIT_TASK_MODULE}:submitit_main",
)
# jax 0.10.2, 0.12.0.1 (XLA's tsl/distributed_runtime/preemption/preemption_sync_manager.cc): the key-value
# store's key the preemption sync manager sets when its notifier hears a notice (a SIGTERM), for every task to see
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"
ORBAX_SAVE_THREAD_FUNCTION = ORBAX_SAVE_THREAD.rsplit(".", 1)[1]  # "_thread_func"
# tensorstore 0.1.86: the name of the threads of its pool, which copy and write a checkpoint's arrays
# (a C++ thread name, seen in /proc/self/task/*/comm; the test writes an array and looks for one)
TENSORSTORE_WRITER_THREADS = "ts_pool_worker"


def lookup(name: str) -> Any:
    """The object a "module:attribute.path" entry of PRIVATE names (ImportError or AttributeError if gone)."""
    module, _, attribute = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def skip_backend_teardown_at_exit() -> None:
    """Take jax's exit handler off the list `atexit` runs (jax imported already): the caller shuts the distributed
    system down itself (`jax.distributed.shutdown`) and leaves the backends to the process's end."""
    atexit.unregister(lookup(f"{JAX_API}:clean_up"))


def run_exit_handlers() -> None:
    """Every function `atexit` holds, last registered first, as the interpreter runs them at a normal exit (one
    that raises is printed and the next runs); run, they are off the list."""
    lookup(PYTHON_EXIT_HANDLERS)()


def orbax_ts_contexts() -> tuple[dict[str, Any], ...]:
    """The tensorstore context specs orbax's array handlers open their stores with (plain, and OCDBT's), which a
    caller may change before a save."""
    return (lookup(f"{ORBAX_TS_UTILS}:_BASE_TS_CONTEXT"), lookup(f"{ORBAX_TS_UTILS}:_DEFAULT_OCDBT_TS_CONTEXT"))


def orbax_array_metadata_store() -> Any:
    """A new store of orbax's per-array metadata, as its default ArrayHandler is given."""
    return lookup(f"{ORBAX_ARRAY_METADATA}:Store")()


def orbax_transfer_priority(name: str) -> Any:
    """orbax's TransferPriority of that name (SYNCHRONOUS, ASYNCHRONOUS_DEPRIORITIZED), which an ArrayHandler's
    callback gives for each array."""
    return lookup(f"{ORBAX_SERIALIZATION_TYPES}:TransferPriority")[name]


def cuda_visible_devices() -> str | None:
    """The CUDA_VISIBLE_DEVICES setting jax uses ('all' unless set), or None on a jax without it."""
    return lookup(f"{JAX_XLA_BRIDGE}:CUDA_VISIBLE_DEVICES").value


def backends_are_initialized() -> bool:
    """True once some JAX call has created a backend (too late for jax.distributed.initialize)."""
    return bool(lookup(f"{JAX_XLA_BRIDGE}:backends_are_initialized")())


def coordination_client() -> Any:
    """The distributed runtime's coordination service client, or None when it is not up."""
    return lookup(f"{JAX_DISTRIBUTED}:global_state").client


def preemption_sync_manager() -> Any:
    """jax's preemption sync manager (behind `multihost_utils.reached_preemption_sync_point`), or None where
    there is none: a single process, or the preemption service turned off. Where there is one, jax's notifier
    holds SIGTERM."""
    return lookup(f"{JAX_DISTRIBUTED}:global_state.preemption_sync_manager")


def gce_tpu_cluster() -> Any:
    """jax's Cloud TPU VM cluster class (process id, count and coordinator from the metadata server)."""
    return lookup(f"{JAX_CLOUD_TPU}:GceTpuCluster")


def in_cloud_tpu_vm() -> bool:
    """jax's own test for a Cloud TPU VM with a worker list (imports no backend)."""
    return bool(lookup(f"{JAX_CLOUD_TPU}:running_in_cloud_tpu_vm")) and gce_tpu_cluster().is_env_present()


def submitit_sbatch_script(command: str, folder: str | os.PathLike[str], **parameters: object) -> str:
    """The batch script submitit's SlurmExecutor submits for `command` and these parameters."""
    return lookup(f"{SUBMITIT_SLURM}:_make_sbatch_string")(command=command, folder=folder, **parameters)


def is_orbax_save_thread(code: CodeType) -> bool:
    """True for the code object of the function orbax's background save thread runs."""
    return code.co_name == ORBAX_SAVE_THREAD_FUNCTION and "orbax" in code.co_filename


def share_cpu_cache_keys(machine: str) -> None:
    """jax's persistent-cache key of a program on CPU devices made the same on every process: on CPU jax hashes
    this process's topology, which holds only its own devices (process 1's fingerprint is not process 0's), and
    only process 0 writes entries, so no other process ever loads one. Hashed instead, as jax does where it cannot
    fingerprint a topology: the devices' kinds, the process holding each (2 processes x 2 devices is not 1 x 4),
    and `machine` (this host's CPU: the compiled code is for it). Other platforms keep jax's key. Once a process."""
    module = importlib.import_module(JAX_CACHE_KEY)
    fingerprinted = module._hash_accelerator_config
    if getattr(fingerprinted, "job_machine", None) == machine:
        return
    fingerprinted = getattr(fingerprinted, "jax_own", fingerprinted)
    by_kind = module._hash_devices

    def same_on_every_process(hash_obj: Any, accelerators: Any) -> None:
        if not all(device.platform == "cpu" for device in accelerators.flat):
            same_on_every_process.jax_own(hash_obj, accelerators)  # type: ignore[attr-defined]
            return
        by_kind(hash_obj, accelerators)
        hash_obj.update(",".join(str(device.process_index) for device in accelerators.flat).encode())
        hash_obj.update(machine.encode())

    same_on_every_process.jax_own = fingerprinted  # type: ignore[attr-defined]
    same_on_every_process.job_machine = machine  # type: ignore[attr-defined]
    setattr(module, "_hash_accelerator_config", same_on_every_process)  # noqa: B010 - jax's, replaced


@contextlib.contextmanager
def one_host_view(local_devices: list[jax.Device]) -> Iterator[None]:
    """Inside: jax says process 0 of 1 with `local_devices` as every device, orbax skips its
    cross-host sync and signals its async stages through a store of this process's own.
    Patched for every thread of the process; everything is put back on exit."""
    store = lookup(f"{ORBAX_SIGNALING}:ThreadSafeKeyValueSignalingClient")()
    with (
        mock.patch("jax.process_index", return_value=0),
        mock.patch("jax.process_count", return_value=1),
        mock.patch("jax.devices", return_value=local_devices),
        mock.patch(f"{ORBAX_MULTIHOST}.should_skip_process_sync", return_value=True),
        mock.patch(f"{ORBAX_SIGNALING}.get_signaling_client", return_value=store),
    ):
        yield


__all__ = [
    "PRIVATE", "SUBMITIT_TASK_MODULE", "TENSORSTORE_WRITER_THREADS", "backends_are_initialized", "coordination_client",
    "cuda_visible_devices", "gce_tpu_cluster", "in_cloud_tpu_vm", "is_orbax_save_thread", "lookup",
    "one_host_view", "run_exit_handlers", "share_cpu_cache_keys", "skip_backend_teardown_at_exit",
    "submitit_sbatch_script",
]
