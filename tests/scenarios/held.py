"""The real training job (`python -m job ARGS`), writing what this process holds of its train state.

    held.py train --run-dir D [job flags]

Each process writes D/held-RANK.json: for the state right after it was created (`init`) and right
after it was restored (`restore`), {leaf path: [global shape, shape of this process's shards]} of
every array, and the peak RSS (MiB) of the process at that moment.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tasks import as from `python -m job` at the root
from job import __main__ as entry  # noqa: E402
from job.parallel.trees import path_str  # noqa: E402
from job.train import state  # noqa: E402

args = sys.argv[1:]
run_dir = Path(args[args.index("--run-dir") + 1])
record: dict[str, dict] = {}


def held(tree: object) -> dict:
    shapes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array):
            local = {tuple(shard.data.shape) for shard in leaf.addressable_shards}
            assert len(local) == 1, (path_str(path), local)
            shapes[path_str(path)] = [list(leaf.shape), list(local.pop())]
    return {"shapes": shapes, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def write() -> None:
    rank = jax.process_index()
    (run_dir / f"held-{rank}.json").write_text(json.dumps(record))


real_plan = state.plan


def plan(*a, **k):  # noqa: ANN002, ANN003, ANN202
    from job.runs import (  # imported here: orbax's import sets up logging before the job's own would
        checkpoint,
        tiers,
    )

    real_restore_newest = checkpoint.Checkpointer.restore_newest

    def restore_newest(self, like):  # noqa: ANN001, ANN202
        step, restored = real_restore_newest(self, like)
        record["restore"] = {"step": step, **held(restored)}
        write()
        return step, restored

    checkpoint.Checkpointer.restore_newest = restore_newest
    real_restore = tiers.Checkpoints.restore

    def restore(self, init):  # noqa: ANN001, ANN202
        restored = real_restore(self, init)
        if restored.origin.tier is tiers.Tier.FRESH:  # the state right after the init created it
            record["init"] = held(restored.state)
            write()
        return restored

    tiers.Checkpoints.restore = restore
    return real_plan(*a, **k)


state.plan = plan
sys.exit(entry.main(args))
