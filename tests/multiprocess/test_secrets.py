"""A real training run with secrets in its environment writes none of them, to its output or to any file
of its run (the scanners are the unit tier's, tests/unit/test_security.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_security import ROOT, SECRETS, files_under, holding, leaks

pytestmark = pytest.mark.multiprocess


def test_a_training_run_writes_no_secret_from_its_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-canary-5d2e"
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(SECRETS, JAX_PLATFORMS="cpu", HOME=str(home), TMPDIR=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "job", "train", "--run-dir", str(run_dir), "--steps", "2", "--log-every", "1",
            "--eval-every", "2", "--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = list(files_under(tmp_path))
    # Not vacuous: the run wrote its config, metrics and a checkpoint, and the scan reads them.
    assert {"config.json", "metrics.jsonl", "summary.json", "_CHECKPOINT_METADATA"} <= {p.name for p in written}
    assert "config.json" in holding(run_dir, "run-canary-5d2e")
    found = leaks({"stdout": proc.stdout, "stderr": proc.stderr,
                   **{str(p.relative_to(tmp_path)): p.read_bytes() for p in written}})
    assert not found, f"expected no secret from the environment in the run's output or files, found {found}"
