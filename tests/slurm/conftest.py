"""The Slurm tier: tests against the real local Slurm cluster (`make slurm-up NODES=4`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.slurm.partitions import NODE_FORMAT, Node, parse_nodes

CLUSTER_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/tmp/jax-job-slurm"))
NODES = 4  # what the tier's tests ask for


def _cluster_env() -> dict[str, str] | None:
    conf = CLUSTER_DIR / "etc" / "slurm.conf"
    if shutil.which("sbatch") is None or not conf.exists():
        return None
    env = dict(os.environ)
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = f"{CLUSTER_DIR / 'bin'}:{env['PATH']}"
    return env


def _nodes(env: dict[str, str]) -> tuple[Node, ...] | None:
    """Every node sinfo lists, with its state; None when no controller answers."""
    probe = subprocess.run(["sinfo", "--noheader", "--Node", "--format", NODE_FORMAT], env=env, capture_output=True,
                           text=True, timeout=60)
    return parse_nodes(probe.stdout) if probe.returncode == 0 else None


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    env = _cluster_env()
    nodes = None if env is None else _nodes(env)
    if env is None or nodes is None:
        pytest.skip(f"no local Slurm cluster: start one with `make slurm-up NODES={NODES}` (as root)")
    silent = [node for node in nodes if not node.answers]
    if silent:
        pytest.fail(f"the local Slurm cluster: expected every node to answer the controller, found "
                    f"{', '.join(node.said() for node in silent)}. Fix: `make slurm-up NODES={NODES}` (as root) "
                    "starts a slurmd that died")
    idle = sum(node.state == "idle" for node in nodes)
    if idle < NODES:
        pytest.skip(f"expected {NODES} idle nodes on the local Slurm cluster, found {idle}: wait for its jobs to "
                    f"end (squeue), or start it with `make slurm-up NODES={NODES}` (as root)")
    return env
