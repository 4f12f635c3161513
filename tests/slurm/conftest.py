"""The Slurm tier: tests against the real local cluster (`make slurm-up NODES=4`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLUSTER_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/tmp/jax-job-slurm"))


def _cluster_env() -> dict[str, str] | None:
    conf = CLUSTER_DIR / "etc" / "slurm.conf"
    if shutil.which("sbatch") is None or not conf.exists():
        return None
    env = dict(os.environ)
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = f"{CLUSTER_DIR / 'bin'}:{env['PATH']}"
    probe = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], env=env, capture_output=True, text=True)
    if probe.returncode != 0 or sum(int(n) for n in probe.stdout.split() or ["0"]) < 4:
        return None
    return env


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    env = _cluster_env()
    if env is None:
        pytest.skip("no local Slurm cluster with 4 idle nodes: start one with `make slurm-up NODES=4` (as root)")
    return env
