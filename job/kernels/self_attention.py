"""Causal self-attention for any model, one kernel chosen per backend: what a model calls instead of
`jax.nn.dot_product_attention` to get the chip's kernel.

    y_blhd = attention(q_blhd, k_bLkd, v_bLkd)                        # k, v: as many heads as q, or fewer
    y_blhd = attention(q_blhd, k_bLkd, v_bLkd, segment_ids=seg_bl)    # padding and packed rows
    y_blhd = attention(q, k, v, kernel="xla")                          # one of KERNELS
    y_blhd = attention(q, k, v, kernel=cfg.kernel, flag="--kernel")   # its errors name the caller's flag

q is [B, L, heads, head_dim]; k and v [B, L, kv_heads, head_dim], kv_heads dividing heads (grouped-query;
one: multi-query): query head n reads kv head n // (heads / kv_heads), as `jax.nn.dot_product_attention`
groups them. The kv heads are never repeated to the query heads' count (but for a split over a model
axis that does not divide them: then to the fewest the axis divides). `segment_ids` [B, L] (int): a
position attends only to earlier positions of the same segment (padding: its own id).

| kernel | where | what it is |
|---|---|---|
| `xla` | any | `jax.nn.dot_product_attention(implementation="xla")`: every [B, heads, L, L] score in float32 |
| `splash` | TPU (CPU: Pallas' interpret mode) | `jax.experimental.pallas.ops.tpu.splash_attention`: blocks of the causal mask, no L x L scores, grouped kv heads read in place |
| `flash` | TPU only | `jax.experimental.pallas.ops.tpu.flash_attention` (heads as many as the queries') |
| `cudnn` | GPU | `jax.nn.dot_product_attention(implementation="cudnn")` (bf16/fp16, no segments) |

`auto` takes splash on a TPU (a length no tile divides is padded to one that is: causal, so the padded
keys come after every real query, and the padded queries are dropped), cuDNN on a GPU for bf16
activations without segments, XLA otherwise. The platform is the mesh's in context (`jax.set_mesh`), so
a step compiled ahead of time for TPU devices on a CPU host gets the TPU kernel; outside a mesh, jax's
default backend.

A Pallas kernel is one custom call XLA cannot split: under a mesh it runs in `jax.shard_map` on each
device's own block, laid out as activations are (`job.sharding.activation_spec`): rows over the batch
axes, heads over the axis "heads" maps to, queries along "sequence" while keys and values are whole. A
device holding queries [o, o + l) of L masks with the causal mask shifted by o (splash's
`CausalMask(offset=o)`; one kernel per sequence shard, chosen by `lax.switch` on the device's index).

The choice is the caller's argument, and so are the names its errors give it: a kernel that cannot run
is a ConfigError naming `flag` (default: the argument, `kernel`) and, where a longer sequence would do,
`length_flag`, so that a model's own command line (the example LM passes its flags) is what its user is
told to change.
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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from job.core.errors import ConfigError
from job.core.flags import passing
from job.parallel.multihost import on_process_zero
from job.parallel.sharding import activation_spec

KERNELS = ("auto", "xla", "splash", "flash", "cudnn")
PALLAS = ("splash", "flash")
BLOCKS = (512, 256, 128)  # the Pallas kernels' tile sizes, largest first (512: measured fastest on v5e)
# queries [B, L, heads, head_dim] split along the sequence; keys and values whole along it; segment ids alike
QUERIES = ("batch", "length", "heads", None)
KEYS_VALUES = ("batch", None, "heads", None)
QUERY_SEGMENTS = ("batch", "length")
KEY_SEGMENTS = ("batch", None)
RESIDUALS = "attention"  # the checkpoint name of attention's output (and splash's residuals): remat's dots keeps it
PADDING_SEGMENT = -1  # the segment id of the positions padded up to a tile (each attends to itself only)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The attention a trace runs: its name, the Pallas tile size (0: none), interpret mode (a Pallas kernel
    off a TPU runs in Pallas' interpreter: exact and slow, for tests), and the length the queries are padded
    to first (0: none)."""

    name: str
    block: int = 0
    interpret: bool = False
    padded: int = 0

    def describe(self) -> str:
        extra = f", blocks of {self.block}" if self.block else ""
        pad = f", padded to {self.padded}" if self.padded else ""
        return f"{self.name}{extra}{pad}{' (interpret mode: no TPU)' if self.interpret else ''}"


def platform() -> str:
    """The platform the trace compiles for: the mesh's in context, else jax's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)  # JAX 0.10 meshes have none
    found = getattr(device, "platform", None)
    return str(found) if found else jax.default_backend()


def block_for(length: int) -> int:
    """The largest of BLOCKS that divides `length` (0: none does)."""
    return next((b for b in BLOCKS if length % b == 0), 0)


def padded_length(length: int) -> int:
    """`length` rounded up to the smallest tile (so that a tile divides it)."""
    return -(-length // BLOCKS[-1]) * BLOCKS[-1]


def choose(requested: str, *, length: int, dtype: str = "bfloat16", on: str | None = None,
           shards: int = 1, segments: bool = False, flag: str = "kernel", length_flag: str = "") -> Kernel:
    """The kernel `requested` resolves to for queries of `length` positions a device (the sequence split in
    `shards`) in activations of `dtype`, on platform `on` (default: `platform()`), with segment ids or not.
    A kernel that cannot run is a ConfigError naming `flag`, the caller's name for the choice, and
    `length_flag`, its name for the sequence's length (none: the fix says the length)."""
    if requested not in KERNELS:
        raise ConfigError(flag, expected=f"one of {', '.join(KERNELS)}", found=requested,
                          fix=f"pass {passing(flag, 'auto')} (the backend's fastest kernel) or {passing(flag, 'xla')}")
    where = on or platform()
    block = block_for(length)
    if requested == "auto":
        if where == "tpu" and block:
            return Kernel("splash", block)
        if where == "tpu" and shards == 1:  # the whole sequence on each device: padded up to a tile
            return Kernel("splash", block_for(padded_length(length)), padded=padded_length(length))
        if where == "gpu" and dtype == "bfloat16" and not segments:
            return Kernel("cudnn")
        return Kernel("xla")
    if requested in PALLAS:
        if requested == "flash" and where != "tpu":  # its backward pass has no interpret mode here
            raise ConfigError(flag, expected="flash on a TPU", found=f"flash on {where}",
                              fix=f"pass {passing(flag, 'splash')} (Pallas' interpreter runs it off a TPU) or "
                                  f"{passing(flag, 'xla')}")
        if requested == "flash" and segments:
            raise ConfigError(flag, expected="flash without segment ids", found="segment ids",
                              fix=f"pass {passing(flag, 'splash')} (or auto)")
        if not block and shards > 1:
            whole = padded_length(length) * shards
            longer = passing(length_flag, whole) if length_flag else f"sequences of {whole} positions"
            raise ConfigError(flag, expected=f"{requested}: a length that a tile of "
                              f"{' or '.join(map(str, BLOCKS))} divides", found=f"{length} positions a device",
                              fix=f"pass {longer}, or {passing(flag, 'xla')}")
        interpret = where != "tpu"
        if not block:
            return Kernel(requested, block_for(padded_length(length)), interpret, padded_length(length))
        return Kernel(requested, block, interpret)
    if requested == "cudnn" and where != "gpu":
        raise ConfigError(flag, expected="cudnn on a GPU", found=f"cudnn on {where}",
                          fix=f"pass {passing(flag, 'auto')} (or xla)")
    if requested == "cudnn" and segments:
        raise ConfigError(flag, expected="cudnn without segment ids", found="segment ids",
                          fix=f"pass {passing(flag, 'auto')} (or xla)")
    return Kernel(requested)


@functools.cache
def _say_once(description: str, shape: tuple[int, ...], kv_heads: int) -> None:
    """The kernel chosen for a shape, said once a process: an unrolled stack traces attention once a layer, and
    the train and eval steps trace it again."""
    on_process_zero(log.info, "attention: %s for queries %s, %d kv heads", description, shape, kv_heads)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
              kernel: str = "auto", flag: str = "kernel", length_flag: str = "") -> jax.Array:
    """Causal attention of q [B, L, heads, head_dim] over k, v [B, L, kv_heads, head_dim] (kv_heads dividing
    heads), positions attending only within their segment where `segment_ids` [B, L] is given, by the kernel
    `kernel` resolves to (module docstring); the result has q's shape and dtype. It is named RESIDUALS
    (`checkpoint_name`) on every path, so remat's `dots` keeps it in any model that calls this. A kernel that
    cannot run is a ConfigError naming `flag` and `length_flag` (`choose`)."""
    return checkpoint_name(_attended(q, k, v, segment_ids, kernel, flag, length_flag), RESIDUALS)


def _attended(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, kernel: str, flag: str,
              length_flag: str) -> jax.Array:
    """`attention`'s result, unnamed."""
    _check_shapes(q, k, v, segment_ids)
    heads_split = _split_of(activation_spec(QUERIES, q.shape), 2)
    k, v = (_kv_for_split(x, q.shape[2], heads_split) for x in (k, v))
    q_spec = activation_spec(QUERIES, q.shape)
    kv_spec = activation_spec(KEYS_VALUES, k.shape)
    sequence_axes = _axes_of(q_spec, 1)
    shards = _split_of(q_spec, 1)
    chosen = choose(kernel, length=q.shape[1] // shards, dtype=jnp.dtype(q.dtype).name, shards=shards,
                    segments=segment_ids is not None, flag=flag, length_flag=length_flag)
    _say_once(chosen.describe(), tuple(q.shape), k.shape[2])
    if chosen.name not in PALLAS:
        if shards > 1 and chosen.name == "cudnn":
            raise ConfigError(flag, expected="cudnn with the sequence whole on each device",
                              found=f"queries split over {sequence_axes}", fix=f"pass {passing(flag, 'xla')}")
        # the mask is built from the global [L, L] shape: exact under a sequence split
        implementation: Literal["xla", "cudnn"] = "cudnn" if chosen.name == "cudnn" else "xla"
        mask = None if segment_ids is None else (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
    if shards > 1 and chosen.name == "flash":
        raise ConfigError(flag, expected="flash with the sequence whole on each device (its causal "
                          "mask has no offset)", found=f"queries split over {sequence_axes}",
                          fix=f"pass {passing(flag, 'splash')}")
    segments = segment_ids if segment_ids is not None else jnp.zeros(q.shape[:2], jnp.int32)
    body = functools.partial(_pallas_block, kernel=chosen, sequence_axes=sequence_axes, shards=shards,
                             with_segments=segment_ids is not None)
    if q_spec is None or kv_spec is None:  # no mesh in context: the whole arrays are this device's
        return body(q, k, v, segments, segments)
    q_segments = activation_spec(QUERY_SEGMENTS, segments.shape)
    kv_segments = activation_spec(KEY_SEGMENTS, segments.shape)
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(q_spec, kv_spec, kv_spec, q_segments, kv_segments), out_specs=q_spec,
                         check_vma=False)(q, k, v, segments, segments)


attend = attention  # the example LM's name for it, kept for forks that called job.tasks.lm.attention.attend


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> None:
    """A ConfigError for shapes attention cannot take, naming them."""
    problem = ""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        problem = "q [B, L, heads, head_dim], k and v alike [B, L, kv_heads, head_dim]"
    elif k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        problem = "k and v with q's batch, length and head_dim"
    elif q.shape[2] % k.shape[2]:
        problem = "kv_heads dividing the query heads"
    elif segment_ids is not None and tuple(segment_ids.shape) != tuple(q.shape[:2]):
        problem = "segment_ids [B, L], as q's first two dimensions"
    if problem:
        segments = None if segment_ids is None else tuple(segment_ids.shape)
        raise ConfigError("attention's inputs", expected=problem, found=f"q {tuple(q.shape)}, k {tuple(k.shape)}, "
                          f"v {tuple(v.shape)}, segment_ids {segments}",
                          fix="reshape the projections to [batch, length, heads, head_dim] before attention")


def _axes_of(spec: PartitionSpec | None, dim: int) -> tuple[str, ...]:
    """The mesh axes `spec` splits dimension `dim` over."""
    if spec is None or len(spec) <= dim or spec[dim] is None:
        return ()
    entry = spec[dim]
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _split_of(spec: PartitionSpec | None, dim: int) -> int:
    """How many parts `spec` splits dimension `dim` in, over the mesh in context."""
    axes = _axes_of(spec, dim)
    return math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes) if axes else 1


def _kv_for_split(x: jax.Array, heads: int, split: int) -> jax.Array:
    """k or v with its heads repeated to the fewest that `split` (the query heads' split) divides and that
    divide `heads`: as they are wherever the split divides them already (grouped-query kept grouped)."""
    kv = x.shape[2]
    if kv % split == 0:
        return x
    target = next(m for m in range(kv, heads + 1, kv) if m % split == 0 and heads % m == 0)
    return jnp.repeat(x, target // kv, axis=2)


def _pallas_block(q: jax.Array, k: jax.Array, v: jax.Array, q_segments: jax.Array, kv_segments: jax.Array, *,
                  kernel: Kernel, sequence_axes: tuple[str, ...], shards: int, with_segments: bool) -> jax.Array:
    """One device's attention: its queries [b, l, h, d] against every key [b, L, kh, d]."""
    length = q.shape[1]
    if kernel.padded:  # only with the whole sequence here (choose): padded at the end, where the causal mask
        # keeps the padded keys from every real query (a padded query sees its own position: no empty row)
        q, k, v = (_pad(x, kernel.padded, 0) for x in (q, k, v))
        q_segments, kv_segments = (_pad(s, kernel.padded, PADDING_SEGMENT) for s in (q_segments, kv_segments))
    q_bhld, k_bhld, v_bhld = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    segments = (q_segments, kv_segments) if with_segments else None
    if kernel.name == "flash":
        y = _flash(q_bhld, k_bhld, v_bhld, scale, kernel)
    elif shards == 1:
        y = _splash(q_bhld * scale, k_bhld, v_bhld, segments, kernel, offset=0)
    else:  # each sequence shard's queries start at its own offset: one kernel each, the device's chosen
        index = jax.lax.axis_index(sequence_axes)
        branches = [functools.partial(_splash, kernel=kernel, offset=i * q.shape[1]) for i in range(shards)]
        y = jax.lax.switch(index, branches, q_bhld * scale, k_bhld, v_bhld, segments)
    return jnp.swapaxes(y, 1, 2)[:, :length].astype(q.dtype)


def _pad(x: jax.Array, length: int, value: int) -> jax.Array:
    """x [b, l, ...] padded with `value` along its second dimension to `length`."""
    width = [(0, 0)] * x.ndim
    width[1] = (0, length - x.shape[1])
    return jnp.pad(x, width, constant_values=value)


def _splash(q: jax.Array, k: jax.Array, v: jax.Array, segments: tuple[jax.Array, jax.Array] | None, kernel: Kernel,
            *, offset: int) -> jax.Array:
    """Splash attention over q [b, h, l, d] (pre-scaled) and k, v [b, kh, L, d] (kh dividing h: splash's
    multi-head kernel reads grouped kv heads in place), causal with queries starting at `offset`. The kernel
    is built inside the trace: one built once and reused across jits leaks its mask arrays."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # Pallas: only when chosen

    heads, length, keys = q.shape[1], q.shape[2], k.shape[2]
    b = kernel.block
    mask = splash.MultiHeadMask([splash.CausalMask((length, keys), offset=offset) for _ in range(heads)])
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    named: dict[str, Any] = ({"residual_checkpoint_name": RESIDUALS} if _takes_residual_name(splash.make_splash_mha)
                             else {})
    run = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                 interpret=kernel.interpret, **named)
    if segments is None:
        return jax.vmap(run)(q, k, v)
    ids = splash.SegmentIds(q=segments[0].astype(jnp.int32), kv=segments[1].astype(jnp.int32))
    return jax.vmap(lambda q, k, v, ids: run(q, k, v, segment_ids=ids))(q, k, v, ids)


def _takes_residual_name(make: object) -> bool:
    """Whether this jax's splash attention names its residuals for a remat policy."""
    target = getattr(make, "func", make)  # make_splash_mha is a functools.partial
    return "residual_checkpoint_name" in inspect.signature(target).parameters  # type: ignore[arg-type]


def _flash(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, kernel: Kernel) -> jax.Array:
    """Pallas flash attention over [b, h, L, d], causal; grouped kv heads repeated (its kernel takes as many
    as the queries)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as flash  # Pallas: only when chosen

    if k.shape[1] != q.shape[1]:
        k, v = (jnp.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    b = kernel.block
    sizes = flash.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
                             block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b,
                             block_q_dq=b)
    return flash.flash_attention(q, k, v, causal=True, sm_scale=scale, block_sizes=sizes)


__all__ = ["BLOCKS", "KERNELS", "PADDING_SEGMENT", "RESIDUALS", "Kernel", "attend", "attention", "block_for",
           "choose", "padded_length", "platform"]
