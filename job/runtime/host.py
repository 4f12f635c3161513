"""What this host offers a process: memory it may take and cores it may use, within its cgroup's limits.

    host_available()   # bytes: MemAvailable, capped by what the cgroup's memory limit still allows
    usable_cores()     # cores: the CPU affinity, capped by the cgroup's cpu.max quota

Read from /proc and /sys/fs/cgroup (v2, and v1's memory controller); every reader takes its paths as
arguments so tests describe a host in a folder. None where nothing can be read: the caller decides.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63


def mem_available(meminfo: str) -> int | None:
    """MemAvailable of a /proc/meminfo text, in bytes; None when it is not there."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            if number.isdigit():
                return int(number) * (1024 if unit.strip() == "kB" else 1)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _stat(text: str | None, name: str) -> int:
    """A field of a cgroup memory.stat text (0 when absent)."""
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return 0


def cgroup_room(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """What this process's cgroup memory limit still allows (limit - usage + reclaimable cache), the
    tightest over its parents; None when no limit is set or none can be read (cgroup v2, or v1's memory)."""
    rooms = []
    for line in (_read(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2].lstrip("/")
        if controllers == "":  # v2: memory.max in the group's folder and in each parent's
            folder = root / path
            while folder.is_relative_to(root):
                limit = (_read(folder / "memory.max") or "max").strip()
                usage = (_read(folder / "memory.current") or "").strip()
                if limit.isdigit() and usage.isdigit():
                    cache = _stat(_read(folder / "memory.stat"), "inactive_file")
                    rooms.append(int(limit) - int(usage) + cache)
                folder = folder.parent
        elif "memory" in controllers.split(","):  # v1: memory.stat holds the tightest limit of the hierarchy
            folder = root / "memory" / path
            folder = folder if folder.is_dir() else root / "memory"  # a namespaced mount shows its own group
            stat = _read(folder / "memory.stat")
            tightest = _stat(stat, "hierarchical_memory_limit")
            usage = (_read(folder / "memory.usage_in_bytes") or "").strip()
            if 0 < tightest < _UNLIMITED and usage.isdigit():
                rooms.append(tightest - int(usage) + _stat(stat, "total_inactive_file"))
    return max(0, min(rooms)) if rooms else None


def host_available() -> int | None:
    """Bytes the host can give this process's group: MemAvailable, capped by its cgroup's limit; None
    when /proc/meminfo does not read."""
    text = _read(MEMINFO)
    available = mem_available(text) if text is not None else None
    if available is None:
        return None
    limited = cgroup_room()
    return available if limited is None else min(available, limited)


def cgroup_cpus(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The cpu.max quota of this process's cgroup (v2) in cores; None when there is none."""
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):
            try:
                quota, period = (_read(root / line[3:].lstrip("/") / "cpu.max") or "").split()
            except ValueError:  # none, or not "QUOTA PERIOD"
                return None
            return None if quota == "max" else int(quota) / int(period)
    return None


def usable_cores() -> float:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's cpu.max quota."""
    cores: float = len(os.sched_getaffinity(0))
    quota = cgroup_cpus()
    return min(cores, quota) if quota else cores


__all__ = ["CGROUP_ROOT", "MEMINFO", "PROC_CGROUP", "cgroup_cpus", "cgroup_room", "host_available", "mem_available",
           "usable_cores"]
