"""jax's persistent compilation cache, on by default: a requeued or repeated run skips compilation.

    python -m job train                              # ~/.cache/job/jax (or $XDG_CACHE_HOME/job/jax)
    python -m job train --compile-cache /shared/jax  # a folder every node shares is fine too
    python -m job train --run-dir gs://B/run1        # gs://B/.cache/job/jax: one folder every TPU worker reads
    JOB_COMPILE_CACHE=none python -m job train       # off

Which folder, first match wins: `--compile-cache`, $JOB_COMPILE_CACHE,
$JAX_COMPILATION_CACHE_DIR (jax's own variable), then, for a gs:// run
directory, the folder `.cache/job/jax` of its bucket (jax reads and writes a
gs:// cache through etils.epath, as the run directory is written), else the
per-user cache folder. The default is under the user's cache folder, not /tmp:
it survives a reboot and the end of a Slurm job, and other users' files cannot
be in the way. jax writes entries only from process 0, so concurrent processes
and nodes may share it; it writes each in place, not atomically: a process that
reads an entry while it is written warns "Error reading persistent compilation
cache entry" and compiles that program itself, and the run goes on
(JAX_COMPILATION_CACHE_MAX_SIZE, for a local folder, adds jax's file lock around
each read and write, and evicts the least recently used entries above that size).
It must be set before the first
compilation (`enable` is called right after `job.initialize`). Every compiled
program is cached, not only those taking over jax's default 1 s, unless the
JAX_PERSISTENT_CACHE_* variables say otherwise.

On CPU every process loads what process 0 wrote: jax's own key hashes a CPU
process's topology, which holds that process's devices only, so process 1's key
was never process 0's and process 1 (on its node, or on a spare node after a
restart) compiled every program again while process 0 waited for it at the
barrier "step compiled". The key hashes instead the devices' kinds, the process
holding each, and the host's CPU (`machine`: its model and flags), the same on
every process of nodes alike (job/core/internals.py, `share_cpu_cache_keys`).

Each process counts its own hits and misses (`CacheEvents`); `record` puts every
process's counts into the run's summary.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from job.core import internals
from job.core.storage import bucket_of, is_remote

log = logging.getLogger("job.train")

OFF_WORD = "none"  # --compile-cache (or its variables) set to this: no cache
BUCKET_FOLDER = ".cache/job/jax"  # the default cache of a gs:// run directory, in its bucket


def resolve(setting: str, env: Mapping[str, str], run_dir: str = "") -> str | None:
    """The cache folder to use, or None when the cache is off."""
    for value in (setting, env.get("JOB_COMPILE_CACHE", ""), env.get("JAX_COMPILATION_CACHE_DIR", "")):
        if value:
            return None if value.strip().lower() == OFF_WORD else os.path.expanduser(value)
    if is_remote(run_dir):
        return f"gs://{bucket_of(run_dir)}/{BUCKET_FOLDER}"
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(Path(base) / "job" / "jax")


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This host's CPU, as a CPU program's cache key holds it: its architecture, and its first processor's model
    and feature flags where `cpuinfo` says them (Linux), the compiled code being for those features."""
    said: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                name, sep, value = line.partition(":")
                if not sep:
                    if said:
                        break  # the first processor's lines only
                    continue
                said.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    found = [said.get(name, "") for name in ("model name", "flags", "Features", "CPU part")]
    return "\n".join([platform.machine(), platform.processor(), *found])


def enable(setting: str = "", env: Mapping[str, str] | None = None, run_dir: str = "") -> str | None:
    """Point jax at the cache folder (or switch the cache off); returns the folder or None."""
    env = os.environ if env is None else env
    folder = resolve(setting, env, run_dir)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if "://" not in folder:
        try:
            os.makedirs(folder, exist_ok=True)
            usable = os.access(folder, os.W_OK | os.X_OK)
        except OSError:
            usable = False
        if not usable:  # a cache only saves time: a folder it cannot write must not stop the job
            log.warning("compilation cache: expected a folder this user can write, found %s is not; running "
                        "without the cache. Fix: pass --compile-cache DIR (or JOB_COMPILE_CACHE=DIR) naming a "
                        "writable folder, or --compile-cache none", folder)
            jax.config.update("jax_enable_compilation_cache", False)
            return None
    jax.config.update("jax_enable_compilation_cache", True)
    internals.share_cpu_cache_keys(machine())  # on CPU, process 0's entries serve every process
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in env:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


class CacheEvents:
    """Counts this process's persistent-cache lookups and hits while it is entered (jax.monitoring events).

    A miss is a lookup without a hit: jax's own miss event comes with a cache write, which only
    process 0 makes, so it would count no miss on any other process."""

    LOOKUP, HIT = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        self.lookups = 0
        self.hits = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    def _on_event(self, event: str, **_: object) -> None:
        if event == self.LOOKUP:
            self.lookups += 1
        elif event == self.HIT:
            self.hits += 1

    def __enter__(self) -> CacheEvents:
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)


def summary_entry(folder: str | None, counts: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The summary's `compile_cache` entry from every process's (hits, misses, seconds compiling ahead),
    by process index: process 0's `hits` and `misses` at the top (as before), every process's under
    `by_process`."""
    hits, misses, seconds = ([row[i] for row in counts] for i in range(3))
    return {"dir": folder, "hits": int(hits[0]) if counts else 0, "misses": int(misses[0]) if counts else 0,
            "by_process": {"hits": [int(h) for h in hits], "misses": [int(m) for m in misses],
                           "compile_s": [round(float(s), 3) for s in seconds]}}
