"""What bench.ckpt.options and bench.ckpt.beside share: their command line and OUT_DIR record, a state shaped like
gpt2-small's train state, orbax's manager with the template's handler, and a ~60 ms matmul step timed one by one.
Imports jax: only those two import it, on the chip they measure."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.type_handlers import ArrayHandler, create_type_handler_registry, get_type_handler, supported_types


def arguments(argv: list[str] | None, prog: str, doc: str, *, only: tuple[str, ...] = ()) -> argparse.Namespace:
    """`prog OUT_DIR [--small]` parsed (`out`: OUT_DIR made and absolute; `small`); where `only` names the variants,
    `--only A,B` too (`only`: the names among them that contain A or B; all without it)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("out", type=Path, help="where the figures (JSON) and the scratch folders go")
    p.add_argument("--small", action="store_true", help="a CPU-sized dry run: a smaller state and step")
    if only:
        p.add_argument("--only", default="", help="comma-separated parts of the variants' names to run")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.absolute()  # orbax takes absolute paths only
    if only:
        parts = [x for x in args.only.split(",") if x]
        args.only = [name for name in only if not parts or any(x in name for x in parts)]
    return args


def scratch(out: Path) -> Path:
    """OUT_DIR/folders, empty: where the checkpoints are written."""
    folders = out / "folders"
    shutil.rmtree(folders, ignore_errors=True)
    folders.mkdir(parents=True)
    return folders


class Record:
    """OUT_DIR/NAME.json: one run's figures, each printed as it comes and the file rewritten after it."""

    def __init__(self, out: Path, name: str) -> None:
        self.path = out / f"{name}.json"
        self.figures: dict[str, Any] = {}

    def put(self, key: str, value: Any, *, shown: Any = None) -> None:
        """`value` under `key`; printed as `shown` where given (rounded figures)."""
        self.figures[key] = value
        print(key, value if shown is None else shown, flush=True)
        self.path.write_text(json.dumps(self.figures, indent=1, default=str))


def state_shapes(small: bool) -> list[tuple[int, ...]]:
    """gpt2-small's parameters' shapes (its embedding an eighth as tall with `small`): 125 arrays, 1 of 3 in the
    train state (the parameters and Adam's two moments)."""
    shapes: list[tuple[int, ...]] = [(50304 // (8 if small else 1), 768)] * 2
    for _ in range(12):
        shapes += [(768, 2304), (2304,), (768, 768), (768,), (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)]
    return shapes + [(1024, 768), (768,), (768,)]


def train_state(small: bool) -> dict[str, list[jax.Array]]:
    """Random f32 arrays of `state_shapes`, three of each ("p", "mu", "nu"): about 1.9 GB (small: about 1.1 GB)."""
    made: dict[tuple[int, ...], Callable[[jax.Array], jax.Array]] = {}

    def filled(shape: tuple[int, ...], seed: int) -> jax.Array:
        if shape not in made:
            made[shape] = jax.jit(lambda key, s=shape: jax.random.normal(key, s, jnp.float32))
        return made[shape](jax.random.key(seed))

    state = {kind: [filled(s, i * 3 + j) for i, s in enumerate(state_shapes(small))]
             for j, kind in enumerate(("p", "mu", "nu"))}
    return jax.block_until_ready(state)


def handler(**options: Any) -> ocp.PyTreeCheckpointHandler:
    """The template's handler (job/runs/checkpoint.py: one replica per array, no compression) with `options`."""
    others = [(ty, get_type_handler(ty)) for ty in supported_types() if ty is not jax.Array]
    registry = create_type_handler_registry((jax.Array, ArrayHandler(use_replica_parallel=False)), *others)
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False, **options)


def manager(path: Any, **options: Any) -> ocp.CheckpointManager:
    """An async manager keeping one step, saving through `handler(**options)`."""
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
        max_to_keep=1, enable_async_checkpointing=True, enable_background_delete=True, create=True),
        item_handlers=handler(**options))


class Stepper:
    """Ten chained bf16 matmuls of N x N (about 60 ms on a v5e chip at 8192): `one()` times a step to its end."""

    def __init__(self, small: bool) -> None:
        n = 1024 if small else 8192
        self.step = jax.jit(self._chain)
        self.y = self.step(jax.random.normal(jax.random.key(7), (n, n), jnp.bfloat16)).block_until_ready()

    @staticmethod
    def _chain(a: jax.Array) -> jax.Array:
        for _ in range(10):
            a = (a @ a) * 1e-4
        return a

    def one(self) -> float:
        began = time.perf_counter()
        self.y = self.step(self.y)
        self.y.block_until_ready()
        return time.perf_counter() - began
