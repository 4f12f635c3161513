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


@pytest.mark.parametrize("who", ["all", "1"])
def test_an_error_raised_together_is_printed_by_each_process_that_raises_it_and_ends_the_job_with_2(
        who: str) -> None:
    """job.runtime.preflight.raise_together: each raising process prints the error before any exits (the first
    exit has the launcher stop the rest), so with `all` both say it; raised by process 1 alone, the barrier
    process 0 never comes to does not turn it into a barrier timeout, and the job still ends with 2."""
    proc = run(launcher_argv(2, scenario("raise_together.py", who)), timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    raising = (0, 1) if who == "all" else (1,)
    for rank in raising:
        said = [line for line in output.splitlines() if line.startswith(f"[rank {rank}] ConfigError: --thing")]
        assert said == [f"[rank {rank}] ConfigError: --thing: expected a good thing, found 'a bad one on process "
                        f"{rank}'. Fix: pass a good one"], output
    assert "BarrierTimeout" not in output and "Traceback" not in output, output
    if who == "1":
        assert "[rank 0] going on on process 0" in output, output  # it was stopped in its long wait
