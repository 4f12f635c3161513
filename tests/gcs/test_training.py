"""Training with --run-dir gs://BUCKET/FOLDER on real processes against the Cloud Storage emulator:
preemption and exact resume from the bucket, a save killed mid-commit, a bucket the job cannot
use, and an unreadable checkpoint moved aside. What the job wrote is read back through the
emulator's own JSON API, not through the job's code."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gcs_emulator import BUCKET, Emulator
from tests.launching import ROOT, child_env, explain, launcher_argv, rank_pids, run, train, wait_for_line
from tests.records import summary

pytestmark = [pytest.mark.gcs, pytest.mark.multiprocess, pytest.mark.slow]

JOB = [sys.executable, "-m", "job", "train"]
REQUEUE = 75
FLAGS = ("--steps", "12", "--ckpt.every", "2", "--ckpt.keep", "10", "--log-every", "1", "--eval-every", "12",
         "--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")
RUN = f"gs://{BUCKET}/run1"


def objects(gcs: Emulator, under: str = "run1/") -> list[str]:
    return gcs.objects(under)


def bucket_summary(gcs: Emulator) -> dict:
    """summary.json of the run in gs://BUCKET/run1, read through the emulator."""
    return json.loads(gcs.read("run1/summary.json"))


def committed(gcs: Emulator) -> list[int]:
    """Steps whose commit marker is in the bucket (what orbax lists in gs://)."""
    names = objects(gcs, "run1/checkpoints/")
    return sorted(int(n.split("/")[2]) for n in names if n.split("/")[2].isdigit()
                  and n.endswith(f"/{n.split('/')[2]}/commit_success.txt"))


@pytest.fixture(scope="module")
def straight_params(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the same run, uninterrupted, on a local disk."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(2, 1, run_dir, *FLAGS)
    return summary(run_dir)["params_sha256"]


def test_preempted_run_resumes_from_the_bucket_bitwise_equal_to_a_local_run(gcs: Emulator,
                                                                            straight_params: str) -> None:
    argv = launcher_argv(2, [*JOB, "--run-dir", RUN, *FLAGS], devices=1)
    proc = subprocess.Popen(argv, env=child_env(**gcs.env), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = wait_for_line(proc, "step 5/", timeout=240)
    os.kill(rank_pids(proc.pid)[1], signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    output = "".join(lines) + out
    assert proc.returncode == REQUEUE, output
    stopped = bucket_summary(gcs)
    assert stopped["completed"] is False and 5 <= stopped["final_step"] < 12, output
    assert stopped["final_step"] in committed(gcs)

    resumed = train(2, 1, RUN, *FLAGS, **gcs.env)
    assert f"resumed from step {stopped['final_step']}" in resumed.stderr
    final = bucket_summary(gcs)
    assert final["completed"] is True and final["final_step"] == 12
    assert final["params_sha256"] == straight_params
    assert json.loads(gcs.read("run1/config.json"))["run_dir"] == RUN
    records = [json.loads(line) for line in gcs.read("run1/metrics.jsonl").decode().splitlines()]
    assert max(r["step"] for r in records if r["split"] == "train") == 12
    # every 2 steps, plus the step the preemption saved (an odd one when SIGTERM landed between saves)
    assert committed(gcs) == sorted({2, 4, 6, 8, 10, 12, stopped["final_step"]})
    assert not [n for n in objects(gcs) if ".preflight-" in n]  # every probe removed


def test_a_save_killed_mid_commit_is_never_restored(gcs: Emulator, straight_params: str) -> None:
    command = [sys.executable, str(Path(__file__).with_name("kill_in_commit.py")), "6", "--", "train",
               "--run-dir", RUN, *FLAGS]
    killed = run(launcher_argv(2, command, devices=1), timeout=300, **gcs.env)
    assert killed.returncode != 0 and "KILLED while committing step 6" in killed.stdout, \
        explain(killed, killed.stdout, killed.stderr)
    # every array of step 6 is in the bucket, but not its marker: orbax must not list it
    assert any(n.startswith("run1/checkpoints/6/default/") for n in objects(gcs))
    assert 6 not in committed(gcs) and 4 in committed(gcs)

    resumed = train(2, 1, RUN, *FLAGS, **gcs.env)
    assert "resumed from step 4" in resumed.stderr, resumed.stderr
    assert bucket_summary(gcs)["params_sha256"] == straight_params
    assert committed(gcs) == [2, 4, 6, 8, 10, 12]  # step 6 written again over what the kill left


@pytest.mark.parametrize(("run_dir", "says", "where"), [
    ("gs://no-such-bucket/run1", "bucket does not exist (404)", "preflight"),
    ("gs://Not_A_Bucket/run1", "lowercase letters", "config"),
])
def test_a_bucket_the_job_cannot_use_is_one_error_on_every_process(gcs: Emulator, run_dir: str, says: str,
                                                                   where: str) -> None:
    # the emulator has no permissions to refuse with (403): a missing bucket and an invalid name stand in
    proc = train(2, 1, run_dir, *FLAGS, expect=None, **gcs.env)
    output = proc.stdout + proc.stderr
    assert "Fix:" in output and says in output, output
    assert "step 1/" not in output, output
    if where == "preflight":  # every process stops there; a name the config refuses stops the first process
        for rank in (0, 1):   # to read it, and the launcher stops the other, which may not have said a word yet
            assert f"[rank {rank}]" in output, output
        assert f"expected a bucket the job can write, found {run_dir}/checkpoints" in output
        assert output.count("PreflightError") >= 2, output  # every process stops on it
    else:  # one clean refusal, from the first process to read the flag, before jax starts
        assert proc.returncode == 2 and "Traceback" not in output, output
        assert re.search(r"^\[rank [01]\] error: --run-dir: expected a folder path or gs://BUCKET/FOLDER, found "
                         r"'gs://Not_A_Bucket/run1'\. Fix: a bucket name has only lowercase letters", output,
                         re.MULTILINE), output
    assert gcs.buckets() == [BUCKET]  # nothing created a bucket on the way
    assert objects(gcs, "") == []


def test_an_unreadable_checkpoint_in_the_bucket_is_moved_aside(gcs: Emulator) -> None:
    train(2, 1, RUN, *FLAGS, "--steps", "8", "--ckpt.every", "4", **gcs.env)
    arrays = [n for n in objects(gcs, "run1/checkpoints/8/") if "/d/" in n]
    assert arrays
    for name in arrays:
        gcs.write(name, b"\0garbage" * 4)
    proc = train(2, 1, RUN, *FLAGS, "--steps", "12", "--ckpt.every", "4", **gcs.env)
    assert "checkpoint step 8 in" in proc.stderr and "is unreadable" in proc.stderr
    assert "resumed from step 4" in proc.stderr
    assert bucket_summary(gcs)["final_step"] == 12
    aside = {n.split("/")[2] for n in objects(gcs, "run1/checkpoints/") if ".unreadable-" in n}
    assert len(aside) == 1 and aside.pop().startswith("8.unreadable-")
    moved = [n for n in objects(gcs, "run1/checkpoints/") if ".unreadable-" in n and "/d/" in n]
    assert sorted(n.split("/", 3)[3] for n in moved) == sorted(n.split("/", 3)[3] for n in arrays)
    assert committed(gcs) == [4, 8, 12]  # step 8 trained and saved again


def test_a_gs_run_dir_without_a_cache_folder_caches_compiled_programs_in_its_bucket(gcs: Emulator) -> None:
    # no folder given (the tests' own JAX_COMPILATION_CACHE_DIR emptied): every worker reads gs://BUCKET/.cache/job/jax
    flags = ("--task", "tests.user_tasks.deep:TASK", "--model.layers", "2", "--steps", "2", "--eval-every", "2")
    for name in ("run1", "run2"):
        proc = run(launcher_argv(2, [*JOB, "--run-dir", f"gs://{BUCKET}/{name}", *flags], devices=1), timeout=300,
                   **gcs.env, JAX_COMPILATION_CACHE_DIR="")
        assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    first, second = (json.loads(gcs.read(f"{name}/summary.json"))["goodput"]["compile_cache"]
                     for name in ("run1", "run2"))
    assert first["dir"] == second["dir"] == f"gs://{BUCKET}/.cache/job/jax"
    assert first["misses"] > 0 and len(objects(gcs, ".cache/job/jax/")) >= first["misses"], first
    assert second["misses"] == 0 and second["hits"] >= first["misses"], second  # process 0 loads every program
