"""Where each kind of flax.nnx layer takes its sharding annotation: the answer the fallback warning shows.

A variable without an annotation is told by its name inside its layer: `scale` (a norm's), `bias` beside a
`scale` (a norm's), `embedding` (nnx.Embed's), `kernel` (nnx.Linear's, nnx.Conv's), `bias` (theirs); any other
is a parameter of the model's own. `hints(paths)` gives one line per kind present, with its count:

    hints(["blocks/0/ln1/scale", "blocks/0/ln1/bias", "blocks/1/ln1/scale", "blocks/1/ln1/bias"])
    # ['- 2 norm scale(s) (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm): scale_metadata=job.sharding.axes("embed")',
    #  '- 2 norm bias(es) (nnx.LayerNorm, nnx.BatchNorm): bias_metadata=job.sharding.axes("embed")']
"""

from __future__ import annotations

from collections.abc import Sequence

# kind -> (what it is, the layers it belongs to, the argument that annotates it there)
KINDS: dict[str, tuple[str, str, str]] = {
    "norm_scale": ("norm scale(s)", "nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm",
                   'scale_metadata=job.sharding.axes("embed")'),
    "norm_bias": ("norm bias(es)", "nnx.LayerNorm, nnx.BatchNorm", 'bias_metadata=job.sharding.axes("embed")'),
    "embedding": ("embedding table(s)", "nnx.Embed", 'embedding_metadata=job.sharding.axes("vocab", "embed")'),
    "kernel": ("kernel(s)", "nnx.Linear; an nnx.Conv's is axes(None, None, \"in\", \"out\")",
               'kernel_metadata=job.sharding.axes("embed", "mlp")'),
    "bias": ("bias(es)", "nnx.Linear, nnx.Conv",
             'bias_metadata=job.sharding.axes("mlp") (the name of its kernel\'s last dimension)'),
    "param": ("parameter(s) of the model's own", "nnx.Param", "nnx.Param(value, **job.sharding.axes(...))"),
}


def kind_of(path: str, paths: frozenset[str]) -> str:
    """The kind (a key of KINDS) of the unannotated variable at `path`, among the unannotated `paths`."""
    parent, _, name = path.rpartition("/")
    if name == "scale":
        return "norm_scale"
    if name == "bias":
        return "norm_bias" if f"{parent}/scale" in paths or not parent and "scale" in paths else "bias"
    return name if name in ("embedding", "kernel") else "param"


def hints(paths: Sequence[str]) -> list[str]:
    """One line per kind of layer among the unannotated `paths`, in KINDS' order: its count, the layers it
    belongs to and the argument that annotates it where the layer is built."""
    every = frozenset(paths)
    counts = dict.fromkeys(KINDS, 0)
    for path in paths:
        counts[kind_of(path, every)] += 1
    return [f"- {count} {KINDS[kind][0]} ({KINDS[kind][1]}): {KINDS[kind][2]}"
            for kind, count in counts.items() if count]


__all__ = ["KINDS", "hints", "kind_of"]
