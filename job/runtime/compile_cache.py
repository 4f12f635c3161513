"""jax's persistent compilation cache, on by default: a requeued or repeated run skips compilation.

    python -m job train                              # ~/.cache/job/jax (or $XDG_CACHE_HOME/job/jax)
    python -m job train --compile-cache /shared/jax  # a folder every node shares is fine too
    JOB_COMPILE_CACHE=none python -m job train       # off

Which folder, first match wins: `--compile-cache`, $JOB_COMPILE_CACHE,
$JAX_COMPILATION_CACHE_DIR (jax's own variable), then the per-user cache
folder. The default is under the user's cache folder, not /tmp: it survives a
reboot and the end of a Slurm job, and other users' files cannot be in the
way. jax writes entries atomically, so concurrent processes and nodes may
share it. It must be set before the first compilation (`enable` is called
right after `job.initialize`). Every compiled program is cached, not only those
taking over jax's default 1 s, unless the JAX_PERSISTENT_CACHE_* variables say
otherwise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("job.train")

OFF = "none"


def resolve(setting: str, env: Mapping[str, str]) -> str | None:
    """The cache folder to use, or None when the cache is off."""
    for value in (setting, env.get("JOB_COMPILE_CACHE", ""), env.get("JAX_COMPILATION_CACHE_DIR", "")):
        if value:
            return None if value.strip().lower() == OFF else os.path.expanduser(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(Path(base) / "job" / "jax")


def enable(setting: str = "", env: Mapping[str, str] | None = None) -> str | None:
    """Point jax at the cache folder (or switch the cache off); returns the folder or None."""
    import jax

    env = os.environ if env is None else env
    folder = resolve(setting, env)
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
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in env:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


class CacheEvents:
    """Counts jax's persistent-cache hits and misses while it is entered (jax.monitoring events)."""

    HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0

    def _on_event(self, event: str, **_: object) -> None:
        if event == self.HIT:
            self.hits += 1
        elif event == self.MISS:
            self.misses += 1

    def __enter__(self) -> CacheEvents:
        import jax

        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        import jax

        jax.monitoring.unregister_event_listener(self._on_event)
