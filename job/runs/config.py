"""How a run saves its checkpoints (`--ckpt.*`): the config `Checkpointer` (job/runs/checkpoint.py) reads.

    Checkpointer(rundir.checkpoints(run_dir), CheckpointConfig(every=50, keep=3))
    python -m job train --ckpt.every 100 --ckpt.keep 2 --ckpt.no-async-save

`TrainConfig` (job/train/config.py) holds it as `ckpt`. It lives apart from the checkpointer
so that the config imports without jax or orbax.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # save every N steps (and always at the end and on preemption)
    keep: int = 3  # how many of the newest checkpoints to keep
    async_save: bool = True  # write from host memory in the background while training continues (the loop waits
    # only for the state's copy to the host)
    local_every: int = 0  # also save every N steps to a node-local folder, held by a peer too (0: off; local_tier.py)
    local_dir: str = "/dev/shm"  # where node-local folders go: LOCAL_DIR/jax-job-UID/RUN (memory; or node scratch)


def checks_of(cfg: CheckpointConfig) -> tuple[tuple[bool, str, str, object, str], ...]:
    """(ok, flag, expected, found, fix) of each `--ckpt.*` value, for the run's config check
    (job/train/config.py `validate`) to raise the first that fails."""
    return (
        (cfg.every >= 1, "--ckpt.every", "an integer >= 1", cfg.every, "pass --ckpt.every 50"),
        (cfg.keep >= 1, "--ckpt.keep", "an integer >= 1", cfg.keep, "pass --ckpt.keep 3"),
        (cfg.local_every >= 0, "--ckpt.local-every", "an integer >= 0 (0: no node-local tier)",
         cfg.local_every, "pass --ckpt.local-every 10"),
        (cfg.local_dir.startswith("/"), "--ckpt.local-dir", "an absolute path on each node's own disk or memory",
         cfg.local_dir, "pass --ckpt.local-dir /dev/shm (or the node's scratch folder)"),
    )
