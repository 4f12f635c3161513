"""The example training job on real processes: convergence, topology invariance,
exact resume, preemption, interrupted saves, and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.launching import ROOT, child_env, explain, launcher_argv, rank_pids, run, scenario, train, wait_for_line
from tests.records import records, summary, train_losses

pytestmark = pytest.mark.multiprocess

JOB = [sys.executable, "-m", "job", "train"]
REQUEUE = 75
# A smaller model where learning is not the point: compile time dominates these tests.
SMALL = ("--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")


@pytest.mark.smoke
def test_synthetic_task_converges(tmp_path: Path) -> None:
    # measured: eval accuracy 1.000 from step 50 (4x2, default config); loss 3.4 -> 0.02
    train(2, 2, tmp_path, "--steps", "80", "--eval-every", "40", "--log-every", "20")
    result = summary(tmp_path)
    assert result["completed"] is True and result["final_step"] == 80
    assert result["eval_accuracy"] >= 0.95
    assert result["eval_loss"] < 0.3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["50", "80"]
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 80


def losses_on_every_topology(tmp_path: Path, *flags: str) -> dict[tuple[int, int], dict[int, float]]:
    """Train 6 steps as 1x4, 4x1 and 2x2 (processes x devices); assert equal losses; return them."""
    runs = {}
    for n, devices in [(1, 4), (4, 1), (2, 2)]:
        train(n, devices, tmp_path / f"{n}x{devices}", "--steps", "6", "--log-every", "1", "--eval-every", "6",
              *flags)
        runs[(n, devices)] = train_losses(tmp_path / f"{n}x{devices}")
    reference = runs[(1, 4)]
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    for topology, losses in runs.items():
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5), (topology, step)
    return runs


def test_same_losses_on_every_topology(tmp_path: Path) -> None:
    losses_on_every_topology(tmp_path, *SMALL)
    # 4x1 and 2x2 compute bitwise equal values: their fingerprints, made without gathering, agree
    # (that a run repeated gives bitwise the same is test_resume's rerun into a new dir)
    assert summary(tmp_path / "4x1")["params_sha256"] == summary(tmp_path / "2x2")["params_sha256"]


def test_tensor_parallel_across_processes_trains_like_one_process(tmp_path: Path) -> None:
    # one process per device, a model group spanning both: the two processes hold the same batch rows
    flags = ("--steps", "4", "--log-every", "1", "--eval-every", "4", "--model-axis", "2", "--rule", "tensor",
             *SMALL)
    train(1, 2, tmp_path / "1x2", *flags)
    train(2, 1, tmp_path / "2x1", *flags)
    reference = train_losses(tmp_path / "1x2")
    assert sorted(reference) == [1, 2, 3, 4]
    across = train_losses(tmp_path / "2x1")
    for step, loss in reference.items():
        assert across[step] == pytest.approx(loss, rel=1e-5), step
    assert summary(tmp_path / "2x1")["eval_loss"] == pytest.approx(summary(tmp_path / "1x2")["eval_loss"], rel=1e-5)


def _preempt(run_dir: Path, n: int, devices: int, sig: signal.Signals, rank: int, after_step: int,
             *flags: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    argv = launcher_argv(n, [*JOB, "--run-dir", str(run_dir), "--log-every", "1", *flags], devices=devices)
    proc = subprocess.Popen(argv, env=env or child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = wait_for_line(proc, f"step {after_step}/", timeout=180)
    pids = rank_pids(proc.pid)
    assert sorted(pids) == list(range(n))
    os.kill(pids[rank], sig)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out


@pytest.mark.smoke
def test_exact_resume_after_sigterm_to_one_nonzero_rank(tmp_path: Path) -> None:
    # on CPU the notice is agreed at the next step (a collective, not jax's sync point, which looks once a second):
    # 100 steps outlast its way from the signal to the agreement many times over
    flags = ("--steps", "100", "--ckpt.every", "25", "--eval-every", "100", *SMALL)
    train(2, 2, tmp_path / "straight", *flags, "--log-every", "100")
    code, output = _preempt(tmp_path / "preempted", 2, 2, signal.SIGTERM, 1, 5, *flags)
    assert code == REQUEUE, output
    stopped = summary(tmp_path / "preempted")
    assert stopped["completed"] is False and 5 <= stopped["final_step"] < 100, output
    # a stopped run's slow figures (a norm and a hash of every parameter) wait for the run that completes
    assert stopped["params_sha256"] is None and stopped["params_norm"] is None, stopped
    resumed = train(2, 2, tmp_path / "preempted", *flags)
    assert f"resumed from step {stopped['final_step']}" in resumed.stderr
    assert summary(tmp_path / "preempted")["params_sha256"] == summary(tmp_path / "straight")["params_sha256"]
    # a resume on another topology: test_sharded's fsdp run restored on 4 x 1 and 1 x 4


def test_sigusr1_to_one_rank_saves_everywhere_and_exits_with_requeue_code(tmp_path: Path) -> None:
    code, output = _preempt(tmp_path, 4, 1, signal.SIGUSR1, 2, 3, "--steps", "1000", "--ckpt.every", "500", *SMALL)
    assert code == REQUEUE, output
    stopped = summary(tmp_path)["final_step"]
    assert 3 <= stopped < 1000
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [stopped]
    assert max(train_losses(tmp_path)) == stopped
    assert f"preempted: saved step {stopped}; exiting with 75" in output
    assert "[rank 2]" in output and "received SIGUSR1" in output


def test_the_process_that_heard_the_signal_says_how_long_after_it_its_save_was_written(tmp_path: Path) -> None:
    code, output = _preempt(tmp_path, 1, 2, signal.SIGTERM, 0, 5, "--steps", "1000", "--ckpt.every", "500", *SMALL)
    assert code == REQUEUE, output
    stopped = summary(tmp_path)["final_step"]
    assert re.search(rf"preempted: saved step {stopped}; exiting with 75 \(requeue\); written \d+\.\d s after "
                     "this process's signal", output), output
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [stopped]


def test_a_stopped_run_s_way_out_reaches_no_bound_and_shuts_the_distributed_system_down_once(tmp_path: Path) -> None:
    # each process's leave at DEBUG (a sitecustomize on PYTHONPATH, then the tests' own): its phases timed; the
    # distributed system was shut down by python -m job's command as the run ended, and not again by leave
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import logging, runpy\nlogging.getLogger('job.runtime.leaving').setLevel(logging.DEBUG)\n"
        f"runpy.run_path({str(ROOT / 'tests' / 'site' / 'sitecustomize.py')!r}, run_name='sitecustomize')\n")
    env = child_env(JOB_TESTS_WARM="")
    env["PYTHONPATH"] = os.pathsep.join([str(hook), *filter(None, [env.get("PYTHONPATH")])])
    code, output = _preempt(tmp_path / "run", 2, 1, signal.SIGTERM, 1, 3, "--steps", "1000", "--ckpt.every", "500",
                            *SMALL, env=env)
    assert code == REQUEUE, output
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] \S+ DEBUG job\.runtime\.leaving: leaving with 75: jax's distributed "
                         r"shutdown \d+\.\d{3} s \(none left to shut down\), exit handlers \d+\.\d{3} s, flush "
                         r"\d+\.\d{3} s; no bound reached$", output, re.MULTILINE), output
    assert "did not end within" not in output and "leave:" not in output, output


def test_a_notice_during_the_last_step_completes_the_run(tmp_path: Path) -> None:
    # SIGUSR1 while step 4 of 4 runs: the stop is agreed at the last step, which is the run's completion (0, not 75)
    done = run(launcher_argv(1, scenario("faulty.py", "0", "usr1@4", "--", "train", "--run-dir", str(tmp_path),
                                         "--steps", "4", "--log-every", "1", "--eval-every", "4", *SMALL)), timeout=300)
    assert done.returncode == 0, explain(done)
    assert "received SIGUSR1" in done.stderr and "preempted: saved step" not in done.stdout + done.stderr
    assert summary(tmp_path)["completed"] is True and summary(tmp_path)["final_step"] == 4


def test_an_interrupted_save_is_never_restored(tmp_path: Path) -> None:
    train(1, 2, tmp_path, "--steps", "8", "--ckpt.every", "4", "--eval-every", "8", *SMALL)
    checkpoints = tmp_path / "checkpoints"
    # what a save killed half-way leaves: orbax's temporary folder for a later step
    shutil.copytree(checkpoints / "8", checkpoints / "16.orbax-checkpoint-tmp")
    (checkpoints / "16.orbax-checkpoint-tmp" / "commit_success.txt").unlink(missing_ok=True)
    proc = train(1, 2, tmp_path, "--steps", "12", "--ckpt.every", "4", "--eval-every", "12", *SMALL)
    assert "resumed from step 8" in proc.stderr
    assert [r["step"] for r in records(tmp_path) if r["split"] == "train"] == [8, 10, 12]  # resumed after step 8
    assert not (checkpoints / "16.orbax-checkpoint-tmp").exists()  # the training run clears what was left
    assert summary(tmp_path)["final_step"] == 12


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no-such-flag", "1"], "Unrecognized options"),
        (["--data.global-batch", "30"], "expected a multiple of the data-parallel size 4"),
        (["--data.source", "/nonexistent/tokens.npy"], "python -m job tokenize INPUT.txt OUTPUT.npy"),
        (["--rule", "tensor", "--model-axis", "4", "--model.heads", "2"], "model.heads"),
    ],
)
def test_bad_input_is_one_clear_error_before_training(flags: list[str], message: str, tmp_path: Path) -> None:
    proc = run(launcher_argv(1, [*JOB, "--run-dir", str(tmp_path / "run"), *flags], devices=4), timeout=120)
    assert proc.returncode != 0, explain(proc, proc.stdout, proc.stderr)
    assert message in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("command", "said"), [
    (["train", "--stpes", "3"], "Unrecognized options: --stpes"),  # tyro's box
    (["eval", "--run-dri", "x"], "error: the following arguments are required: --run-dir"),  # argparse's usage
])
def test_a_flag_typo_on_two_processes_is_printed_once_by_process_0_and_ends_the_job_with_2(
        command: list[str], said: str) -> None:
    proc = run(launcher_argv(2, [sys.executable, "-m", "job", *command], devices=1), timeout=120)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert both.count(said) == 1, explain(proc)
    assert [line for line in both.splitlines() if said in line][0].startswith("[rank 0] "), explain(proc)
    assert not [line for line in both.splitlines() if line.startswith("[rank 1] ")], explain(proc)  # rank 1: silent
    # rank 1 waits entry.PARSE_GRACE_S: process 0, printing it, is the first to exit and the one the launcher names
    assert "[launch] rank 0 exited with code 2" in both, explain(proc)


def test_token_file_with_wrong_dtype_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "floats.npy", np.zeros(1000, np.float32))
    proc = run([*JOB, "--run-dir", str(tmp_path / "run"), "--data.source", str(tmp_path / "floats.npy")], timeout=120)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)  # bad input, though found in the run
    assert "float32" in proc.stderr and "uint16" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_token_file_trains_from_a_tokenized_text(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400 + "héllo ✓")
    made = run([sys.executable, "-m", "job", "tokenize", str(tmp_path / "text.txt"), str(tmp_path / "tok.npy")])
    assert made.returncode == 0 and "byte-level tokens" in made.stdout, made.stderr
    train(2, 1, tmp_path / "run", "--data.source", str(tmp_path / "tok.npy"), "--model.vocab-size", "256",
          "--steps", "30", "--eval-every", "30", "--log-every", "10", *SMALL)
    losses = train_losses(tmp_path / "run")
    assert losses[30] < losses[10]


def test_an_arrayrecord_file_through_grain_trains_alike_on_two_topologies(tmp_path: Path) -> None:
    # 12 records of 257 tokens: 11 train records (88 windows of 33, neighbours sharing one), so 6 steps of 32 rows
    # wrap into a third epoch
    (tmp_path / "text.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 12 * 257, np.uint8).tobytes())
    made = run([sys.executable, "-m", "job", "tokenize", str(tmp_path / "text.txt"), str(tmp_path / "t.arrayrecord"),
                "--record-tokens", "257"])
    assert made.returncode == 0, made.stderr
    flags = ("--data.source", str(tmp_path / "t.arrayrecord"), "--model.vocab-size", "256", *SMALL)
    runs, said = {}, {}
    for n, devices in [(1, 4), (2, 2)]:  # one process holding every row, and two making theirs
        said[(n, devices)] = train(n, devices, tmp_path / f"{n}x{devices}", *flags, "--steps", "6",
                                   "--log-every", "1", "--eval-every", "6").stderr
        runs[(n, devices)] = train_losses(tmp_path / f"{n}x{devices}")
    assert sorted(runs[(2, 2)]) == [1, 2, 3, 4, 5, 6]
    assert runs[(2, 2)] == pytest.approx(runs[(1, 4)], rel=1e-5)
    assert "eval split eval: 8 rows in 1 batches" in said[(2, 2)]
    # a resumed run reads the same epochs' orders: the rows are a pure function of the step
    # (tests/unit/test_records.py), and the loop resumes bitwise (test_exact_resume_after_sigterm_to_one_nonzero_rank)


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    train(1, 2, tmp_path, "--steps", "8", "--ckpt.every", "4", "--eval-every", "8", *SMALL)
    for path in (tmp_path / "checkpoints" / "8").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "METADATA" not in path.name:
            path.write_bytes(b"\0garbage" * 4)
    proc = train(1, 2, tmp_path, "--steps", "12", "--ckpt.every", "4", "--eval-every", "12", *SMALL)
    assert "checkpoint step 8 in" in proc.stderr and "is unreadable" in proc.stderr
    assert "resumed from step 4" in proc.stderr
    assert summary(tmp_path)["final_step"] == 12


def test_a_hung_rank_trips_the_watchdog_on_the_others(tmp_path: Path) -> None:
    argv = launcher_argv(2, [*JOB, "--run-dir", str(tmp_path), "--log-every", "1", "--steps", "100000",
                             "--watchdog-s", "3", *SMALL], devices=1)
    # the frozen rank stops sending heartbeats too: after 10 s (the default) the coordination service would abort
    # rank 0 (134), racing the watchdog's 3 s, its roll call's 3 s and its stack dump on a loaded machine
    # cold processes (JOB_TESTS_WARM=): SIGSTOP, which no process can catch, must freeze the rank itself, not a
    # stand-in forwarding to a warm child (tests/site/warmstart.py)
    proc = subprocess.Popen(argv, env=child_env(JOB_HEARTBEAT_TIMEOUT="60", JOB_TESTS_WARM=""), cwd=ROOT,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = wait_for_line(proc, "step 3/", timeout=180)
    pids = rank_pids(proc.pid)
    stopped = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    out, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - stopped
    print(f"SIGSTOP of rank 1: launcher exited {proc.returncode} after {elapsed:.1f} s")
    output = "".join(lines) + out
    assert proc.returncode == 86, output
    assert "[rank 0] watchdog: no training step completed for" in output
    # its roll call names the frozen process: it cannot answer
    assert ("[rank 0] watchdog: roll call of 2 processes: process 1 did not answer within 3 s (frozen, or gone): it "
            "is the one stuck") in output, output
