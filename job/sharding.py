"""Sharding helpers for Flax NNX models: a drop-in for GenSBI's, name for name.

The public face of `job.parallel.sharding` (where the code and its documentation live): import it
from here, `from job import sharding`; the library itself imports `job.parallel.sharding`.
"""

from job.parallel.sharding import (
    DATA_AXIS,
    LOGICAL_AXES,
    MODEL_AXIS,
    RULES,
    TRAIN_RULES,
    UNANNOTATED,
    AxisRules,
    axes,
    batch_axes,
    batch_size_divisor,
    check_batch_divisible,
    fallback_warning,
    make_mesh,
    mesh_context,
    pad_for_mesh,
    partitioned,
    placement,
    replicate,
    resolve_mesh,
    rule_table,
    shard_batch,
    shard_model,
    shard_sample_init,
    sharding_of,
)

__all__ = [
    "DATA_AXIS",
    "MODEL_AXIS",
    "LOGICAL_AXES",
    "RULES",
    "TRAIN_RULES",
    "UNANNOTATED",
    "axes",
    "partitioned",
    "make_mesh",
    "batch_axes",
    "batch_size_divisor",
    "AxisRules",
    "rule_table",
    "placement",
    "fallback_warning",
    "shard_model",
    "shard_batch",
    "shard_sample_init",
    "replicate",
    "check_batch_divisible",
    "sharding_of",
    "resolve_mesh",
    "pad_for_mesh",
    "mesh_context",
]
