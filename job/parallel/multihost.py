"""Host synchronisation and device meshes (a drop-in for mlip's ``multihost``).

    from job import multihost
    mesh = multihost.create_device_mesh()                 # 1-D, axis "devices"
    params = jax.device_put(params, multihost.create_replicated_sharding(mesh))
    run_name = multihost.sync_string(name if jax.process_index() == 0 else None)

    @multihost.only_specific_processes()                  # process 0 only
    def log_summary(...): ...
    multihost.on_process_zero(log_summary, step)          # the same, said at the call

Every function that talks to other processes is collective: all processes
call it, in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from job.core import internals, values
from job.core.errors import JobError, as_config_error
from job.parallel.mesh import hybrid_mesh, spans_slices
from job.parallel.trees import is_array, path_str

DATA_PARALLELISM_AXIS_NAME = "devices"

T = TypeVar("T")
_P = ParamSpec("_P")  # the decorated function's parameters
_PROCESS_ZERO = frozenset({0})


class BarrierTimeout(JobError, TimeoutError):
    """A named barrier timed out; the message names the processes that never arrived."""


@functools.cache
def create_device_mesh() -> Mesh:
    """1-D mesh over every global device, axis ``"devices"``. Cached: one object per process.

    Devices of several slices (GPU nodes, TPU slices) give a hybrid mesh, in process order.
    """
    devices = jax.devices()
    if spans_slices(devices):
        return hybrid_mesh(devices, (len(devices),), (DATA_PARALLELISM_AXIS_NAME,), "create_device_mesh()")
    # positional: the first argument is `axis_shapes` up to jax 0.10, `axis_sizes` from 0.11
    return jax.make_mesh((len(devices),), (DATA_PARALLELISM_AXIS_NAME,),
                         axis_types=(AxisType.Auto,), devices=devices)


def create_replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Fully replicated: params, optimizer state, EMA."""
    return NamedSharding(mesh, PartitionSpec())


def create_dp_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis split over every device of the mesh: keys, batches."""
    names = mesh.axis_names
    return NamedSharding(mesh, PartitionSpec(names[0] if len(names) == 1 else tuple(names)))


def on_process_zero(func: Callable[_P, T], /, *args: _P.args, **kwargs: _P.kwargs) -> T | None:
    """`func(*args, **kwargs)` on process 0, and its result there; None on every other process.

    This is the one place the project says "process 0 only" (`only_specific_processes()` says
    it as a decorator, through the same check); `func` is called straight from here, so a
    warning it raises with `stacklevel=2` names the line that called `on_process_zero`:

        on_process_zero(log.info, "saved step %d", step)
        on_process_zero(storage.make_dirs, run_dir)
    """
    return func(*args, **kwargs) if _runs_here(_PROCESS_ZERO) else None


def warn_on_process_zero(message: str, category: type[Warning] = UserWarning, *, where: str) -> None:
    """`message` as one warning from process 0, headed `WHERE:0: Category:` and without Python's source line
    under it (what `on_process_zero(warnings.warn, ..., stacklevel=2)` would print is the library's own call):
    the message is the whole of what a user needs. `where` names the library part, e.g. "job.train.state"."""
    on_process_zero(warnings.warn_explicit, message, category, where, 0, module=where)


def only_specific_processes(processes: int | list[int] = 0) -> Callable[[Callable[_P, T]], Callable[_P, T | None]]:
    """Decorator: run the function only on these process indices; elsewhere return None."""
    chosen = frozenset([processes] if isinstance(processes, int) else processes)

    def decorator(func: Callable[_P, T]) -> Callable[_P, T | None]:
        @functools.wraps(func)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> T | None:
            return func(*args, **kwargs) if _runs_here(chosen) else None

        return wrapper

    return decorator


def _runs_here(chosen: frozenset[int]) -> bool:
    """Whether this process is one of `chosen` (process indices)."""
    return jax.process_index() in chosen


def sync_string(value: str | None) -> str:
    """Process 0's string, on every process. Collective.

    Process 0 passes the value; the others pass None (what they pass is
    ignored). Any length and any Unicode: the UTF-8 bytes travel, not characters.
    """
    barrier("sync_string")
    is_source = jax.process_index() == 0
    data = value.encode("utf-8") if is_source and value is not None else b""
    size = len(data) if (is_source and value is not None) else -1
    size = int(multihost_utils.broadcast_one_to_all(np.int64(size), is_source=is_source))
    if size < 0:
        raise ValueError(
            "sync_string: expected a string on process 0, found None. "
            "Fix: pass the value on process 0 and None on the others."
        )
    buffer = np.frombuffer(data, dtype=np.uint8) if is_source else np.zeros(size, dtype=np.uint8)
    synced = multihost_utils.broadcast_one_to_all(buffer, is_source=is_source)
    return np.asarray(synced, dtype=np.uint8).tobytes().decode("utf-8")


@contextlib.contextmanager
def single_host_jax_and_orbax() -> Iterator[None]:
    """Inside: JAX looks like one host (process 0 of 1, devices() == local_devices())
    and Orbax skips its cross-host sync. Everything is restored on exit.
    A no-op on a true single host.

    Orbax's async saves also signal their stages through a key-value store. With
    the distributed runtime up that is the cluster's shared one, and its keys
    carry no process index: hosts saving on their own would read, and delete,
    each other's signals (a save that never finishes). Inside, each process
    signals through a store of its own instead.

    The patches hold for every thread of the process: finish any multi-host
    async save (`wait_until_finished`) before entering.
    """
    if jax.process_count() == 1:
        yield
        return
    with internals.one_host_view(jax.local_devices()):
        yield


BARRIER_TIMEOUT = "JOB_BARRIER_TIMEOUT"  # seconds a named barrier waits for every process (default 300)
_BARRIER_FIX = "read those processes' logs: they died, hung, or took another path"


def _barrier_timeout_s() -> float:
    with as_config_error(BARRIER_TIMEOUT, expected="a finite number of seconds > 0",
                         fix=f"set {BARRIER_TIMEOUT}=300 (or any number of seconds > 0), or unset it"):
        return values.positive_seconds(os.environ.get(BARRIER_TIMEOUT, "300"))


def coordination_client() -> Any:
    """The coordination service client of a multi-process run (its key-value store and barriers), else None."""
    if jax.process_count() == 1:
        return None
    return internals.coordination_client()


def barrier(name: str, timeout_s: float | None = None, *, fix: str | None = None) -> None:
    """Wait until every process reaches the barrier `name`. Collective.

    Raises BarrierTimeout naming the processes that did not arrive within
    `timeout_s` (default JOB_BARRIER_TIMEOUT, 300 s): a dead or hung peer
    becomes an error here instead of a silent hang in the next collective.
    `fix` replaces the message's general advice (read the missing processes' logs).
    """
    if jax.process_count() == 1:
        return
    timeout_s = _barrier_timeout_s() if timeout_s is None else timeout_s
    client = coordination_client()
    if client is None:
        multihost_utils.sync_global_devices(name)
        return
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as exc:
        text = str(exc)
        if "DEADLINE_EXCEEDED" not in text and "timed out" not in text:
            raise
        missing = re.findall(r"^\s*(\d+)\s*$", text.partition("timed out task names:")[2], re.MULTILINE)
        raise BarrierTimeout(
            f"barrier {name!r}: expected all {jax.process_count()} processes within {timeout_s:g} s, "
            f"found process(es) {', '.join(missing) or 'unknown'} missing (this is process "
            f"{jax.process_index()}). Fix: {fix or _BARRIER_FIX}"
        ) from None


# ---------------------------------------------------------------- pytree checks


def _local_value(leaf: Any) -> np.ndarray | None:
    """What this host can compare: None for a sharded global array (its shards differ by design)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(leaf.addressable_data(0)) if leaf.is_fully_replicated else None
    return np.asarray(leaf)


def _signature(tree: Any) -> dict[str, Any]:
    """Structure, shapes, dtypes (and non-array leaves' values), JSON-able."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    entries = {}
    for keys, leaf in leaves:
        if is_array(leaf, scalars=True):
            entries[path_str(keys)] = ["array", list(np.shape(leaf)), str(leaf.dtype)]
        else:
            entries[path_str(keys)] = ["value", repr(leaf)]
    return {"treedef": str(jax.tree_util.tree_structure(tree)), "leaves": entries}


def _structure_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    diffs = []
    for path in sorted(set(mine["leaves"]) | set(theirs["leaves"])):
        a, b = mine["leaves"].get(path), theirs["leaves"].get(path)
        if a is None or b is None:
            diffs.append(f"'{path}' (only in {'the first' if b is None else 'the second'} tree)")
        elif a[0] != b[0]:
            diffs.append(f"'{path}' (array vs non-array leaf)")
        elif a[0] == "value" and a[1] != b[1]:
            diffs.append(f"'{path}' (value {a[1]} vs {b[1]})")
        elif a[0] == "array" and a[1] != b[1]:
            diffs.append(f"'{path}' (shape {tuple(a[1])} vs {tuple(b[1])})")
        elif a[0] == "array" and a[2] != b[2]:
            diffs.append(f"'{path}' (dtype {a[2]} vs {b[2]})")
    if not diffs and mine["treedef"] != theirs["treedef"]:
        diffs.append(f"'<root>' (structure {mine['treedef']} vs {theirs['treedef']})")
    return diffs


def _value_differences(paths: list[str], a: list[Any], b: list[Any]) -> list[str]:
    diffs = []
    for path, x, y in zip(paths, a, b, strict=True):
        if x is None or y is None:
            continue
        x, y = np.asarray(x), np.asarray(y)
        equal_nan = np.issubdtype(x.dtype, np.inexact)
        if not np.array_equal(x, y, equal_nan=equal_nan):
            diffs.append(f"'{path}' (values differ)")
    return diffs


def _array_leaves(tree: Any) -> tuple[list[str], list[Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    pairs = [(path_str(keys), leaf) for keys, leaf in leaves if is_array(leaf, scalars=True)]
    return [p for p, _ in pairs], [_local_value(leaf) for _, leaf in pairs]


def _raise_if(diffs: list[str], where: str) -> None:
    if diffs:
        raise ValueError(
            f"Pytrees do not match{where}. Difference(s) found at the following paths: " + ", ".join(diffs)
        )


def assert_pytrees_match(a: Any, b: Any) -> None:
    """Raise ValueError listing the path of every difference (structure, shape, dtype, value)."""
    diffs = _structure_differences(_signature(a), _signature(b))
    if not diffs:
        paths, values_a = _array_leaves(a)
        _, values_b = _array_leaves(b)
        diffs = _value_differences(paths, values_a, values_b)
    _raise_if(diffs, "")


def assert_pytrees_match_across_hosts(tree: Any) -> None:
    """Compare this host's pytree with process 0's. Collective.

    The host that differs raises ValueError listing each differing path; so do
    the others (naming the differing processes), so no process walks on into a
    collective its peers will never join. Returns at once for one process.
    """
    if jax.process_count() == 1:
        return
    barrier("assert_pytrees_match_across_hosts")
    me = jax.process_index()
    mine = _signature(tree)
    theirs = json.loads(sync_string(json.dumps(mine) if me == 0 else None))
    diffs = [d.replace("the first", "this process's").replace("the second", "process 0's")
             for d in _structure_differences(mine, theirs)]
    structure_ok = not np.any(multihost_utils.process_allgather(np.int32(bool(diffs))))
    if structure_ok:
        paths, values = _array_leaves(tree)
        comparable = [np.zeros(0, np.uint8) if v is None else v for v in values]
        source = multihost_utils.broadcast_one_to_all(comparable, is_source=me == 0)
        source = [None if v is None else s for v, s in zip(values, source, strict=True)]
        diffs = _value_differences(paths, values, source)
    differing = np.flatnonzero(multihost_utils.process_allgather(np.int32(bool(diffs)))).tolist()
    _raise_if(diffs, f" between process {me} and process 0")
    if differing:
        raise ValueError(
            f"Pytrees do not match across hosts: process(es) {differing} differ from process 0 "
            "(their errors list the paths)."
        )
