"""What each block of the example LM keeps for the backward pass (`--model.remat`), and `auto`'s choice.

    name = resolve(cfg, rows=16, length=1024)   # "none", "dots" or "full": logged once per trace

`auto` keeps the most that fits: no remat on a CPU (memory is the host's); on a TPU or GPU the first of
none, dots and full whose saved activations, estimated from the shapes, fit the share of the device's
memory left after the training state. The estimate counts, per token and layer, the arrays each policy
keeps (below); its margin (ACTIVATION_SHARE) was set against the compiler's own figures on a v5e chip
(bench/RESULTS-tpu.md). An explicit `--model.remat` always wins.
"""

from __future__ import annotations

import logging

import jax

from job.multihost import on_process_zero
from job.sharding import train_batch_size_divisor
from job.tasks.lm import attention

log = logging.getLogger(__name__)

POLICIES = {
    "none": None,  # no remat: every activation is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input: least memory, most recompute
    # the projections' outputs (x @ W) and attention's output (with splash's residuals): attention is not recomputed
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(attention.RESIDUALS)),
    "dots_all": jax.checkpoint_policies.checkpoint_dots,  # every matmul's output, attention's too
}
# per token and layer, in activations (of the compute dtype) of width dim (d) and mlp_dim (m): what each policy keeps
KEPT = {
    "none": lambda d, m: 12 * d + 4 * m,  # norms, q, k, v, attention's output, residuals, the MLP's hidden x 4
    "dots": lambda d, m: 7 * d + m,  # the block's input, the four projections', attention's and the MLP's outputs
    "full": lambda d, m: d,  # the block's input
}
STATE_BYTES = 16  # per parameter: float32 value, gradient and Adam's two moments
ACTIVATION_SHARE = 0.5  # of the memory the state leaves: XLA's temporaries and fusions take the rest
# HBM per chip by device_kind, where no real device can say (a compile ahead of time for a TPU topology)
HBM = {"TPU v4": 32 * 2**30, "TPU v5 lite": int(15.75 * 2**30), "TPU v5": 95 * 2**30, "TPU v6 lite": 32 * 2**30}


def name(remat: str | bool) -> str:
    """--model.remat as a policy name; True and False (configs saved when it was an on/off flag) read as
    "full" and "none"."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    return remat


def resolve(cfg: object, *, rows: int, length: int) -> str:
    """The policy the blocks of `cfg` (a ModelConfig) run under for a batch of `rows` x `length` tokens."""
    asked = name(getattr(cfg, "remat"))
    if asked != "auto":
        return asked
    where = attention.platform()
    memory = device_memory() if where != "cpu" else None
    if memory is None:
        on_process_zero(log.debug, "remat auto: none (%s: no device memory to fit)", where)
        return "none"
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else train_batch_size_divisor(mesh)
    dim, mlp, layers = (getattr(cfg, f) for f in ("dim", "mlp_dim", "layers"))
    width = 2 if getattr(cfg, "dtype") == "bfloat16" else 4
    tokens = rows * length / shards
    state = STATE_BYTES * parameters(cfg)
    budget = ACTIVATION_SHARE * (memory - state)
    for policy in ("none", "dots", "full"):
        kept = layers * tokens * KEPT[policy](dim, mlp) * width
        if kept <= budget or policy == "full":
            on_process_zero(log.info, "remat auto: %s (%.2f GiB of activations kept against %.2f GiB for them: "
                            "%.2f GiB of memory, %.2f GiB of state)", policy, kept / 2**30, budget / 2**30,
                            memory / 2**30, state / 2**30)
            return policy
    raise AssertionError("unreachable: full is always chosen last")


def parameters(cfg: object) -> int:
    """The example LM's parameter count (embedding, positions, blocks, head)."""
    v, t, d, m, n = (getattr(cfg, f) for f in ("vocab_size", "seq_len", "dim", "mlp_dim", "layers"))
    return 2 * v * d + t * d + n * (4 * d * d + 2 * d * m + 2 * d) + d


def device_memory() -> int | None:
    """Bytes of memory one accelerator has: the device_kind's HBM, else what the first device reports."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    kind = getattr(device, "device_kind", None)
    if kind in HBM:
        return HBM[kind]
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats: unknown
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


__all__ = ["HBM", "POLICIES", "device_memory", "name", "parameters", "resolve"]
