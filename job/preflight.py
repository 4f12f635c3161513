"""Preflight: after init and before training, every process's facts side by side.

Each process reports its library versions, device kind and count, a hash of
this package's code, its config, and whether it can write the run directory.
The facts are gathered onto every process; if anything differs (or a process
cannot write), process 0 prints one report with each process's value and
every process stops before the first step. A mixed-version or mis-configured
cluster then fails in seconds with the culprit named, not at step 1 with a
shape error or hours later with a silent divergence.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import platform
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from job.errors import JobError

log = logging.getLogger("job.preflight")

PACKAGES = ("jax", "jaxlib", "flax", "orbax-checkpoint", "optax")
WRITABLE = "writable"
# Fields that say where a process runs: shown in the report, never compared.
IDENTITY = ("process", "host")


class PreflightError(JobError, RuntimeError):
    """The processes of one job disagree (versions, devices, code, config) or cannot write the run dir."""


@functools.cache
def code_hash() -> str:
    """sha256 of every .py file of the `job` package (path and bytes), first 12 hex digits."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def writable(directory: Path, process: int) -> str:
    """WRITABLE, or why this process cannot create and write a file in `directory`."""
    probe = directory / f".preflight-{process}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return WRITABLE


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def local_facts(config: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """This process's facts (needs jax initialised: it reads the local devices)."""
    import jax

    devices = jax.local_devices()
    facts: dict[str, Any] = {
        "process": jax.process_index(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        **{package: _version(package) for package in PACKAGES},
        "job code": code_hash(),
        "device kind": ",".join(sorted({d.device_kind for d in devices})),
        "local devices": len(devices),
        "run dir": writable(run_dir, jax.process_index()),
    }
    facts.update({f"config.{k}": v for k, v in flatten(config).items()})
    return facts


def gather(facts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every process's facts, in process order, on every process. Collective."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from job.multihost import barrier

    if jax.process_count() == 1:
        return [dict(facts)]
    barrier("preflight")
    data = np.frombuffer(json.dumps(facts, sort_keys=True, default=str).encode(), dtype=np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(row[:size].tobytes()) for row, size in zip(rows, sizes, strict=True)]


def problems(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Fields whose value differs between processes, or that some process could not satisfy."""
    fields = sorted({k for row in rows for k in row} - set(IDENTITY), key=_order)
    bad = [f for f in fields if len({json.dumps(row.get(f), default=str) for row in rows}) > 1]
    if any(row.get("run dir") != WRITABLE for row in rows) and "run dir" not in bad:
        bad.insert(0, "run dir")
    return bad


def _order(field: str) -> tuple[int, str]:
    return (1 if field.startswith("config.") else 0, field)


def report(rows: Sequence[Mapping[str, Any]], fields: Sequence[str], run_dir: Path) -> str:
    """One table: a line per differing field, a column per process."""
    heads = [f"process {row['process']} ({row['host']})" for row in rows]
    table = [["", *heads]] + [[f, *(_show(row.get(f, "-")) for row in rows)] for f in fields]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table]
    fixes = []
    if any(f in fields for f in (*PACKAGES, "python", "job code")):
        fixes.append("run the same image or environment, and the same code, on every host")
    if "device kind" in fields or "local devices" in fields:
        fixes.append("give every process the same kind and number of devices (check --gpus-per-node, "
                     "CUDA_VISIBLE_DEVICES, the TPU slice)")
    if any(f.startswith("config.") for f in fields):
        fixes.append("pass the same flags to every process (one command line, one config)")
    if "run dir" in fields:
        fixes.append(f"make {run_dir} writable from every host (a filesystem they share), or pass --run-dir")
    return (f"preflight: stopping before training: {len(rows)} processes, these facts differ or fail.\n  "
            + "\n  ".join(lines) + "\nFix: " + "; ".join(fixes))


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class Summary:
    processes: int
    facts: dict[str, Any]  # process 0's

    def line(self) -> str:
        f = self.facts
        return (f"preflight: {self.processes} process(es) agree: jax {f['jax']}, jaxlib {f['jaxlib']}, "
                f"flax {f['flax']}, {f['local devices']} x {f['device kind']} per process, "
                f"code {f['job code']}, config {config_hash(f)}")


def config_hash(facts: Mapping[str, Any]) -> str:
    config = {k: v for k, v in facts.items() if k.startswith("config.")}
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def check(config: Mapping[str, Any], run_dir: Path) -> Summary:
    """Gather every process's facts; raise PreflightError on every process if they disagree. Collective."""
    import jax

    rows = gather(local_facts(config, run_dir))
    bad = problems(rows)
    if bad and jax.process_index() == 0:
        raise PreflightError(report(rows, bad, run_dir))
    if bad:
        raise PreflightError(f"preflight: this job's processes disagree on {', '.join(bad)}; "
                             "process 0 prints the report")
    return Summary(len(rows), rows[0])
