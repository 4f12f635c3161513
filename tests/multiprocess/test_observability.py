"""What a run leaves to read, on real processes: TensorBoard scalars (process 0 only), per-host profiles
of chosen steps, the goodput split across a requeue, the compilation cache, the plot, readable logs."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from job.core.ports import free_port
from tests.events import event_files, scalars, wandb_history, wandb_run
from tests.launching import ROOT, child_env, explain, launcher_argv, rank_pids, run, train, wait_for_line
from tests.records import records, summary

pytestmark = pytest.mark.multiprocess

JOB = [sys.executable, "-m", "job", "train"]
REQUEUE = 75
SMALL = ("--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64")
FLAGS = ("--steps", "8", "--log-every", "1", "--eval-every", "4", "--ckpt.every", "4", "--profile.steps", "3:5",
         *SMALL)
PARTS = ("startup_s", "compile_s", "steps_s", "input_wait_s", "checkpoint_s", "eval_s", "profile_s", "logging_s")


def jsonl_steps(run_dir: Path, split: str) -> list[int]:
    return [r["step"] for r in records(run_dir) if r["split"] == split]


def traced_steps(folder: Path) -> set[int]:
    """The step numbers named (StepTraceAnnotation "train") in every Perfetto trace under `folder`."""
    steps: set[int] = set()
    traces = list(folder.rglob("*.trace.json.gz"))
    assert traces, f"no trace under {folder}: {sorted(p.name for p in folder.rglob('*'))}"
    for trace in traces:
        data = json.loads(gzip.decompress(trace.read_bytes()))
        for event in data["traceEvents"] if isinstance(data, dict) else data:
            if event.get("name") == "train" and "step_num" in event.get("args", {}):
                steps.add(int(event["args"]["step_num"]))
    return steps


@pytest.mark.slow  # three 2-process runs and a plot
def test_metrics_profiles_goodput_and_a_resume_that_redoes_steps(tmp_path: Path) -> None:
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    (tmp_path / "wandb").mkdir()
    wandb = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb")}
    flags = (*FLAGS, "--wandb.project", "job-tests")
    train(2, 2, run_dir, "--compile-cache", str(cache), *flags, **wandb)

    # TensorBoard: one event file (process 0 writes; the other process none), every scalar at its step
    assert len(event_files(run_dir)) == 1, sorted(p.name for p in run_dir.iterdir())
    got = scalars(run_dir)
    assert [s for s, _ in got["train/loss"]] == list(range(1, 9))
    assert [s for s, _ in got["eval/loss"]] == [4, 8]
    for tag in ("train/lr", "train/step_time_s", "train/tok_per_s"):
        assert [s for s, _ in got[tag]] == list(range(1, 9)), tag
    jsonl_loss = [r["loss"] for r in records(run_dir) if r["split"] == "train"]
    assert [v for _, v in got["train/loss"]] == pytest.approx(jsonl_loss, rel=1e-6)

    # profiles: one folder per process, each holding exactly steps 3..5
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["process-0", "process-1"]
    for rank in (0, 1):
        assert traced_steps(run_dir / "profile" / f"process-{rank}") == {3, 4, 5}, rank

    # goodput: the measured parts add up to the wall-clock time
    split = summary(run_dir)["goodput"]
    parts = sum(split[p] for p in PARTS)
    assert abs(parts - split["total_s"]) <= 0.05 * split["total_s"], split
    assert split["compile_s"] > 0 and split["steps_s"] > 0 and split["attempt"] == 1
    assert split["compile_cache"]["dir"] == str(cache) and any(cache.iterdir())

    # a crash after step 8 but before its checkpoint committed: the next attempt resumes from 4, redoes 5..8
    shutil.rmtree(run_dir / "checkpoints" / "8")
    proc = train(2, 2, run_dir, "--compile-cache", str(cache), *flags, **wandb)
    assert "resumed from step 4" in proc.stdout + proc.stderr
    split = summary(run_dir)["goodput"]
    assert split["attempt"] == 2 and split["redone_steps"] == 4 and split["redone_s"] > 0
    assert split["restart_s"] >= 0
    assert "4 steps redone" in proc.stdout + proc.stderr
    assert jsonl_steps(run_dir, "train") == list(range(1, 9))
    assert jsonl_steps(run_dir, "eval") == [4, 8]
    got = scalars(run_dir)
    assert [s for s, _ in got["train/loss"]] == list(range(1, 9))
    assert [s for s, _ in got["eval/loss"]] == [4, 8]

    # W&B (offline): process 0 logged each attempt into the one run, with the resolved config
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    attempts = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert [(p / f"run-{run_id}.wandb").exists() for p in attempts] == [True, True], attempts
    for folder, steps in zip(attempts, (range(1, 9), range(5, 9))):
        history = wandb_history(folder / f"run-{run_id}.wandb")
        assert [int(h["_step"]) for h in history if "train/loss" in h] == list(steps)
        assert [int(h["_step"]) for h in history if "eval/loss" in h] == [s for s in steps if s % 4 == 0]
        config = {u.key: json.loads(u.value_json) for u in wandb_run(folder / f"run-{run_id}.wandb").config.update}
        assert config["steps"] == 8 and config["profile"] == {"steps": "3:5"}

    # a third start: nothing to do, said in one line, exit 0, nothing written
    before = (run_dir / "metrics.jsonl").read_text(), (run_dir / "summary.json").read_text()
    proc = train(2, 2, run_dir, "--compile-cache", str(cache), *FLAGS)
    out = proc.stdout + proc.stderr
    assert "already complete at step 8; use a new --run-dir or raise --steps" in out
    assert "done:" not in out and "step 1/8" not in out
    assert ((run_dir / "metrics.jsonl").read_text(), (run_dir / "summary.json").read_text()) == before

    # the plot of that run
    plotted = subprocess.run([sys.executable, "-m", "job", "plot", str(run_dir)], cwd=ROOT, env=child_env(),
                             capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    png = (run_dir / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


DEEP = ("--task", "tests.user_tasks.deep:TASK", "--model.layers", "8", "--steps", "2", "--log-every", "1",
        "--eval-every", "2")
SLOWER_S = 35  # process 1's extra compile time in the second run: over gloo's 30 s


def compilations(output: str, rank: int, program: str) -> int:
    """How many times `program` was lowered for compilation on `rank`: jax logs each one with JAX_LOG_COMPILES
    (counted in the job's log format; jax's own handler prints the same line as "...pxla:LINE: Compiling")."""
    return sum(f"pxla: Compiling jit({program}) with global shapes" in line
               for line in output.splitlines() if line.startswith(f"[rank {rank}]"))


@pytest.mark.slow  # two 2-process runs, the second 35 s longer on purpose
def test_a_rerun_with_a_warm_cache_waits_for_the_process_that_compiles_and_records_every_process(
        tmp_path: Path) -> None:
    """A user's unrolled deep model (tests/user_tasks/deep.py) trained twice on 2 processes x 2 devices with one
    --compile-cache folder, into two run dirs, with the job's own cache keys. In the second run process 1 is made
    SLOWER_S (35) seconds slower to reach its programs (DEEP_TRACE_DELAY_S: it sleeps when the loss is first
    traced, before the cache is asked), a skew a deep enough model gives on its own at more test time (96
    layers on 2 busy cores: process 1 reached the barrier 73 s after process 0, its state's init and steps
    compiled while process 0 loaded them). Without compiling ahead and meeting at the barrier "step compiled",
    process 0 waited for process 1 in its first collective, and gloo ended the run after 30 s (exit 1)."""
    cache = tmp_path / "cache"
    real = {"JAX_LOG_COMPILES": "1", "JOB_TESTS_CACHE_KEYS": "real"}  # jax's own keys (tests/site/sitecustomize.py)
    cold_run = train(2, 2, tmp_path / "cold", "--compile-cache", str(cache), *DEEP, **real)
    warm_run = train(2, 2, tmp_path / "warm", "--compile-cache", str(cache), *DEEP, **real,
                     DEEP_TRACE_DELAY_S=str(SLOWER_S))
    cold, warm = (summary(tmp_path / name)["goodput"]["compile_cache"] for name in ("cold", "warm"))
    for record in (cold, warm):
        assert record["dir"] == str(cache)
        counts = record["by_process"]
        assert len(counts["hits"]) == len(counts["misses"]) == len(counts["compile_s"]) == 2, record
        assert (record["hits"], record["misses"]) == (counts["hits"][0], counts["misses"][0])  # process 0's, as before
        assert all(h + m > 0 for h, m in zip(counts["hits"], counts["misses"])), record  # each looked in the cache

    # process 0 compiles in the first run and loads every one of those programs in the second
    assert cold["by_process"]["hits"][0] == 0 and cold["by_process"]["misses"][0] > 0, cold
    assert len(list(cache.iterdir())) >= cold["by_process"]["misses"][0]
    assert warm["by_process"]["misses"][0] == 0 and warm["by_process"]["hits"][0] >= cold["by_process"]["misses"][0]
    # to its first step, process 0 spends less in the second run; process 1 spent its delay compiling, and
    # process 0 waited for it at the barrier, not in a collective
    assert warm["by_process"]["compile_s"][0] < cold["by_process"]["compile_s"][0], (cold, warm)
    assert warm["by_process"]["compile_s"][1] >= SLOWER_S, warm
    assert summary(tmp_path / "warm")["goodput"]["compile_s"] >= SLOWER_S - warm["by_process"]["compile_s"][0]

    # compiled once each, ahead: the steps' calls found their programs compiled
    for proc in (cold_run, warm_run):
        output = proc.stdout + proc.stderr
        for rank in (0, 1):
            assert compilations(output, rank, "train_step_fn") == 1, explain(proc, proc.stdout, proc.stderr)
            assert compilations(output, rank, "eval_step_fn") == 1, explain(proc, proc.stdout, proc.stderr)


@pytest.mark.slow  # one 2-process run that stops at its barrier
def test_a_process_still_compiling_past_the_compile_timeout_is_named_with_the_fix(tmp_path: Path) -> None:
    proc = run(launcher_argv(2, [*JOB, "--run-dir", str(tmp_path / "run"), "--compile-cache", str(tmp_path / "cache"),
                                 *DEEP, "--compile-timeout-s", "2"], devices=2), timeout=300, DEEP_TRACE_DELAY_S="20")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, explain(proc, proc.stdout, proc.stderr)
    assert ("BarrierTimeout: barrier 'step compiled': expected all 2 processes within 2 s, found process(es) 1 missing "
            "(this is process 0). Fix: read those processes' logs: still compiling after --compile-timeout-s 2 "
            "(pass a larger one), or they died or hung") in output, output
    assert "step 1/" not in output


@pytest.mark.slow  # two 2-process runs
def test_goodput_of_a_run_preempted_by_sigterm_then_requeued(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = launcher_argv(2, [*JOB, "--run-dir", str(run_dir), "--compile-cache", str(tmp_path / "cache"),
                             "--steps", "100", "--log-every", "1", "--ckpt.every", "500", "--eval-every", "100",
                             *SMALL], devices=2)  # on CPU the notice is agreed at the step after it: 100 is ample
    proc = subprocess.Popen(argv, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = wait_for_line(proc, "step 3/", timeout=180)
    os.kill(rank_pids(proc.pid)[1], signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE, "".join(lines) + out
    stopped = summary(run_dir)
    assert stopped["completed"] is False and stopped["goodput"]["attempt"] == 1
    resumed = run(argv, timeout=300)
    assert resumed.returncode == 0, explain(resumed, resumed.stdout, resumed.stderr)
    split = summary(run_dir)["goodput"]
    # the preempted attempt saved the step it stopped at: nothing is redone; the time down is counted
    assert split["attempt"] == 2 and split["redone_steps"] == 0 and split["redone_s"] == 0
    assert split["restart_s"] > 0
    events = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    assert [r["event"] for r in events if r["event"] != "progress"] == ["attempt", "end", "attempt", "end"]
    assert [r["step"] for r in events if r["event"] == "attempt"] == [0, stopped["final_step"]]
    assert jsonl_steps(run_dir, "train") == list(range(1, 101))


GLOO_PROGRAM = """
import sys
import job
info = job.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(jnp.array([info.process_id + 1])).sum()
print(f"process {info.process_id}: sum {int(total)}", flush=True)
print(f"process {info.process_id}: last words", file=sys.stderr, flush=True)
"""


def start_pair(port: int, **env: str) -> list[subprocess.CompletedProcess[str]]:
    """Two processes joined by job.initialize's explicit arguments: no launcher filters their output."""
    base = {k: v for k, v in child_env(**env).items() if not k.startswith("JOB_LAUNCH_")}
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_PROGRAM, f"127.0.0.1:{port}", str(rank)], cwd=ROOT,
                              env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_gloo_connection_lines_are_dropped_without_the_launcher_and_the_rest_comes_through() -> None:
    quiet = start_pair(free_port())
    for rank, proc in enumerate(quiet):
        assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
        assert proc.stdout.strip() == f"process {rank}: sum 3"
        assert "[Gloo]" not in proc.stderr and "connected" not in proc.stderr, proc.stderr  # stdout: above
        assert f"process {rank}: last words" in proc.stderr
        assert "job.initialize: joining" in proc.stderr
    # the same program with the filter off: gloo does print them (so the check above can fail)
    loud = start_pair(free_port(), JOB_GLOO_LOGS="1")
    assert all(p.returncode == 0 for p in loud), [explain(p, p.stdout, p.stderr) for p in loud]
    assert any("[Gloo] Rank" in p.stdout + p.stderr for p in loud), [p.stdout + p.stderr for p in loud]


# Two processes joined by job.initialize's explicit arguments (so their output is filtered): each notes
# its filter processes and says its last words; then both end normally, or process 0 with an uncaught
# error (through os._exit; process 1 then loses its peer, which jax treats as fatal: not checked).
ENDING_PROGRAM = """
import os, sys
import job
info = job.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
with open(sys.argv[3] + str(info.process_id), "w") as note:
    note.write(open(f"/proc/self/task/{os.getpid()}/children").read())
print(f"process {info.process_id}: last words", file=sys.stderr, flush=True)
if sys.argv[4] == "error" and info.process_id == 0:
    raise RuntimeError("a last error")
"""


@pytest.mark.parametrize("ending", ["normal", "error"])
def test_the_filters_have_written_everything_out_before_a_process_ends(ending: str, tmp_path: Path) -> None:
    """Where the environment kills what is left of a task when it ends (a Slurm step, a container's
    PID 1), nothing may be left to write: a process ends only after its filters have."""
    port, notes = free_port(), tmp_path / "children-"
    env = {k: v for k, v in child_env().items() if not k.startswith("JOB_LAUNCH_")}
    procs = [subprocess.Popen([sys.executable, "-c", ENDING_PROGRAM, f"127.0.0.1:{port}", str(rank), str(notes),
                               ending], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    ended = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        ended.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    checked = (0, 1) if ending == "normal" else (0,)
    for rank in checked:
        proc = ended[rank]
        assert proc.returncode == (1 if ending == "error" else 0), explain(proc, proc.stdout, proc.stderr)
        assert f"process {rank}: last words" in proc.stderr
        assert ("RuntimeError: a last error" in proc.stderr) == (ending == "error")
        pids = [int(p) for p in (tmp_path / f"children-{rank}").read_text().split()]
        assert len(pids) == 2, pids  # the two filters, of stdout and stderr
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        assert alive == [], f"process {rank}: filter processes {alive} outlived it"


def test_a_host_whose_rows_cost_more_is_named_as_the_straggler_and_no_other(tmp_path: Path) -> None:
    # 3 processes; rank 1's batches cost 300 ms more (the others wait for it inside every step): far above
    # the noise of 3 processes on 2 busy cores
    argv = launcher_argv(3, [sys.executable, str(ROOT / "tests" / "scenarios" / "faulty.py"), "1", "slow-rows=300",
                             "--", "train", "--run-dir", str(tmp_path), "--steps", "16", "--log-every", "4",
                             "--eval-every", "100", "--data.global-batch", "30", *SMALL], devices=1)
    proc = run(argv, timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "stragglers at step" in line]
    assert lines, explain(proc, proc.stdout, proc.stderr)
    for line in lines:
        assert line.startswith("[rank 0] ") and "process 1 (" in line, line  # only process 0 reports it
        assert "process 0 (" not in line and "process 2 (" not in line, line
    assert [host["process"] for host in summary(tmp_path)["slowest_hosts"]] == [1]
    assert {r["slowest_process"] for r in records(tmp_path) if r["split"] == "hosts"} == {1.0}


def test_a_rerun_loads_every_program_process_0_cached_on_every_process_with_jaxs_cache_on_cpu(tmp_path: Path) -> None:
    """Two 2-process runs with one --compile-cache folder and the job's own keys (not the tests' shared ones):
    jax writes entries from process 0 only and, on CPU, keyed process 1's programs by its own topology, so process
    1 (a restart's, on its node or a spare) compiled every program again while process 0 waited for it. Now the
    second run's process 1 loads every program it looks up, as process 0 does."""
    cache, real = tmp_path / "cache", {"JOB_TESTS_CACHE_KEYS": "real"}  # the job's own keys (sitecustomize.py)
    for name in ("cold", "warm"):
        train(2, 2, tmp_path / name, "--compile-cache", str(cache), "--steps", "2", *SMALL, **real)
    warm = summary(tmp_path / "warm")["goodput"]["compile_cache"]["by_process"]
    assert warm["misses"] == [0, 0] and warm["hits"][0] > 0 and warm["hits"][1] > 0, warm
