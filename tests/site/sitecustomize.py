"""Started by every Python process the tests launch (tests/conftest.py puts this folder on PYTHONPATH).

jax's persistent compilation cache never serves a process other than 0 on CPU: the cache key hashes
the CPU topology's fingerprint, which differs from process to process, and only process 0 writes.
Every launched run's processes 1..n-1 then compile every program afresh, most of a short run's time
on two cores. With JOB_TESTS_CACHE_KEYS=shared (tests/conftest.py sets it; a test measuring the real
cache passes JOB_TESTS_CACHE_KEYS=real), the key of a CPU program hashes its devices' kinds instead,
as jax does where it cannot fingerprint a topology, and the process holding each: the same on every
process, so each process loads what process 0 wrote, and a program for another layout of the devices
over processes has its own key. The program and its compile options, device assignment included, are
in the key as before.

With JOB_TESTS_COMPILE=fast (tests/conftest.py sets it) XLA compiles CPU programs with LLVM's optimizations
off (--xla_backend_optimization_level=0): the tests' models are tiny, their programs' compilation is most
of a run's CPU time and their execution little of it (measured: a cold 2 x 2 run of the small LM, 24 s of
CPU at XLA's default, 14 s with it). XLA's graph passes (fusion, sharding, buffer assignment) are the same;
results may differ from the default's in the last bits, so a test comparing a run in a container (which
this file does not reach) with one on the host passes JOB_TESTS_COMPILE=default to the host's.
Only the tests' processes are changed; the job itself runs jax as it is.

With JOB_TESTS_WARM set (tests/conftest.py), a process that `warm_program` names runs in a warm child instead
(warmstart.py); every other process goes on as started.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType

MODULE = "jax._src.cache_key"
OPTIMIZATION_LEVEL = "--xla_backend_optimization_level"  # JOB_TESTS_COMPILE=fast sets it to 0


def _share_cpu_keys(module: ModuleType) -> None:
    fingerprinted = getattr(module, "_hash_accelerator_config", None)
    if fingerprinted is None or not hasattr(module, "_hash_devices"):  # jax changed: slower tests, not broken ones
        return                                                          # (tests/unit/test_internals.py says so)

    def same_on_every_process(hash_obj, accelerators) -> None:  # noqa: ANN001 - jax's own arguments
        if all(device.platform == "cpu" for device in accelerators.flat):
            module._hash_devices(hash_obj, accelerators)
            # and which process holds each device: a program of 2 processes x 2 devices is not one of 1 x 4
            hash_obj.update(",".join(str(device.process_index) for device in accelerators.flat).encode())
        else:
            fingerprinted(hash_obj, accelerators)

    module._hash_accelerator_config = same_on_every_process


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches jax's cache-key module right after it is first executed (jax is imported lazily)."""

    def find_spec(self, name: str, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _share_cpu_keys(module)

        spec.loader.exec_module = exec_module
        return spec


def warm_program() -> tuple[str, str] | None:
    """("module", "job") or ("script", PATH) when this process is one the tests start warm (warmstart.py), else None:
    `python -m job ...`, or a script of tests/scenarios or tests/user_tasks, with no interpreter option. Decided
    here, before warmstart's own imports, so that every other process the tests start pays nothing for it."""
    argv = getattr(sys, "orig_argv", [])
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] == "job":  # the launcher (job.launch) imports no jax: cold
        return ("module", argv[2])
    if len(argv) >= 2 and argv[1].endswith(".py") and not argv[1].startswith("-"):
        parts = os.path.realpath(argv[1]).split(os.sep)
        if len(parts) > 2 and parts[-3] == "tests" and parts[-2] in ("scenarios", "user_tasks"):
            return ("script", argv[1])
    return None


def without_fast_compile(xla_flags: str) -> str:
    """XLA_FLAGS without what JOB_TESTS_COMPILE=fast adds (tests/container/conftest.py: a container compiles
    as XLA does by default)."""
    return " ".join(flag for flag in xla_flags.split() if not flag.startswith(f"{OPTIMIZATION_LEVEL}="))


if __name__ == "sitecustomize":  # started by Python; imported by a conftest for the names above, it does nothing
    if os.environ.get("JOB_TESTS_CACHE_KEYS") == "shared":
        sys.meta_path.insert(0, _AfterImport())
    if os.environ.get("JOB_TESTS_COMPILE") == "fast" and OPTIMIZATION_LEVEL not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPTIMIZATION_LEVEL}=0".strip()
    # last: from here the program runs in a warm child (tests/site/warmstart.py)
    if os.environ.get("JOB_TESTS_WARM") and (_warm := warm_program()) is not None:
        import warmstart

        warmstart.hand_over(_warm)
