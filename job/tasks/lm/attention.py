"""Causal self-attention kernels of the example LM, one chosen per backend (`--model.attention`).

    y_blhd = attend(q_blhd, k_blhd, v_blhd, kernel=choose("auto", length=1024))

| kernel | where | what it is |
|---|---|---|
| `xla` | any | `jax.nn.dot_product_attention(implementation="xla")`: every [B, heads, L, L] score in float32 |
| `splash` | TPU (CPU: Pallas' interpret mode) | `jax.experimental.pallas.ops.tpu.splash_attention`: blocks of the causal mask, no L x L scores |
| `flash` | TPU only | `jax.experimental.pallas.ops.tpu.flash_attention` |
| `cudnn` | GPU | `jax.nn.dot_product_attention(implementation="cudnn")` (bf16/fp16) |

`auto` takes splash on a TPU when a block of 128 or more divides the length, cuDNN on a GPU for bf16
activations, XLA otherwise. The platform is the mesh's in context (`jax.set_mesh`), so a step compiled
ahead of time for TPU devices on a CPU host gets the TPU kernel; outside a mesh, jax's default backend.

A Pallas kernel is one custom call XLA cannot split: under a mesh it runs in `jax.shard_map` on each
device's own block, laid out as the model's activations are (`job.sharding.activation_spec`): rows over
the batch axes, heads over the axis "heads" maps to, queries along "sequence" while keys and values are
whole. A device holding queries [o, o + l) of L masks with the causal mask shifted by o (splash's
`CausalMask(offset=o)`; one kernel per sequence shard, chosen by `lax.switch` on the device's index).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from job.errors import ConfigError
from job.multihost import on_process_zero
from job.sharding import activation_spec

KERNELS = ("auto", "xla", "splash", "flash", "cudnn")
PALLAS = ("splash", "flash")
BLOCKS = (512, 256, 128)  # the Pallas kernels' tile sizes, largest first (512: measured fastest on v5e)
# queries [B, L, heads, head_dim] split along the sequence; keys and values whole along it (model.py's names)
QUERIES = ("batch", "length", "heads", None)
RESIDUALS = "attention"  # the checkpoint name of attention's output (and splash's residuals): remat may keep it
KEYS_VALUES = ("batch", None, "heads", None)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The attention a trace runs: its name, the Pallas tile size (0: none), and interpret mode (a Pallas
    kernel off a TPU runs in Pallas' interpreter: exact and slow, for tests)."""

    name: str
    block: int = 0
    interpret: bool = False

    def describe(self) -> str:
        extra = f", blocks of {self.block}" if self.block else ""
        return f"{self.name}{extra}{' (interpret mode: no TPU)' if self.interpret else ''}"


def platform() -> str:
    """The platform the trace compiles for: the mesh's in context, else jax's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)  # JAX 0.10 meshes have none
    found = getattr(device, "platform", None)
    return str(found) if found else jax.default_backend()


def block_for(length: int) -> int:
    """The largest of BLOCKS that divides `length` (0: none does)."""
    return next((b for b in BLOCKS if length % b == 0), 0)


def choose(requested: str, *, length: int, dtype: str = "bfloat16", on: str | None = None,
           shards: int = 1) -> Kernel:
    """The kernel `requested` resolves to for queries of `length` positions a device (the sequence split in
    `shards`) in activations of `dtype`, on platform `on` (default: `platform()`)."""
    if requested not in KERNELS:
        raise ConfigError("--model.attention", expected=f"one of {', '.join(KERNELS)}", found=requested,
                          fix="pass --model.attention auto (the backend's fastest kernel) or xla")
    where = on or platform()
    block = block_for(length)
    if requested == "auto":
        if where == "tpu" and block:
            return Kernel("splash", block)
        if where == "gpu" and dtype == "bfloat16":
            return Kernel("cudnn")
        return Kernel("xla")
    if requested in PALLAS:
        if not block:
            raise ConfigError("--model.attention", expected=f"{requested}: a length that a tile of "
                              f"{' or '.join(map(str, BLOCKS))} divides", found=f"{length} positions a device",
                              fix=f"pass --model.seq-len {-(-length // BLOCKS[-1]) * BLOCKS[-1] * shards}, or "
                                  "--model.attention xla")
        if requested == "flash" and where != "tpu":  # its backward pass has no interpret mode here
            raise ConfigError("--model.attention", expected="flash on a TPU", found=f"flash on {where}",
                              fix="pass --model.attention splash (Pallas' interpreter runs it off a TPU) or xla")
        return Kernel(requested, block, interpret=where != "tpu")
    if requested == "cudnn" and where != "gpu":
        raise ConfigError("--model.attention", expected="cudnn on a GPU", found=f"cudnn on {where}",
                          fix="pass --model.attention auto (or xla)")
    return Kernel(requested)


@functools.cache
def _say_once(description: str, shape: tuple[int, ...]) -> None:
    """The kernel chosen for a shape, said once a process: an unrolled stack traces attend once a layer, and the
    train and eval steps trace it again."""
    on_process_zero(log.info, "attention: %s for queries %s", description, shape)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, requested: str = "auto") -> jax.Array:
    """Causal attention of q [B, L, heads, head_dim] over k, v of the same shape, by the kernel `requested`
    resolves to; the result has q's shape and dtype."""
    q_spec = activation_spec(QUERIES, q.shape)
    kv_spec = activation_spec(KEYS_VALUES, k.shape)
    sequence_axes = _axes_of(q_spec, 1)
    shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in sequence_axes)
    kernel = choose(requested, length=q.shape[1] // shards, dtype=jnp.dtype(q.dtype).name, shards=shards)
    _say_once(kernel.describe(), tuple(q.shape))
    if kernel.name not in PALLAS:
        if shards > 1 and kernel.name == "cudnn":
            raise ConfigError("--model.attention", expected="cudnn with the sequence whole on each device",
                              found=f"queries split over {sequence_axes}", fix="pass --model.attention xla")
        # the mask is built from the global [L, L] shape: exact under a sequence split
        implementation: Literal["xla", "cudnn"] = "cudnn" if kernel.name == "cudnn" else "xla"
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    if shards > 1 and kernel.name == "flash":
        raise ConfigError("--model.attention", expected="flash with the sequence whole on each device (its causal "
                          "mask has no offset)", found=f"queries split over {sequence_axes}",
                          fix="pass --model.attention splash")
    body = functools.partial(_pallas_block, kernel=kernel, sequence_axes=sequence_axes, shards=shards)
    if q_spec is None or kv_spec is None:  # no mesh in context: the whole arrays are this device's
        return body(q, k, v)
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(q_spec, kv_spec, kv_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v)


def _axes_of(spec: PartitionSpec | None, dim: int) -> tuple[str, ...]:
    """The mesh axes `spec` splits dimension `dim` over."""
    if spec is None or len(spec) <= dim or spec[dim] is None:
        return ()
    entry = spec[dim]
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _pallas_block(q: jax.Array, k: jax.Array, v: jax.Array, *, kernel: Kernel, sequence_axes: tuple[str, ...],
                  shards: int) -> jax.Array:
    """One device's attention: its queries [b, l, h, d] against every key [b, L, h, d]."""
    q_bhld, k_bhld, v_bhld = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kernel.name == "flash":
        y = _flash(q_bhld, k_bhld, v_bhld, scale, kernel)
    elif shards == 1:
        y = _splash(q_bhld * scale, k_bhld, v_bhld, kernel, offset=0)
    else:  # each sequence shard's queries start at its own offset: one kernel each, the device's chosen
        index = jax.lax.axis_index(sequence_axes)
        length = q.shape[1]
        branches = [functools.partial(_splash, kernel=kernel, offset=i * length) for i in range(shards)]
        y = jax.lax.switch(index, branches, q_bhld * scale, k_bhld, v_bhld)
    return jnp.swapaxes(y, 1, 2).astype(q.dtype)


def _splash(q: jax.Array, k: jax.Array, v: jax.Array, kernel: Kernel, *, offset: int) -> jax.Array:
    """Splash attention over [b, h, l, d] (queries pre-scaled), causal with queries starting at `offset`.
    The kernel is built inside the trace: one built once and reused across jits leaks its mask arrays."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # Pallas: only when chosen

    heads, length, keys = q.shape[1], q.shape[2], k.shape[2]
    b = kernel.block
    mask = splash.MultiHeadMask([splash.CausalMask((length, keys), offset=offset) for _ in range(heads)])
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    named: dict[str, Any] = ({"residual_checkpoint_name": RESIDUALS} if _takes_residual_name(splash.make_splash_mha)
                             else {})
    attention = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                       interpret=kernel.interpret, **named)
    return jax.vmap(attention)(q, k, v)


def _takes_residual_name(make: object) -> bool:
    """Whether this jax's splash attention names its residuals for a remat policy (JAX 0.12 does)."""
    target = getattr(make, "func", make)  # make_splash_mha is a functools.partial
    return "residual_checkpoint_name" in inspect.signature(target).parameters  # type: ignore[arg-type]


def _flash(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, kernel: Kernel) -> jax.Array:
    """Pallas flash attention over [b, h, L, d], causal."""
    from jax.experimental.pallas.ops.tpu import flash_attention as flash  # Pallas: only when chosen

    b = kernel.block
    sizes = flash.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
                             block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b,
                             block_q_dq=b)
    return flash.flash_attention(q, k, v, causal=True, sm_scale=scale, block_sizes=sizes)


__all__ = ["KERNELS", "Kernel", "attend", "block_for", "choose", "platform"]
