"""Where each kind of flax.nnx layer takes its sharding annotation: the answer the fallback warning shows.

A variable without an annotation is told by its name inside its layer: `scale` (a norm's), `bias` beside a
`scale` (a norm's), `embedding` (nnx.Embed's), `kernel` (nnx.Linear's, nnx.Conv's), `bias` (theirs); any other
is a parameter of the model's own. `grouped(paths)` gives, for each kind present, one line with its count and
the argument that annotates it where the layer is built, then its paths:

    grouped(["blocks/0/ln1/scale", "blocks/0/ln1/bias", "blocks/1/ln1/scale", "blocks/1/ln1/bias"])
    # ['- 2 norm scale(s) without an annotation (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm): '
    #  'scale_metadata=job.sharding.axes("embed")',
    #  '    blocks/0/ln1/scale, blocks/1/ln1/scale',
    #  '- 2 norm bias(es) without an annotation (nnx.LayerNorm, nnx.BatchNorm): '
    #  'bias_metadata=job.sharding.axes("embed")',
    #  '    blocks/0/ln1/bias, blocks/1/ln1/bias']
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from job.core import renamed

# kind -> (what it is, the layers it belongs to, the argument that annotates it there)
VARIABLE_KINDS: dict[str, tuple[str, str, str]] = {
    "norm_scale": ("norm scale(s)", "nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm",
                   'scale_metadata=job.sharding.axes("embed")'),
    "norm_bias": ("norm bias(es)", "nnx.LayerNorm, nnx.BatchNorm", 'bias_metadata=job.sharding.axes("embed")'),
    "embedding": ("embedding table(s)", "nnx.Embed", 'embedding_metadata=job.sharding.axes("vocab", "embed")'),
    "kernel": ("kernel(s)", "nnx.Linear; an nnx.Conv's is axes(None, None, \"embed\", \"mlp\")",
               'kernel_metadata=job.sharding.axes("embed", "mlp")'),
    "bias": ("bias(es)", "nnx.Linear, nnx.Conv",
             'bias_metadata=job.sharding.axes("mlp") (the name of its kernel\'s last dimension)'),
    "param": ("parameter(s) of the model's own", "nnx.Param", "nnx.Param(value, **job.sharding.axes(...))"),
}


def kind_of(path: str, paths: frozenset[str]) -> str:
    """The kind (a key of VARIABLE_KINDS) of the unannotated variable at `path`, among the unannotated `paths`."""
    parent, _, name = path.rpartition("/")
    if name == "scale":
        return "norm_scale"
    if name == "bias":
        return "norm_bias" if f"{parent}/scale" in paths or not parent and "scale" in paths else "bias"
    return name if name in ("embedding", "kernel") else "param"


def grouped(paths: Sequence[str], width: int = 116) -> list[str]:
    """The unannotated `paths` by kind of layer, in VARIABLE_KINDS' order: for each kind present, a line with its
    count, the layers it belongs to and the argument that annotates it where the layer is built, then its paths
    (indented, wrapped at `width`)."""
    every = frozenset(paths)
    kinds: dict[str, list[str]] = {kind: [] for kind in VARIABLE_KINDS}
    for path in paths:
        kinds[kind_of(path, every)].append(path)
    lines: list[str] = []
    for kind, found in kinds.items():
        if found:
            what, layers, argument = VARIABLE_KINDS[kind]
            lines.append(f"- {len(found)} {what} without an annotation ({layers}): {argument}")
            lines += textwrap.wrap(", ".join(found), width, initial_indent="    ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False)
    return lines


__getattr__ = renamed.answer(__name__, {"KINDS": "VARIABLE_KINDS"})  # the old name warns

__all__ = ["VARIABLE_KINDS", "grouped", "kind_of"]
