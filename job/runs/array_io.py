"""How a checkpoint's arrays come back: orbax's ArrayHandler, each shard read by tensorstore into a buffer of its own.

orbax-checkpoint 0.12.8 reads a shard by making `np.zeros` of its shape, having tensorstore write the stored chunk
into it, then `jax.device_put` of the shard, one call per shard and device. `ArrayReader.deserialize` instead reads
each distinct shard this process holds with `t[index].read()` (tensorstore allocates the buffer, unfilled, and casts
where the target dtype differs), every array of the restore at once, and puts each array's shards on their devices
in one `jax.device_put`. Writing is orbax's own: the files are orbax's format, read by plain orbax and written by it.

Typed PRNG keys are stored as their key data (orbax's format); they are read as that data and wrapped again with
the target's own implementation, with or without orbax's array metadata beside them. What this path does not cover
goes through orbax's own, unchanged: a target shape unlike the stored one (orbax's padding and truncation), arrays
without a target sharding or with a custom layout, keys of an implementation jax does not name, and a handler with
a dispatcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from orbax.checkpoint.type_handlers import (
    ArrayHandler,
    ArrayRestoreArgs,
    ParamInfo,
    get_cast_tspec_deserialize,
    get_json_tspec_read,
)

Index = tuple[slice, ...]
KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")  # jax's own PRNG implementations, by the name it takes
# tensorstore's settings for a restore's reads, over those orbax opens its stores with: files mapped into memory
# instead of read with pread (see docs/checkpoints.md for the measured figures)
READ_CONTEXT = {"file_io_mode": {"mode": "memmap"}}


def read_context(parent: ts.Context | None) -> ts.Context:
    """orbax's context for a restore (`parent`; tensorstore's defaults where None) with READ_CONTEXT over it."""
    return ts.Context(ts.Context.Spec(READ_CONTEXT), parent) if parent is not None else ts.Context(READ_CONTEXT)


def with_read_context(infos: Sequence[ParamInfo]) -> list[ParamInfo]:
    """`infos` reading through `read_context` of their own context (orbax makes one for a whole restore)."""
    contexts: dict[int, ts.Context] = {}
    for info in infos:
        if id(info.ts_context) not in contexts:
            contexts[id(info.ts_context)] = read_context(info.ts_context)
    return [info.replace(ts_context=contexts[id(info.ts_context)]) for info in infos]


@dataclasses.dataclass(frozen=True)
class Read:
    """How one array is read: its stored array's sharding and shape (a key's data: trailing dimensions added), and
    the key implementation to wrap the data with (None: not a key)."""

    sharding: jax.sharding.Sharding
    shape: tuple[int, ...] | None  # None: the stored one
    key_impl: str | None = None


@functools.cache
def key_impl(dtype: Any) -> str | None:
    """The name of the PRNG implementation whose keys have `dtype`, among jax's own; None if none has."""
    return next((name for name in KEY_IMPLS if jax.random.key(0, impl=name).dtype == dtype), None)


def plan(arg: Any) -> Read | None:
    """How this module reads an array with restore args `arg`; None: orbax's own path reads it."""
    if not isinstance(arg, ArrayRestoreArgs) or not getattr(arg, "strict", True):
        return None
    if arg.mesh is not None and arg.mesh_axes is not None:
        sharding = jax.sharding.NamedSharding(arg.mesh, arg.mesh_axes)
    else:
        sharding = arg.sharding.to_jax_sharding() if hasattr(arg.sharding, "to_jax_sharding") else arg.sharding
    if not isinstance(sharding, jax.sharding.Sharding):
        return None
    shape = next((tuple(x) for x in (arg.global_shape, arg.shape) if x is not None), None)
    if arg.dtype is None or not jax.dtypes.issubdtype(arg.dtype, jax.dtypes.prng_key):
        return Read(sharding, shape)
    impl = key_impl(arg.dtype)
    # the key data's trailing dimensions are whole on every device: a NamedSharding's spec names fewer dimensions
    # than the data has, a single device holds all of it
    if impl is None or not isinstance(sharding, jax.sharding.NamedSharding | jax.sharding.SingleDeviceSharding):
        return None
    trailing = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), arg.dtype)).shape
    return Read(sharding, None if shape is None else (*shape, *trailing), impl)


def distinct_indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[tuple, tuple[Index, list]]:
    """{key: (index, devices)}: each distinct index of `shape` this process's devices hold, and which hold it."""
    held: dict[tuple, tuple[Index, list]] = {}
    for device, where in sharding.addressable_devices_indices_map(shape).items():
        index = tuple(where or ())  # a device of this process always holds an index
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        held.setdefault(bounds, (index, []))[1].append(device)
    return held


class ArrayReader(ArrayHandler):
    """orbax's ArrayHandler (every option its own), whose restore reads shards into unfilled buffers and puts each
    array's shards on their devices in one call; see the module's docstring for what stays on orbax's path."""

    async def deserialize(self, infos: Sequence[ParamInfo],
                          args: Sequence[Any] | None = None) -> Sequence[jax.Array]:
        if args is None or self.has_dispatcher() or not infos:
            return await super().deserialize(infos, args)
        infos = with_read_context(infos)
        reads = {i: plan(arg) for i, arg in enumerate(args)}
        mine = {i: r for i, r in reads.items() if r is not None}
        theirs = [i for i, r in reads.items() if r is None]
        if not mine:
            return await super().deserialize(infos, args)
        await asyncio.gather(*[info.await_path_creation() for info in infos])

        async def orbax_path() -> Sequence[jax.Array]:
            if not theirs:
                return []
            return await super(ArrayReader, self).deserialize([infos[i] for i in theirs], [args[i] for i in theirs])

        read, rest = await asyncio.gather(
            asyncio.gather(*[self._read(infos[i], args[i], r) for i, r in mine.items()]), orbax_path())
        out: list[Any] = [None] * len(infos)
        for i, value in [*zip(mine, read, strict=True), *zip(theirs, rest, strict=True)]:
            out[i] = value
        return out

    async def _read(self, info: ParamInfo, arg: ArrayRestoreArgs, read: Read) -> jax.Array:
        """One array, read shard by shard into host buffers tensorstore allocates, then put on its devices."""
        sharding = read.sharding
        spec = get_cast_tspec_deserialize(
            get_json_tspec_read(info, use_ocdbt=bool(info.is_ocdbt_checkpoint), metadata_key=self._metadata_key,
                                raise_array_data_missing_error=info.raise_array_data_missing_error), arg)
        t = await ts.open(spec, open=True, context=info.ts_context)
        shape = tuple(t.shape) if read.shape is None else read.shape
        if tuple(t.shape) != shape:
            raise ValueError(
                f"checkpoint array {info.name}: expected the stored shape {tuple(t.shape)} to be the requested "
                f"{shape}, found them different. Fix: restore with the stored shape, or with "
                "ArrayRestoreArgs(strict=False) to pad or truncate")
        held = distinct_indices(sharding, shape)
        limiter = info.byte_limiter
        nbytes = [int(np.prod([s.indices(n)[1] - s.indices(n)[0] for s, n in zip(index, shape, strict=True)]))
                  * t.dtype.numpy_dtype.itemsize for index, _ in held.values()]
        if limiter is not None:
            await asyncio.gather(*[limiter.wait_for_bytes(n) for n in nbytes])
        try:
            host = await asyncio.gather(*[t[index].read() for index, _ in held.values()])
            data = [x for x, (_, devices) in zip(host, held.values(), strict=True) for _ in devices]
            targets = [jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind)
                       for _, devices in held.values() for d in devices]
            shards = jax.device_put(data, targets)
        finally:
            if limiter is not None:
                await asyncio.gather(*[limiter.release_bytes(n) for n in nbytes])
        array = jax.make_array_from_single_device_arrays(shape, sharding, shards)
        return array if read.key_impl is None else jax.random.wrap_key_data(array, impl=read.key_impl)
