"""A checkpoint writer in a process of its own, for bench.ckpt.beside: whether the steps beside a write still slow
down when no thread of the training process writes.

The loop's process copies the state to host memory (every device-to-host copy started at once) into one shared
memory block and sends the block's name and the arrays' layout to a spawned writer. The writer (nice 19, jax on the
CPU only, so that it never opens the chip) wraps the block's bytes as numpy arrays and writes them with orbax's
synchronous checkpointer through the template's handler, then answers. One save at a time; the block is freed when
the writer answers.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np


def _serve(conn: Connection, folder: str) -> None:
    """The writer's loop: (step, block name, [(key, offset, shape, dtype)]) in, "written" out; None ends it."""
    os.nice(19)
    import orbax.checkpoint as ocp

    from bench.ckpt.chip_state import handler

    checkpointer = ocp.Checkpointer(handler())
    conn.send("ready")
    while (job := conn.recv()) is not None:
        step, name, layout = job
        block = shared_memory.SharedMemory(name=name)
        try:
            tree = {key: np.ndarray(shape, np.dtype(dtype), buffer=block.buf, offset=offset)
                    for key, offset, shape, dtype in layout}
            checkpointer.save(Path(folder) / str(step), args=ocp.args.PyTreeSave(tree), force=True)
            del tree
        finally:
            block.close()
        conn.send("written")


class ProcessWriter:
    """start(step, tree of jax arrays) blocks for the host copy; writing(), finish() and close() as a Mechanism."""

    def __init__(self, folder: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        before = os.environ.get("JAX_PLATFORMS")
        os.environ["JAX_PLATFORMS"] = "cpu"  # the spawned writer imports jax through orbax: never the chip
        try:
            self._process = context.Process(target=_serve, args=(theirs, str(folder)), daemon=True)
            self._process.start()
        finally:
            if before is None:
                os.environ.pop("JAX_PLATFORMS")
            else:
                os.environ["JAX_PLATFORMS"] = before
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            raise RuntimeError(f"the writer process did not start within 120 s (exit code {self._process.exitcode})")
        self._block: shared_memory.SharedMemory | None = None

    def start(self, step: int, tree: Any) -> None:
        import jax

        leaves = jax.tree_util.tree_leaves_with_path(tree)
        for _, x in leaves:
            x.copy_to_host_async()
        total = sum(x.nbytes for _, x in leaves)
        self._block = shared_memory.SharedMemory(create=True, size=max(total, 1))
        layout, offset = [], 0
        for path, x in leaves:
            host = np.asarray(x)
            np.copyto(np.ndarray(host.shape, host.dtype, buffer=self._block.buf, offset=offset), host)
            layout.append((jax.tree_util.keystr(path), offset, host.shape, host.dtype.str))
            offset += host.nbytes
        self._conn.send((step, self._block.name, layout))

    def writing(self) -> bool:
        if self._block is None:
            return False
        if not self._conn.poll():
            return True
        self.finish()
        return False

    def finish(self) -> None:
        if self._block is None:
            return
        if self._conn.recv() != "written":
            raise RuntimeError("the writer process failed")
        self._block.close()
        self._block.unlink()
        self._block = None

    def close(self) -> None:
        self.finish()
        self._conn.send(None)
        self._process.join(timeout=30)
