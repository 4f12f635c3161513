"""Where remat `auto`'s choice is remembered, so that a later run of the same step compiles one program.

    earlier = remat_cache.recall(run_dir, cache_dir, chosen_for)   # a remat_auto.Remembered, or None (collective)
    remat_cache.remember(run_dir, cache_dir, chosen_for, choice)  # process 0, after the choice
    remat_cache.ran(run_dir)                                       # "dots": what the run's auto stood for

Two records of one form, `{"policy", "program", "for", "needed", "limit", "run_dir"}`:

- the run's own, RUN_DIR/remat.json (job.core.rundir.remat_choice): what its `auto` stood for (read by
  `python -m job eval` and `load_model`), and what a resume of the same step compiles first;
- one for every run that shares the compilation cache, CACHE/job-remat/SHA.json in its folder
  (job/runtime/compile_cache.py; none where the cache is off), SHA the sha256 of `chosen_for`: what
  decides the choice (the task, the model's config, the global batch, the rule, --accum-steps, the mesh,
  the devices' kind and memory limit, the jax and compiler versions). A new run dir of the same model
  finds it there. It sits in the cache's own folder, whose lifetime and owner it shares (jax reads only
  its `*-cache` files there).

A record only orders the candidates (job/train/remat_auto.py): the one it names is compiled first and
taken where it fits and its lowered program (`program`: sha256) is the one remembered; otherwise the
faster ones are tried too. Every process lowers the same program (one SPMD program over the global
arrays), so each compares its own with process 0's record and all take the same policy. Because the key
holds the devices and their memory limit, a policy chosen where memory was short ("full" on a smaller
chip) is never taken where a faster one fits: another device is another key. What the key leaves out
(the model's code, the batch's shapes) the program's digest covers. A record whose `for` is not
`chosen_for` (another step, a file edited by hand) is not read. Each file is written whole (a temporary
file renamed over it), by process 0 only; a CPU's choice (memory not known) stays in its run dir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

from etils import epath

from job.core import rundir, storage
from job.kernels.rematerialize import CANDIDATES
from job.parallel.multihost import on_process_zero, sync_string
from job.train.remat_auto import Choice, Remembered

log = logging.getLogger("job.train")

FOLDER = "job-remat"  # inside the compilation cache's folder


def normal(chosen_for: dict[str, Any]) -> dict[str, Any]:
    """`chosen_for` as a JSON file gives it back (tuples as lists, other values as their text)."""
    return json.loads(json.dumps(chosen_for, default=str))


def key(chosen_for: dict[str, Any]) -> str:
    """The sha256 of what decides the choice: the cache's file name."""
    return hashlib.sha256(json.dumps(normal(chosen_for), sort_keys=True).encode("utf-8")).hexdigest()


def cached(cache_dir: str | None, chosen_for: dict[str, Any]) -> epath.Path | None:
    """The cache's record for `chosen_for` (None where the compilation cache is off)."""
    return None if cache_dir is None else epath.Path(cache_dir) / FOLDER / f"{key(chosen_for)}.json"


def recall(run_dir: epath.Path, cache_dir: str | None, chosen_for: dict[str, Any]) -> Remembered | None:
    """The run's own record for `chosen_for`, else the cache's, as process 0 reads them, on every process
    (collective: each process's own cache may hold another, and all must compile the same candidates); None
    where neither is."""
    found = on_process_zero(_recalled, run_dir, cache_dir, chosen_for)
    said = json.loads(sync_string(json.dumps(None if found is None else dataclasses.asdict(found))))
    return None if said is None else Remembered(**said)


def _recalled(run_dir: epath.Path, cache_dir: str | None, chosen_for: dict[str, Any]) -> Remembered | None:
    wanted = normal(chosen_for)
    for path in (rundir.remat_choice(run_dir), cached(cache_dir, chosen_for)):
        record = None if path is None else _read(path)
        if (isinstance(record, dict) and record.get("for") == wanted and record.get("policy") in CANDIDATES
                and isinstance(record.get("program"), (str, type(None)))):
            where = ("this run's earlier attempt" if path == rundir.remat_choice(run_dir)
                     else f"an earlier run in {record.get('run_dir') or 'another run dir'}")
            return Remembered(record["policy"], record.get("program"), where)
    return None


def remember(run_dir: epath.Path, cache_dir: str | None, chosen_for: dict[str, Any], choice: Choice) -> None:
    """Write the choice to the run's record and the cache's, each where it does not say so already; a cache
    that cannot be written is a warning (it only saves compiles). The cache's only where the device's memory
    is known: elsewhere (a CPU) the first candidate is taken without a choice to remember."""
    record = {"policy": choice.policy, "program": choice.program(), "for": normal(chosen_for),
              "needed": choice.need.needed, "limit": choice.need.available, "run_dir": str(run_dir)}
    shared = None if choice.need.available is None else cached(cache_dir, chosen_for)
    for path in (rundir.remat_choice(run_dir), shared):
        if path is None:
            continue
        earlier = _read(path)
        if isinstance(earlier, dict) and {**earlier, "run_dir": ""} == {**record, "run_dir": ""}:
            continue
        try:
            _write(path, json.dumps(record, sort_keys=True) + "\n")
        except OSError as exc:
            if path == rundir.remat_choice(run_dir):
                raise
            log.warning("remat auto: could not remember the choice in %s (%s); a later run compiles the candidates "
                        "again", path, exc)


def ran(run_dir: epath.Path) -> str | None:
    """The policy the run's remat `auto` stood for (RUN_DIR/remat.json); None where it is not recorded."""
    record = _read(rundir.remat_choice(run_dir))
    policy = record.get("policy") if isinstance(record, dict) else None
    return policy if policy in CANDIDATES else None


def _read(path: epath.Path) -> Any:
    try:
        return rundir.document(path)
    except OSError:  # a cache folder this user cannot read: as if there were no record
        return None


def _write(path: epath.Path, text: str) -> None:
    """`text` as the whole of `path`: a local file through a temporary one renamed over it; a Cloud Storage
    object is written whole already."""
    if storage.is_remote(path):
        path.write_text(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a reader finds the old record or the new one, never a torn one


__all__ = ["FOLDER", "cached", "key", "normal", "ran", "recall", "remember"]
