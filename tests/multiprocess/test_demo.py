"""`python -m job demo` (what `make run-local` runs) on 4 processes x 2 devices, and alone."""

from __future__ import annotations

import re
import sys

import pytest

from tests.launching import explain, launcher_argv, run

pytestmark = pytest.mark.multiprocess


def tensor_parallel_result(stdout: str) -> float:
    """The demo's tensor-parallel sum as process 0 printed it (float32: its last digit depends on the order
    XLA sums in)."""
    found = re.search(r"^\[rank 0\]   tensor-parallel layer over the global batch: ([0-9.]+) ", stdout, re.M)
    assert found, stdout
    return float(found.group(1))


def test_demo_on_4_processes_checks_the_global_result_on_every_rank() -> None:
    proc = run(launcher_argv(4, [sys.executable, "-m", "job", "demo"]))
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "[rank 0] [demo-4x2] local cluster: process 0 of 4" in proc.stdout
    assert "[rank 0]   mesh: {'data': 4, 'model': 2}; flat mesh: {'devices': 8}" in proc.stdout
    # closed form: 0.01 * 8 * 16 * sum(range(32)) = 634.88
    assert tensor_parallel_result(proc.stdout) == pytest.approx(634.88, rel=1e-6)
    assert "[rank 0] demo OK" in proc.stdout
    # only process 0 reports, and gloo's connection chatter is gone
    assert not any(line.startswith(("[rank 1]", "[rank 2]", "[rank 3]")) for line in proc.stdout.splitlines()), proc.stdout
    assert "Warning" not in proc.stderr


def test_demo_in_a_single_process_needs_no_launcher() -> None:
    proc = run([sys.executable, "-m", "job", "demo"], timeout=120)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "single cluster: process 0 of 1" in proc.stdout
    assert "demo OK" in proc.stdout


def test_demo_with_the_model_axis_across_processes_feeds_each_group_the_same_rows() -> None:
    # 2 processes x 1 device: the mesh is {'data': 1, 'model': 2}, one model group over both processes
    proc = run(launcher_argv(2, [sys.executable, "-m", "job", "demo"], devices=1))
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "[rank 0]   mesh: {'data': 1, 'model': 2}; flat mesh: {'devices': 2}" in proc.stdout
    # closed form: 0.01 * 8 * 16 * sum(range(8)) = 35.84
    assert tensor_parallel_result(proc.stdout) == pytest.approx(35.84, rel=1e-6)
    assert "local devices all" in proc.stderr  # each process's joining line says which devices it takes
