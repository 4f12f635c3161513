"""The node-local tier on real processes (job/runs/local_tier.py): a SIGKILLed process resumes from it bitwise under
every rule, a fresh start clears what an earlier attempt left, a local file changed by one bit falls back to the
persistent tier with one warning naming it (bitwise equal afterwards), and two runs of the same relative run dir
from two checkouts keep their own steps. One process, the files and the server: tests/unit/test_local_tier.py
and test_local_transport.py; a lost node, its shards fetched from a peer: tests/slurm/test_retries.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from job.runs.local_tier import run_folder
from tests.launching import SCENARIOS, child_env, explain, launcher_argv, run, scenario, train
from tests.records import summary

pytestmark = pytest.mark.multiprocess

# a step that never ends (the tensor rule's case was reported once as a hang) is the watchdog's exit 86 with every
# process's stack and the roll call naming the stuck one, well within the launch's 300 s
FLAGS = ("--eval-every", "100", "--log-every", "2", "--model.dim", "32", "--model.mlp-dim", "64", "--watchdog-s", "120")
RULES = {"replicated": (), "fsdp": (), "tensor": ("--model-axis", "2"), "fsdp_tensor": ("--model-axis", "2")}


def _killed(run_dir: Path, at: int, *flags: str) -> None:
    """The job on 2 processes x 2 devices, rank 1 SIGKILLed when step `at` starts."""
    killed = run(launcher_argv(2, scenario("faulty.py", "1", f"kill@{at}", "--", "train", "--run-dir", str(run_dir),
                                           *flags), devices=2), timeout=300)
    assert killed.returncode == 137, explain(killed)


def _local_steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("rule", list(RULES))
def test_a_killed_process_resumes_from_the_node_local_tier_bitwise_under_every_rule(tmp_path: Path, rule: str) -> None:
    """--ckpt.local-every 3 with persistent saves only every 100 steps: rank 1 is SIGKILLed when step 8 starts; the
    next start restores step 6 from the node-local folder (each process its own shards) and ends bitwise equal to an
    uninterrupted run. The run's folder and the user's above it are private; a completed run leaves no folder."""
    local = tmp_path / "local"
    flags = ("--steps", "12", "--ckpt.every", "100", "--ckpt.local-every", "3", "--ckpt.local-dir", str(local),
             "--rule", rule, *RULES[rule], *FLAGS)
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    train(2, 2, reference, *flags)
    _killed(run_dir, 8, *flags)
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    folder = run_folder(str(local), str(run_dir))
    assert _local_steps(folder) == ["3", "6"]  # the newest two local steps
    assert _local_steps(folder / "6") == ["process-0.jlt", "process-1.jlt"]
    assert folder.stat().st_mode & 0o777 == folder.parent.stat().st_mode & 0o777 == 0o700
    resumed = train(2, 2, run_dir, *flags)
    assert "resumed from step 6 (the node-local tier: every process's from its own node)" in resumed.stderr, \
        explain(resumed)
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
    assert not folder.exists()  # completed: the run's local folder is gone


def test_a_fresh_start_clears_the_local_steps_an_earlier_attempt_left(tmp_path: Path) -> None:
    """Killed at step 8, the folder holds steps 3 and 6; a fresh start (--no-resume) killed at step 5 leaves its step
    3 only, not the earlier 6 (which a later restart would have restored into the new run)."""
    local, run_dir = tmp_path / "local", tmp_path / "run"
    flags = ("--steps", "12", "--ckpt.every", "100", "--ckpt.local-every", "3", "--ckpt.local-dir", str(local), *FLAGS)
    _killed(run_dir, 8, *flags)
    folder = run_folder(str(local), str(run_dir))
    assert _local_steps(folder) == ["3", "6"]
    _killed(run_dir, 5, *flags, "--no-resume")
    assert _local_steps(folder) == ["3"]


def test_a_flipped_byte_in_a_local_file_falls_back_to_the_persistent_tier_bitwise_with_one_warning_naming_it(
        tmp_path: Path) -> None:
    """Persistent saves every 4 steps, local ones every 3: killed at step 8, step 6 is local and step 4 persistent.
    One bit of process 1's step-6 file flipped: its checksum fails, every process restores step 4 from the
    persistent tier instead, one warning names the file, and the run ends bitwise equal to an uninterrupted one."""
    local = tmp_path / "local"
    flags = ("--steps", "12", "--ckpt.every", "4", "--ckpt.local-every", "3", "--ckpt.local-dir", str(local),
             "--rule", "fsdp", *FLAGS)
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    train(2, 2, reference, *flags)
    _killed(run_dir, 8, *flags)
    damaged = run_folder(str(local), str(run_dir)) / "6" / "process-1.jlt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x04
    damaged.write_bytes(bytes(data))
    resumed = train(2, 2, run_dir, *flags)
    out = resumed.stdout + resumed.stderr
    warned = [line for line in out.splitlines() if "node-local step 6 not restored" in line]
    assert len(warned) == 1 and str(damaged) in warned[0] and "checksum" in warned[0], explain(resumed)
    assert f"resumed from step 4 ({run_dir / 'checkpoints'})" in resumed.stderr, explain(resumed)
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]


def _in_checkout(checkout: Path, local: Path, *fault: str) -> subprocess.CompletedProcess[str]:
    """`python -m job train --run-dir runs/example` (relative) from `checkout`, one process of 2 devices, through
    faulty.py when `fault` names one."""
    checkout.mkdir(exist_ok=True)
    argv = [sys.executable, str(SCENARIOS / "faulty.py"), "0", *fault, "--"] if fault else [sys.executable, "-m", "job"]
    argv += ["train", "--run-dir", "runs/example", "--steps", "12", "--ckpt.every", "100", "--ckpt.local-every", "3",
             "--ckpt.local-dir", str(local), *FLAGS]
    return subprocess.run(argv, cwd=checkout, env=child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                          capture_output=True, text=True, timeout=300)


def test_two_runs_of_the_same_relative_run_dir_from_two_checkouts_keep_their_own_steps(tmp_path: Path) -> None:
    """Checkout a is killed at step 8 (local steps 3 and 6); checkout b, a fresh run of the same relative run dir
    on the same node and local dir, starts (clearing its own folder) and is killed at step 5; a resumes from its
    own step 6, and b's step 3 is still b's."""
    local, a, b = tmp_path / "local", tmp_path / "a", tmp_path / "b"
    first = _in_checkout(a, local, "kill@8")
    assert first.returncode == -9, explain(first)
    second = _in_checkout(b, local, "kill@5")
    assert second.returncode == -9, explain(second)
    mine, theirs = run_folder(str(local), str(a / "runs/example")), run_folder(str(local), str(b / "runs/example"))
    assert mine != theirs and _local_steps(mine) == ["3", "6"] and _local_steps(theirs) == ["3"]
    assert sorted(p.name for p in local.iterdir()) == [f"jax-job-{os.getuid()}"]
    resumed = _in_checkout(a, local)
    assert resumed.returncode == 0 and "resumed from step 6 (the node-local tier" in resumed.stderr, explain(resumed)
    assert not mine.exists() and _local_steps(theirs) == ["3"]
