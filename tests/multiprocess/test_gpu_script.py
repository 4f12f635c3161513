"""bench/gpu.sh, the one prepared GPU check, run on its CPU path: every step runs and is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess


def test_the_gpu_script_runs_every_step_on_cpu_and_writes_them(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    proc = subprocess.run([str(ROOT / "bench" / "gpu.sh"), "--cpu", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert "| template (job.train.steps.jit_train_step) |" in text and "| failed (" not in text, text
    rows = [line for line in text.splitlines() if line.startswith(("| created sharded", "| resumed"))]
    assert len(rows) == 2 and all("76,096" in row and " MiB |" in row for row in rows), text
