"""Where each run of a sweep stands, told from its files (job/observe/status.py), the table of a sweep
(`python -m job runs`) and the plot of a sweep folder. The run dirs are written by the loop's own writers
(config.json, provenance.json, the goodput timer's records, the Reporter's metrics and summary), so a
change to what a run writes shows here."""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from etils import epath

from job.core import exits
from job.observe import plot, runs_table
from job.observe.goodput import Goodput
from job.observe.report import Reporter
from job.observe.status import State, find_runs, pending, state_of
from job.runs import attempts, provenance, sweep
from job.train import config, loop
from job.train import task as tasks

T0 = 1_700_000_000.0  # the runs' wall clock starts here


class Clock:
    """The clock the goodput timer and provenance read, moved by hand."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    now = Clock()
    real = provenance.attempt

    def at_the_clock(*args: Any, **kwargs: Any) -> tuple[dict[str, Any], str]:
        entry, diff = real(*args, **kwargs)
        entry["time"] = datetime.datetime.fromtimestamp(now.t, datetime.timezone.utc).isoformat(timespec="seconds")
        return entry, diff

    monkeypatch.setattr(provenance, "attempt", at_the_clock)
    monkeypatch.setattr(provenance, "code_state", lambda: ({}, ""))  # no git calls: not what is tested here
    return now


def cfg_of(run_dir: Path, task: str = "lm", **changes: Any) -> config.TrainConfig:
    base = config.defaults(tasks.load(task))
    optim = {k.removeprefix("optim_"): v for k, v in changes.items() if k.startswith("optim_")}
    plain = {k: v for k, v in changes.items() if not k.startswith("optim_")}
    return config.TrainConfig(**{**vars(base), "run_dir": str(run_dir), "log_every": 10, "eval_every": 20,
                                 "steps": 40, "optim": config.OptimConfig(**optim), **plain})


def restore(run_dir: Path, cfg: config.TrainConfig) -> int:
    """What the loop's restore phase writes (config.json, a provenance attempt, the attempt's start in the attempt
    record), before any other record: the attempt's number."""
    path = epath.Path(run_dir)
    loop._save_config(path, cfg)
    provenance.record(path, ["train", "--run-dir", str(run_dir)], {"kind": "single", "processes": 1})
    return attempts.note_start(path)


def attempt(run_dir: Path, cfg: config.TrainConfig, clock: Clock, *, start: int, reach: int, ends: str | None,
            loss: float = 1.0, accuracy: float | None = None, code: int | None = None) -> None:
    """One attempt of cfg's task as the loop writes it: restore's files, goodput's attempt line, a train record
    (its throughput in the task's unit) and a goodput progress line every log_every steps, an eval (with
    `accuracy` when given) every eval_every, and, when it `ends` ("completed" or "preempted"), goodput's end
    line and summary.json ("killed at its end": not the summary)."""
    path = epath.Path(run_dir)
    timer = Goodput(clock=clock, wall=clock)
    clock.t += 5.0  # start-up
    number = restore(run_dir, cfg)
    timer.resume(path, start, number)
    task = tasks.load(cfg.task)
    report = Reporter(path, start_step=start, total_steps=cfg.steps, items_per_step=64 * 32, unit=task.unit,
                      shown=task.shown)
    timer.started()
    for step in range(start + 1, reach + 1):
        with timer.step():
            clock.t += 10.0 if step == start + 1 else 0.5  # the first step compiles
        if step % cfg.log_every == 0:
            report.train(step, {"loss": loss + 1.0 / step, "accuracy": 0.5}, 1e-3)
            timer.progress(path, step)
        if step % cfg.eval_every == 0:
            report.eval(step, {"loss": loss + 2.0 / step, **({} if accuracy is None else {"accuracy": accuracy})})
    if ends is None:
        report.flush()
        timer.flush()
        return
    timer.progress(path, reach, "end")
    if ends == "killed at its end":  # between the end record and summary.json
        report.flush()
        return
    report.close({"final_step": reach, "completed": ends == "completed", "task": cfg.task,
                  "train_loss": loss + 1.0 / reach, "goodput": timer.finish(),
                  **({} if code is None else {"exit_code": code})})


def test_a_completed_run_reads_completed_with_its_losses_throughput_and_goodput(tmp_path: Path, clock: Clock) -> None:
    attempt(tmp_path, cfg_of(tmp_path), clock, start=0, reach=40, ends="completed")
    status = state_of(tmp_path, now=clock.t + 86400)
    assert (status.state, status.step, status.total, status.attempts) == (State.COMPLETED, 40, 40, 1)
    assert status.describe() == "completed"
    assert status.metric("train_loss") == pytest.approx(1.025) and status.metric("eval_loss") == pytest.approx(1.05)
    assert status.metric("train_accuracy") == 0.5 and status.metric("test_loss") is None
    assert status.latest["train"]["tok_per_s"] > 0
    # the first step: one ordinary step, the rest compilation (Goodput.finish)
    assert status.goodput == pytest.approx(40 * 0.5 / (5 + 10 + 39 * 0.5), abs=1e-4)


def test_a_preempted_run_reads_preempted_at_its_saved_step(tmp_path: Path, clock: Clock) -> None:
    attempt(tmp_path, cfg_of(tmp_path), clock, start=0, reach=20, ends="preempted")
    status = state_of(tmp_path, now=clock.t + 86400)
    assert (status.state, status.step, status.describe()) == (State.PREEMPTED, 20, "preempted at step 20")


def test_a_stopped_or_completed_run_shows_its_last_saved_steps_loss_from_the_summary_not_the_last_logged(
        tmp_path: Path, clock: Clock) -> None:
    stopped, completed = tmp_path / "stopped", tmp_path / "completed"
    attempt(stopped, cfg_of(stopped), clock, start=0, reach=14, ends="preempted", code=exits.STOPPED)  # Ctrl-C
    attempt(completed, cfg_of(completed, steps=45), clock, start=0, reach=45, ends="completed")
    statuses = [state_of(stopped, now=clock.t + 60), state_of(completed, now=clock.t + 60)]
    assert [s.describe() for s in statuses] == ["stopped at step 14 (Ctrl-C; the same command resumes)", "completed"]
    # logged every 10 steps: step 10's 1.1 and step 40's 1.025 are the newest records, not the saved steps' losses
    assert [s.latest["train"]["loss"] for s in statuses] == [pytest.approx(1.1), pytest.approx(1.025)]
    assert [s.metric("train_loss") for s in statuses] == [pytest.approx(1 + 1 / 14), pytest.approx(1 + 1 / 45)]
    assert statuses[1].metric("eval_loss") == pytest.approx(1.05)  # the summary holds none: the newest record's
    lines = [line.split() for line in runs_table.render(str(tmp_path), runs_table.rows(str(tmp_path),
                                                                                       now=clock.t + 60)).splitlines()]
    assert lines[2][:6] == ["*", "completed", "45", "completed", "45/45", f"{1 + 1 / 45:.4g}"]  # 1.022, not 1.025
    assert lines[3][0] == "stopped" and lines[3][-5:-3] == ["14/40", f"{1 + 1 / 14:.4g}"]  # 1.071, not 1.1
    # started again: the running attempt's records, not the summary of the one before
    attempt(stopped, cfg_of(stopped), clock, start=14, reach=20, ends=None, loss=2.0)
    assert state_of(stopped, now=clock.t + 60).metric("train_loss") == pytest.approx(2.05)


def test_a_run_that_writes_is_running_and_one_quiet_for_an_hour_has_stopped(tmp_path: Path, clock: Clock) -> None:
    attempt(tmp_path, cfg_of(tmp_path), clock, start=0, reach=30, ends=None)
    running = state_of(tmp_path, now=clock.t + 60)
    assert (running.state, running.step, running.describe()) == (State.RUNNING, 30, "running")
    # so far: its steps at their mean step time over the time since the attempt began, as Goodput.finish counts
    assert running.goodput == pytest.approx(30 * 0.5 / (5 + 10 + 29 * 0.5), abs=1e-4)
    stopped = state_of(tmp_path, now=clock.t + 7200)
    assert (stopped.state, stopped.describe()) == (State.STOPPED, "stopped at step 30 (quiet 2.0 h)")
    assert state_of(tmp_path, now=clock.t + 7200, stale_s=3 * 3600).state is State.RUNNING


def test_a_requeued_run_running_again_counts_its_attempts(tmp_path: Path, clock: Clock) -> None:
    cfg = cfg_of(tmp_path)
    attempt(tmp_path, cfg, clock, start=0, reach=20, ends="preempted")
    clock.t += 120  # in the queue
    attempt(tmp_path, cfg, clock, start=20, reach=30, ends=None)
    status = state_of(tmp_path, now=clock.t + 1)
    assert (status.state, status.step, status.attempts, status.describe()) == (
        State.RUNNING, 30, 2, "running (attempt 2)")


def _batch_record(run_dir: Path, clock: Clock, attempt_no: int, code: int, action: str, outcome: str = "failed") -> None:
    """The line slurm/requeue.sh appends to RUN_DIR/attempts.jsonl once an attempt's srun has ended."""
    clock.t += 3.0
    with (run_dir / "attempts.jsonl").open("a") as f:
        f.write(json.dumps({"event": "ended", "job": "77", "attempt": attempt_no, "began": T0, "ended": clock.t,
                            "code": code, "outcome": outcome, "node": "node2", "process": "1", "cause": "Killed",
                            "action": action}) + "\n")


def test_a_failed_attempt_reads_retrying_until_the_next_starts_and_failed_once_not_retried(
        tmp_path: Path, clock: Clock) -> None:
    run_dir = tmp_path / "lr=1e-3"
    run_dir.mkdir()
    cfg = cfg_of(run_dir)
    attempt(run_dir, cfg, clock, start=0, reach=30, ends=None)  # killed at step 30
    _batch_record(run_dir, clock, 1, 137, "retry 1 of 1, excluding node2")
    retrying = state_of(run_dir, now=clock.t + 5)
    assert (retrying.state, retrying.describe()) == (
        State.RETRYING, "retrying at step 30 (retry 1 of 1, excluding node2 after exit 137, process 1 on node2)")
    clock.t += 60
    attempt(run_dir, cfg, clock, start=20, reach=25, ends=None)  # the retry, running again
    assert state_of(run_dir, now=clock.t + 5).state is State.RUNNING
    _batch_record(run_dir, clock, 2, 137, "not retried: the retry budget is spent (1 of 1)")
    failed = state_of(run_dir, now=clock.t + 86400)
    assert (failed.state, failed.describe()) == (State.FAILED, "failed (exit 137, process 1 on node2) at step 30")
    table = runs_table.render(str(tmp_path), runs_table.rows(str(tmp_path), now=clock.t + 86400))
    assert "failed (exit 137, process 1 on node2) at step 30" in table


def test_a_preempted_attempt_recorded_by_the_batch_script_is_not_a_failure(tmp_path: Path, clock: Clock) -> None:
    attempt(tmp_path, cfg_of(tmp_path), clock, start=0, reach=20, ends="preempted")
    _batch_record(tmp_path, clock, 1, 75, "requeued (a preemption spends no retry)", outcome="preempted")
    assert state_of(tmp_path, now=clock.t + 86400).state is State.PREEMPTED


def test_a_cancelled_job_reads_cancelled_at_its_saved_step_until_the_same_command_runs_again(
        tmp_path: Path, clock: Clock) -> None:
    # scancel: the tasks saved on SIGTERM as on a preemption notice, and the supervisor recorded the job cancelled
    cfg = cfg_of(tmp_path)
    attempt(tmp_path, cfg, clock, start=0, reach=20, ends="preempted")
    _batch_record(tmp_path, clock, 1, 75, "not retried: the job was cancelled (scancel); the same command resumes",
                  outcome="cancelled")
    status = state_of(tmp_path, now=clock.t + 86400)
    assert (status.state, status.describe()) == (State.CANCELLED,
                                                 "cancelled at step 20 (scancel; the same command resumes)")
    table = runs_table.render(str(tmp_path), runs_table.rows(str(tmp_path), now=clock.t + 86400))
    assert "1 cancelled" in table and "cancelled at step 20 (scancel; the same command resumes)" in table, table
    clock.t += 60
    attempt(tmp_path, cfg, clock, start=20, reach=25, ends=None)  # submitted again: running
    assert state_of(tmp_path, now=clock.t + 5).state is State.RUNNING


def test_an_attempt_ended_without_its_own_summary_has_stopped_whatever_the_one_before_said(tmp_path: Path,
                                                                                          clock: Clock) -> None:
    cfg = cfg_of(tmp_path)
    attempt(tmp_path, cfg, clock, start=0, reach=20, ends="preempted")
    attempt(tmp_path, cfg, clock, start=20, reach=40, ends="killed at its end")
    status = state_of(tmp_path, now=clock.t + 86400)
    assert (status.state, status.step, status.attempts) == (State.STOPPED, 40, 2)


def test_a_run_in_its_start_up_is_running_from_its_provenance_and_an_old_one_stopped(tmp_path: Path,
                                                                                      clock: Clock) -> None:
    restore(tmp_path, cfg_of(tmp_path))  # config.json and provenance.json: building, restoring, compiling
    assert state_of(tmp_path, now=clock.t + 30).state is State.RUNNING
    assert state_of(tmp_path, now=clock.t + 4000).describe() == "stopped at step 0 (quiet 1.1 h)"


def test_a_completed_run_submitted_again_stays_completed_and_one_given_more_steps_is_not(tmp_path: Path,
                                                                                        clock: Clock) -> None:
    cfg = cfg_of(tmp_path)
    attempt(tmp_path, cfg, clock, start=0, reach=40, ends="completed")
    clock.t += 600
    restore(tmp_path, cfg)  # the loop records the attempt, finds step 40 >= --steps and exits 0
    assert state_of(tmp_path, now=clock.t + 5).state is State.COMPLETED
    clock.t += 600
    restore(tmp_path, cfg_of(tmp_path, steps=80))  # --steps raised: a new attempt starting from step 40
    status = state_of(tmp_path, now=clock.t + 5)
    assert (status.state, status.step, status.total, status.attempts) == (State.RUNNING, 40, 80, 3)


def test_nothing_written_is_not_started_and_pending_lists_every_run_not_completed(tmp_path: Path,
                                                                                   clock: Clock) -> None:
    assert state_of(tmp_path / "nothing").state is State.NOT_STARTED
    made = sweep.plan("seed=0,1,2", ["train", "--run-dir", str(tmp_path)])
    attempt(Path(made.runs[0].run_dir), cfg_of(made.runs[0].run_dir), clock, start=0, reach=40, ends="completed")
    attempt(Path(made.runs[1].run_dir), cfg_of(made.runs[1].run_dir), clock, start=0, reach=20, ends="preempted")
    assert [r.name for r in pending(made, now=clock.t)] == ["seed=1", "seed=2"]


def _sweep(tmp_path: Path, clock: Clock) -> sweep.Sweep:
    """A 2 x 2 sweep: one run completed, one preempted, one running, one not started."""
    made = sweep.plan("optim.lr=1e-3,3e-3 seed=0,1", ["train", "--steps", "40", "--run-dir", str(tmp_path)])
    sweep.save_plan(made)
    for run, reach, ends, loss in zip(made.runs[:3], (40, 20, 30), ("completed", "preempted", None), (0.5, 0.2, 0.9),
                                      strict=True):
        values = dict(run.values)
        cfg = cfg_of(run.run_dir, seed=int(values["seed"]), optim_lr=float(values["optim.lr"]))
        attempt(Path(run.run_dir), cfg, clock, start=0, reach=reach, ends=ends, loss=loss)
    return made


def test_the_table_shows_each_runs_values_state_step_losses_and_marks_the_best(tmp_path: Path, clock: Clock) -> None:
    _sweep(tmp_path, clock)
    text = runs_table.render(str(tmp_path), runs_table.rows(str(tmp_path), now=clock.t + 10))
    lines = [line.split() for line in text.splitlines()]
    assert text.splitlines()[0] == (f"{tmp_path}: 4 run(s): 1 completed, 1 running, 1 preempted, 1 not started; "
                                    "best by eval_loss (lower is better): lr=1e-3,seed=1 (0.3)")
    assert lines[1] == ["run", "lr", "seed", "state", "step", "train", "loss", "eval", "loss", "tok/s", "goodput"]
    assert lines[2][:7] == ["lr=1e-3,seed=0", "1e-3", "0", "completed", "40/40", "0.525", "0.55"]
    assert lines[3][0] == "*" and lines[3][1:8] == ["lr=1e-3,seed=1", "1e-3", "1", "preempted", "at", "step", "20"]
    assert lines[3][8:11] == ["20/40", "0.25", "0.3"]
    assert lines[4][:5] == ["lr=3e-3,seed=0", "3e-3", "0", "running", "30/40"]
    assert lines[5] == ["lr=3e-3,seed=1", "3e-3", "1", "not", "started", "-", "-", "-", "-", "-"]
    assert lines[2][-1].endswith("%") and lines[2][-2].replace(",", "").isdigit()


def test_the_best_follows_the_metric_and_the_direction_asked_for(tmp_path: Path, clock: Clock) -> None:
    _sweep(tmp_path, clock)
    table = runs_table.rows(str(tmp_path), now=clock.t + 10)
    assert runs_table.best(table, "eval_loss").name == "lr=1e-3,seed=1"
    assert runs_table.best(table, "eval_loss", higher=True).name == "lr=3e-3,seed=0"
    assert runs_table.best(table, "train_loss").name == "lr=1e-3,seed=1"
    assert runs_table.best(table, "train_accuracy", higher=True).name == "lr=1e-3,seed=0"  # a tie: the first
    assert runs_table.best(table, "test_loss") is None
    assert "best by test_loss: none yet (no run has recorded it)" in runs_table.render(str(tmp_path), table,
                                                                                        "test_loss")


def test_a_folder_of_runs_not_launched_as_a_sweep_shows_the_flags_that_differ(tmp_path: Path, clock: Clock) -> None:
    for name, seed, lr in (("a", 0, 1e-3), ("b", 1, 1e-3), ("c", 1, 3e-3)):
        attempt(tmp_path / name, cfg_of(tmp_path / name, seed=seed, optim_lr=lr), clock, start=0, reach=40,
                ends="completed")
    (tmp_path / "notes").mkdir()  # no config.json: not a run
    found = find_runs(str(tmp_path))
    assert found == [("a", f"{tmp_path}/a", (("optim.lr", "0.001"), ("seed", "0"))),
                     ("b", f"{tmp_path}/b", (("optim.lr", "0.001"), ("seed", "1"))),
                     ("c", f"{tmp_path}/c", (("optim.lr", "0.003"), ("seed", "1")))]
    text = runs_table.render(str(tmp_path), runs_table.rows(str(tmp_path), now=clock.t))
    assert text.splitlines()[1].split()[:4] == ["run", "lr", "seed", "state"]


def test_one_runs_own_folder_is_a_one_row_table(tmp_path: Path, clock: Clock,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from job.__main__ import main

    run_dir = tmp_path / "lm1"
    attempt(run_dir, cfg_of(run_dir), clock, start=0, reach=40, ends="completed")
    table = runs_table.rows(f"{run_dir}/", now=clock.t)
    assert [(row.name, row.values, row.status.state) for row in table] == [("lm1", (), State.COMPLETED)]
    assert main(["runs", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run_dir}: 1 run(s): 1 completed; best by eval_loss (lower is better): lm1 (1.05)"
    assert lines[1].split() == ["run", "state", "step", "train", "loss", "eval", "loss", "tok/s", "goodput"]
    assert lines[2].split()[:6] == ["*", "lm1", "completed", "40/40", "1.025", "1.05"] and len(lines) == 3


def test_runs_of_two_tasks_show_what_differs_between_runs_that_have_it_and_never_null(tmp_path: Path,
                                                                                      clock: Clock) -> None:
    longer = dataclasses.replace(config.defaults(tasks.load("lm")).model, seq_len=64)
    for name, cfg in (("lm-32", cfg_of(tmp_path / "lm-32")), ("lm-64", cfg_of(tmp_path / "lm-64", model=longer)),
                      ("spirals", cfg_of(tmp_path / "spirals", "classify"))):
        attempt(tmp_path / name, cfg, clock, start=0, reach=40, ends="completed")
    lm_values = (("data.global_batch", "32"), ("model.mlp_dim", "256"))
    # the lm runs' vocab_size, source, heads ... are no difference: the classifier has none; seq_len is one
    assert [values for _, _, values in find_runs(str(tmp_path))] == [
        (*lm_values, ("model.seq_len", "32"), ("task", "lm")), (*lm_values, ("model.seq_len", "64"), ("task", "lm")),
        (("data.global_batch", "64"), ("model.mlp_dim", "128"), ("task", "classify"))]
    text = runs_table.render(str(tmp_path), runs_table.rows(str(tmp_path), now=clock.t))
    lines = [line.split() for line in text.splitlines()]
    assert lines[1][:6] == ["run", "global_batch", "mlp_dim", "seq_len", "task", "state"]
    assert lines[3][:5] == ["lm-64", "32", "256", "64", "lm"]
    assert lines[4][:6] == ["spirals", "64", "128", "-", "classify", "completed"]
    assert "null" not in "\n".join(text.splitlines()[1:]) and len(lines[1]) == 13


def test_the_column_ranked_by_is_always_shown_and_one_no_run_fills_is_not(tmp_path: Path, clock: Clock) -> None:
    for seed, accuracy in ((0, 0.7), (1, 0.9)):
        run_dir = tmp_path / "spirals" / f"seed={seed}"
        attempt(run_dir, cfg_of(run_dir, "classify", seed=seed), clock, start=0, reach=40, ends="completed",
                accuracy=accuracy)
    table = runs_table.rows(str(tmp_path / "spirals"), now=clock.t)
    lines = [line.split() for line in runs_table.render("spirals", table, "eval_accuracy", higher=True).splitlines()]
    assert lines[1][6:11] == ["eval", "loss", "eval", "accuracy", "samples/s"]
    assert lines[2][6] == "0.7" and lines[3][:2] == ["*", "seed=1"] and lines[3][7] == "0.9"
    assert "accuracy" not in runs_table.render("spirals", table).splitlines()[1]  # ranked by eval_loss: not shown
    lines = [line.split() for line in runs_table.render("spirals", table, "test_accuracy").splitlines()]
    assert lines[1][8:10] == ["test", "accuracy"] and lines[2][6] == lines[3][6] == "-"  # none recorded: still shown
    # a sweep in its first minute: no losses, throughput or goodput yet, and no column for them but the ranked one
    made = sweep.plan("seed=0,1", ["train", "--run-dir", str(tmp_path / "sweep")])
    sweep.save_plan(made)
    restore(Path(made.runs[0].run_dir), cfg_of(made.runs[0].run_dir, seed=0))
    lines = [line.split() for line in runs_table.render(
        "sweep", runs_table.rows(str(tmp_path / "sweep"), now=clock.t + 5)).splitlines()]
    assert lines[1:] == [["run", "seed", "state", "step", "eval", "loss"], ["seed=0", "0", "running", "0/40", "-"],
                         ["seed=1", "1", "not", "started", "-", "-"]]


def test_throughput_is_in_each_tasks_unit_named_in_each_cell_when_the_units_differ(tmp_path: Path,
                                                                                   clock: Clock) -> None:
    attempt(tmp_path / "lm", cfg_of(tmp_path / "lm"), clock, start=0, reach=40, ends="completed")
    attempt(tmp_path / "spirals", cfg_of(tmp_path / "spirals", "classify"), clock, start=0, reach=40, ends="completed")
    table = runs_table.rows(str(tmp_path), now=clock.t)
    assert "samples_per_s" in table[1].status.latest["train"]  # the Reporter names the task's unit in the record
    lines = [line.split() for line in runs_table.render(str(tmp_path), table).splitlines()]
    assert lines[1][-2:] == ["throughput", "goodput"]
    assert lines[2][-2] == "tok/s" and lines[3][-2] == "samples/s"
    assert lines[3][-3].replace(",", "").isdigit()
    alone = [line.split() for line in runs_table.render("spirals", table[1:]).splitlines()]
    assert alone[1][-2] == "samples/s" and alone[2][-2].replace(",", "").isdigit()


def test_python_m_job_runs_prints_the_table_and_an_empty_folder_is_exit_2(tmp_path: Path, clock: Clock,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from job.__main__ import main

    _sweep(tmp_path / "sweep", clock)
    assert main(["runs", str(tmp_path / "sweep"), "--by", "train_loss", "--max"]) == 0
    out = capsys.readouterr().out
    assert "best by train_loss (higher is better): lr=3e-3,seed=0" in out and len(out.splitlines()) == 6
    assert main(["runs", str(tmp_path / "sweep"), "--by", "train_loss"]) == 0
    assert "best by train_loss (lower is better)" in capsys.readouterr().out  # without --max or --min: lower
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("error: SWEEP_DIR: expected a sweep folder (with sweep.json), a "
                                              "folder of run folders (each with a config.json) or one run's folder")


def test_python_m_job_runs_never_imports_jax(tmp_path: Path, clock: Clock) -> None:
    # a light command: it reads records on a login node, where importing jax costs a second or more
    _sweep(tmp_path / "sweep", clock)
    script = ("import sys; from job.__main__ import main; code = main(['runs', sys.argv[1]]); "
              "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax', 'orbax'}))")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "sweep")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.stdout.splitlines()[-1] == "0 []", (proc.stdout, proc.stderr)


def test_plot_of_a_sweep_folder_draws_every_runs_eval_loss_on_one_png(tmp_path: Path, clock: Clock,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _sweep(tmp_path, clock)
    curves = plot.eval_curves(str(tmp_path))
    assert [(label, steps) for label, steps, _ in curves] == [
        ("lr=1e-3 seed=0", [20, 40]), ("lr=1e-3 seed=1", [20]), ("lr=3e-3 seed=0", [20])]
    assert plot.main([str(tmp_path)]) == 0
    png = tmp_path / plot.SWEEP_PLOT
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (tmp_path / "metrics.png").exists()


def test_plot_of_one_run_still_draws_its_own_metrics(tmp_path: Path, clock: Clock) -> None:
    attempt(tmp_path, cfg_of(tmp_path), clock, start=0, reach=40, ends="completed")
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / plot.SWEEP_PLOT).exists()
    assert json.loads((tmp_path / "summary.json").read_text())["completed"] is True
