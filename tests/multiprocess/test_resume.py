"""Never lose a run, on 2 real processes: a changed flag is an error that leaves the checkpoints byte for
byte, only unreadable checkpoints are set aside and a run never restarts from step 0 over them, a SIGTERM
in the middle of an evaluation saves and requeues, and a recorded run repeats bitwise."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launching import ROOT, child_env, explain, launcher_argv, rank_pids, run, scenario, train, wait_for_line
from job.observe.status import state_of
from tests.multiprocess.test_train import JOB, REQUEUE, SMALL
from tests.records import records, summary

pytestmark = pytest.mark.multiprocess

BAD_INPUT = 2
FLAGS = ("--eval-every", "100", "--log-every", "2", "--model.dim", "32", "--model.mlp-dim", "64")


def digests(folder: Path) -> dict[str, str]:
    """Every file under `folder` with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_changed_flag_stops_with_one_error_and_leaves_every_checkpoint_byte_for_byte(tmp_path: Path) -> None:
    train(2, 1, tmp_path, "--steps", "4", "--ckpt.every", "2", "--model.layers", "2", *FLAGS)
    before, config = digests(tmp_path / "checkpoints"), (tmp_path / "config.json").read_text()
    assert {name.split("/")[0] for name in before} == {"2", "4"}

    changed = train(2, 1, tmp_path, "--steps", "8", "--ckpt.every", "2", "--model.layers", "3", *FLAGS,
                    expect=BAD_INPUT)
    out = changed.stdout + changed.stderr
    assert "--model.layers saved 2, given 3" in out, out
    assert "--steps saved" not in out  # a flag that leaves the state as it was is not a suspect
    assert "rerun with the saved flags (--model.layers 2)" in out and "--no-resume" in out
    assert "is unreadable" not in out and "moved the unreadable" not in out
    for rank in (0, 1):
        assert f"[rank {rank}] StateMismatch: --run-dir" in out  # every process stops with it, exit 2
    assert digests(tmp_path / "checkpoints") == before
    assert (tmp_path / "config.json").read_text() == config
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]

    # the unrolled layout of the same model is another state (blocks/0/... against the stacked blocks/...):
    # refused, naming the flag and the leaves, never misread
    unrolled = train(2, 1, tmp_path, "--steps", "8", "--ckpt.every", "2", "--model.layers", "2", "--model.no-scan",
                     *FLAGS, expect=BAD_INPUT)
    out = unrolled.stdout + unrolled.stderr
    assert "--model.scan saved True, given False" in out and "rerun with the saved flags (--model.scan True)" in out
    assert "model/blocks/attn/k/kernel/value: saved, not built by this run" in out, out
    assert digests(tmp_path / "checkpoints") == before

    original = train(2, 1, tmp_path, "--steps", "8", "--ckpt.every", "2", "--model.layers", "2", *FLAGS)
    assert "resumed from step 4" in original.stderr
    assert "changed since the saved run (the state is the same): --steps 4 -> 8" in original.stderr
    assert summary(tmp_path)["final_step"] == 8


def test_only_unreadable_checkpoints_are_set_aside_and_no_run_restarts_from_zero_over_them(tmp_path: Path) -> None:
    train(2, 1, tmp_path, "--steps", "4", "--ckpt.every", "2", "--model.layers", "1", *FLAGS)
    for path in (tmp_path / "checkpoints").rglob("*"):  # damage every step's arrays, keep the metadata
        if path.is_file() and path.stat().st_size > 0 and "METADATA" not in path.name:
            path.write_bytes(b"\0garbage" * 4)
    damaged = train(2, 1, tmp_path, "--steps", "8", *FLAGS, "--model.layers", "1", expect=BAD_INPUT)
    assert "is unreadable" in damaged.stderr and "steps [4, 2] all unreadable" in damaged.stderr + damaged.stdout
    aside = sorted(p.name.split(".")[0] for p in (tmp_path / "checkpoints").iterdir())
    assert aside == ["2", "4"] and all(".unreadable-" in p.name for p in (tmp_path / "checkpoints").iterdir())

    again = train(2, 1, tmp_path, "--steps", "8", *FLAGS, "--model.layers", "1", expect=BAD_INPUT)
    assert "set aside as unreadable" in again.stdout + again.stderr
    assert not (tmp_path / "checkpoints" / "8").exists()  # it did not train from step 0

    fresh = train(2, 1, tmp_path, "--steps", "4", *FLAGS, "--model.layers", "1", "--no-resume")
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.before-fresh-start-")]
    assert len(kept) == 1 and sorted(p.name.split(".")[0] for p in kept[0].iterdir()) == ["2", "4"]
    assert "starting afresh; the earlier checkpoints are kept in" in fresh.stderr
    assert summary(tmp_path)["final_step"] == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]


def test_sigterm_in_the_middle_of_a_long_evaluation_saves_the_step_and_requeues(tmp_path: Path,
                                                                                record_property) -> None:
    # 20 steps; at step 10 a long evaluation (thousands of batches); SIGTERM to rank 1 one second into it
    flags = ("--steps", "20", "--log-every", "10", "--eval-every", "10", "--ckpt.every", "100", *SMALL)
    argv = launcher_argv(2, [*JOB, "--run-dir", str(tmp_path), *flags, "--data.eval-batches", "5000"], devices=1)
    proc = subprocess.Popen(argv, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = wait_for_line(proc, "step 10/", timeout=180)
    time.sleep(1.0)
    pids = rank_pids(proc.pid)
    sent = time.monotonic()
    os.kill(pids[1], signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    record_property("sigterm_to_exit_s", round(time.monotonic() - sent, 2))
    output = "".join(lines) + out
    assert proc.returncode == REQUEUE, output
    assert "preempted: saved step 10" in output
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10"]
    assert not [r for r in records(tmp_path) if r["split"] == "eval"], "the evaluation at step 10 was not cut short"
    resumed = train(2, 1, tmp_path, *flags, "--data.eval-batches", "2")
    assert "resumed from step 10" in resumed.stderr and summary(tmp_path)["final_step"] == 20


# rank 1 gets SIGTERM once its state is built and restored, before its first step; or USR2 (Slurm's notice)
# just before the processes join the cluster
@pytest.mark.parametrize("fault", ["term-at-start", "usr2-at-join"])
def test_a_signal_before_the_first_step_exits_75_with_nothing_new_to_save(tmp_path: Path, fault: str) -> None:
    train(2, 1, tmp_path, "--steps", "2", "--ckpt.every", "2", *SMALL)
    before = digests(tmp_path / "checkpoints")
    proc = run(launcher_argv(2, scenario("faulty.py", "1", fault, "--", "train", "--run-dir",
                                         str(tmp_path), "--steps", "4", *SMALL), devices=1), timeout=180)
    assert proc.returncode == REQUEUE, explain(proc, proc.stdout, proc.stderr)
    assert "preempted before the first step: nothing new to save" in proc.stdout + proc.stderr
    assert digests(tmp_path / "checkpoints") == before


def test_a_recorded_run_reruns_bitwise_into_a_new_dir_and_a_code_difference_is_said_first(tmp_path: Path) -> None:
    original = tmp_path / "original"
    train(2, 2, original, "--steps", "6", "--ckpt.every", "3", *SMALL, "--log-every", "3", "--eval-every", "6")
    record = json.loads((original / "provenance.json").read_text())["attempts"][-1]
    assert record["argv"][0] == "train" and record["topology"]["processes"] == 2
    assert record["topology"]["local_devices"] == 2 and record["python"] and record["packages"]["jax"]
    assert "XLA_FLAGS" in record["env"] and record["locks"]["requirements.lock"]

    proc = subprocess.run([sys.executable, "-m", "job", "rerun", str(original), str(tmp_path / "again")],
                          env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert summary(tmp_path / "again")["params_sha256"] == summary(original)["params_sha256"]

    edited = tmp_path / "edited"
    shutil.copytree(original, edited, ignore=shutil.ignore_patterns("checkpoints"))
    record_file = json.loads((edited / "provenance.json").read_text())
    record_file["attempts"][-1]["code"]["commit"] = "0" * 40
    record_file["attempts"][-1]["packages"]["jax"] = "0.4.1"
    (edited / "provenance.json").write_text(json.dumps(record_file))
    proc = subprocess.run([sys.executable, "-m", "job", "rerun", str(edited), str(tmp_path / "third")],
                          env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "rerun: this checkout differs from the one that ran" in proc.stderr
    assert f"commit: recorded {'0' * 40}" in proc.stderr and "jax: recorded 0.4.1" in proc.stderr
    assert summary(tmp_path / "third")["params_sha256"] == summary(original)["params_sha256"]

    refused = run([sys.executable, "-m", "job", "rerun", str(original), str(tmp_path / "again")])
    assert refused.returncode == BAD_INPUT and "expected a new or empty folder" in refused.stderr


def test_a_users_task_package_is_recorded_and_a_change_to_it_is_said_before_the_rerun(tmp_path: Path) -> None:
    """The task in a package of the user's own (mypkg/, on PYTHONPATH): provenance.json names its module and
    hashes its files; after an edit to the package, rerun says which package changed and from which hash."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / "tests" / "user_tasks" / "regression.py", tmp_path / "mypkg" / "tasks.py")
    user = {"PYTHONPATH": str(tmp_path)}
    train(2, 1, tmp_path / "original", "--task", "mypkg.tasks:TASK", "--steps", "2", **user)
    task = json.loads((tmp_path / "original" / "provenance.json").read_text())["attempts"][-1]["task"]
    assert task["file"] == str(tmp_path / "mypkg" / "tasks.py") and task["files"] == 2, task
    assert task["pythonpath"] == str(tmp_path) and task["git"] is None  # tmp_path: no repository

    with open(tmp_path / "mypkg" / "tasks.py", "a", encoding="utf-8") as f:
        f.write("# the user edits the model after the run\n")
    proc = subprocess.run([sys.executable, "-m", "job", "rerun", str(tmp_path / "original"), str(tmp_path / "again")],
                          env=child_env(**user), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert (f"task package mypkg: its files changed since the run (hash {task['sha256']} -> "
            in proc.stderr), proc.stderr
    assert summary(tmp_path / "again")["params_sha256"] == summary(tmp_path / "original")["params_sha256"]


@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_saves_at_the_next_step_stops_with_130_and_the_same_command_resumes_bitwise(
        tmp_path: Path, processes: int) -> None:
    """Ctrl-C (SIGINT) to the launcher, or to `python -m job train` on its own: the step in progress ends, it is
    saved, every process leaves with 130 and no traceback, no half-written checkpoint is left, `python -m job runs`
    says stopped at that step, and the same command resumes it to an uninterrupted run's parameters."""
    flags = ("--steps", "2000", "--ckpt.every", "1000", "--optim.decay-steps", "2000", *FLAGS)  # one schedule
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    command = [*JOB, "--run-dir", str(run_dir), *flags]
    argv = launcher_argv(processes, command, devices=1) if processes > 1 else command
    proc = subprocess.Popen(argv, env=child_env(XLA_FLAGS="--xla_force_host_platform_device_count=1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = wait_for_line(proc, "step 4/2000", timeout=180)
    os.kill(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the foreground process
    out, _ = proc.communicate(timeout=120)
    output = "".join(seen) + out
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    stopped = int(re.search(r"stopped \(Ctrl-C\): saved step (\d+); exiting with 130", output).group(1))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [str(stopped)]  # nothing half-written beside it
    status = state_of(run_dir)
    assert status.describe() == f"stopped at step {stopped} (Ctrl-C; the same command resumes)", status

    train(processes, 1, reference, *flags[:1], str(stopped + 3), *flags[2:])
    resumed = run(launcher_argv(processes, [*JOB, "--run-dir", str(run_dir), "--steps", str(stopped + 3),
                                            *flags[2:]], devices=1) if processes > 1 else
                  [*JOB, "--run-dir", str(run_dir), "--steps", str(stopped + 3), *flags[2:]], timeout=300)
    assert resumed.returncode == 0 and f"resumed from step {stopped}" in resumed.stderr, explain(resumed)
    assert "remat auto: none (remembered from this run's earlier attempt, compiled once" in resumed.stderr
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
