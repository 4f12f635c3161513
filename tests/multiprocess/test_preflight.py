"""Preflight on real processes: a host with another version, other flags, or no write access
stops the job before training with one report from process 0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launching import explain, launcher_argv, run, scenario

pytestmark = pytest.mark.multiprocess

SMALL = ("--steps", "4", "--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")


def stopped_in_preflight(run_dir: Path, rank: int, fault: str) -> str:
    """tests/scenarios/faulty.py with `fault` on `rank` of 3: the job exits 1 before its first step; its stderr."""
    argv = launcher_argv(3, scenario("faulty.py", str(rank), fault, "--", "train", "--run-dir", str(run_dir), *SMALL),
                         devices=1)
    proc = run(argv, timeout=180)
    assert proc.returncode == 1, explain(proc, proc.stdout, proc.stderr)
    assert "step 1/" not in proc.stderr and not (run_dir / "metrics.jsonl").exists()
    return proc.stderr


def report_lines(stderr: str) -> list[str]:
    return [line.removeprefix("[rank 0] ") for line in stderr.splitlines() if line.startswith("[rank 0]   ")]


def test_a_host_with_another_jax_version_is_named(tmp_path: Path) -> None:
    err = stopped_in_preflight(tmp_path, 2, "version=jax:0.4.1")
    assert "[rank 0] PreflightError: preflight: stopping before training: 3 processes" in err
    table = report_lines(err)
    assert [table[0].split()[i] for i in (0, 1, 3, 4, 6, 7)] == ["process", "0", "process", "1", "process", "2"]
    jax_row = next(line.split() for line in table if line.split()[0] == "jax")
    assert jax_row[1] == jax_row[2] != jax_row[3] == "0.4.1"
    assert "Fix: run the same image or environment, and the same code, on every host" in err
    for rank in (1, 2):
        assert f"[rank {rank}] PreflightError: preflight: this job's processes differ or fail on jax" in err


def test_a_host_started_with_other_flags_names_each_field(tmp_path: Path) -> None:
    err = stopped_in_preflight(tmp_path, 1, "flag=--seed:7")
    seed_row = next(line.split() for line in report_lines(err) if line.split()[0] == "config.seed")
    assert seed_row[1:] == ["0", "7", "0"]
    assert "Fix: pass the same flags to every process" in err


def test_one_process_preflight_passes_and_says_so(tmp_path: Path) -> None:
    proc = run([sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path), *SMALL], timeout=180)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "preflight: 1 process(es) agree: jax " in proc.stderr
