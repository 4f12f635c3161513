"""The pod loop's decisions, in process: when to recreate, rerun, give up, or stop; and its records."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from etils import epath

from deploy.tpu import cli as tpu
from deploy.tpu import failures
from deploy.tpu import job as tpu_job
from deploy.tpu.config import TpuConfig
from deploy.tpu.slice import Slice, TpuError
from job.errors import ConfigError
from job.observe.status import State, state_of
from job.runs import attempts as attempt_records
from tests.tpu.harness import ROOT
from tests.tpu.sim_runner import SimRunner

REQUEUE = 75


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TpuConfig:
    monkeypatch.chdir(tmp_path)
    return TpuConfig(name="pod-1", zone="us-central2-b", accelerator="v4-32", spot=True, retries=2,
                     source_dir=str(ROOT), job_args=("train", "--run-dir", "/mnt/b/r"))


def verbs(runner: SimRunner) -> list[str]:
    return [c[4] for c in runner.calls if c[4] in ("create", "delete")]


def test_requeue_exit_on_a_ready_slice_reruns_without_recreating(cfg: TpuConfig) -> None:
    runner = SimRunner(job_outcomes=[(REQUEUE, None), (0, None)])
    assert tpu.pod(cfg, runner) == 0
    assert verbs(runner) == ["create"]
    # probe (is a job running?), setup, start, follow; after the 75 one more probe (did `tpu-stop` stop it?)
    assert sum(c[4] == "ssh" for c in runner.calls) == 9


def test_preemption_never_spends_the_budget_and_the_slice_is_recreated_each_time(
        cfg: TpuConfig, caplog: pytest.LogCaptureFixture) -> None:
    runner = SimRunner(job_outcomes=[(255, "PREEMPTED")] * 5 + [(REQUEUE, None), (0, None)])
    assert tpu.pod(cfg, runner) == 0  # RETRIES=2, 6 preemptions
    assert verbs(runner) == ["create", *["delete", "create"] * 5]  # exit 75 on a READY slice: rerun there
    preempted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preempted")]
    assert len(preempted) == 6 and all("(0 of 2 retries used)" in line for line in preempted)
    assert "preemption 6, which does not spend the retry budget" in preempted[-1]
    assert not any(c[4] == "ssh" and "worker $worker: ended" in " ".join(c) for c in runner.calls)  # not a failure


def failure_retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("retry ")]


def asked_outcomes(runner: SimRunner) -> int:
    return sum(c[4] == "ssh" and "worker $worker: ended" in " ".join(c) for c in runner.calls)


WORKER_2_CRASHED = ["worker 0: ended 1 1700000003.5 RuntimeError: lost process 2",
                    "worker 1: ended 1 1700000003.2 RuntimeError: lost process 2",
                    "worker 2: ended 139 1700000003.9 step 7: loss 2.301",
                    "worker 3: running step 7: loss 2.301"]


def test_a_failed_run_is_rerun_on_the_same_slice_naming_the_worker_that_failed(
        cfg: TpuConfig, caplog: pytest.LogCaptureFixture) -> None:
    runner = SimRunner(job_outcomes=[(1, None), (0, None)], worker_outcomes=[WORKER_2_CRASHED])
    assert tpu.pod(cfg, runner) == 0
    assert verbs(runner) == ["create"]  # the slice is READY: reused, not recreated
    # a crash (SIGSEGV) is the cause even though workers 0 and 1 ended first, in reaction to it
    assert failure_retries(caplog) == [
        "retry 1 of 2 after exit code 139 (SIGSEGV) on worker 2: step 7: loss 2.301: rerunning from the newest "
        f"checkpoint on the same slice (READY; worker logs: {cfg.slice_dir / 'logs'})"]
    assert sum("setsid nohup" in " ".join(c) for c in runner.calls) == 2  # started again


def test_without_a_crash_the_first_worker_to_fail_is_named() -> None:
    outcomes = [o for line in ["worker 0: ended 1 1700000005.0 lost a peer", "worker 1: ended 86 1700000002.0 hung",
                               "worker 2: ended 0 1700000001.0 done", "worker 3: ended 75 1700000000.0 saved",
                               "Using ssh batch size of 4.", "worker 4: none"]
                if (o := failures.WorkerExit.parse(line, "pod-1", 0)) is not None]
    assert len(outcomes) == 5
    failed = failures.first_failure(outcomes)
    assert failed is not None and (failed.process, failed.code, failed.last_line) == (1, 86, "hung")
    text = failures.Failure(86, failed).describe()
    assert text == "exit code 86 (no step within the watchdog's timeout) on worker 1: hung"
    assert failures.first_failure(outcomes[2:]) is None


def test_the_retry_budget_runs_out_with_the_last_failures_code(cfg: TpuConfig,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    runner = SimRunner(job_outcomes=[(1, None)] * 5, worker_outcomes=[WORKER_2_CRASHED] * 5)
    assert tpu.pod(cfg, runner) == 139  # the failing worker's code, not worker 0's reaction
    assert verbs(runner) == ["create"] and asked_outcomes(runner) == 3  # 1 run + 2 retries
    assert [line.split(" after ")[0] for line in failure_retries(caplog)] == ["retry 1 of 2", "retry 2 of 2"]
    last = caplog.records[-1].getMessage()
    assert "the retry budget is spent (2 of 2 retries used): giving up" in last and "on worker 2" in last


def test_a_preemption_between_failures_leaves_the_budget_as_it_was(cfg: TpuConfig,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    runner = SimRunner(job_outcomes=[(1, None), (255, "PREEMPTED"), (1, None), (0, None)],
                       worker_outcomes=[WORKER_2_CRASHED] * 2)
    assert tpu.pod(cfg, runner) == 0
    assert [line.split(" after ")[0] for line in failure_retries(caplog)] == ["retry 1 of 2", "retry 2 of 2"]
    assert any("(1 of 2 retries used)" in r.getMessage() for r in caplog.records
               if r.getMessage().startswith("preempted"))
    assert verbs(runner) == ["create", "delete", "create"]


def test_retries_0_turns_retries_off(cfg: TpuConfig, caplog: pytest.LogCaptureFixture) -> None:
    runner = SimRunner(job_outcomes=[(1, None)])  # the workers say nothing: worker 0's code stands
    assert tpu.pod(dataclasses.replace(cfg, retries=0), runner) == 1
    assert verbs(runner) == ["create"] and failure_retries(caplog) == []
    assert [c[4] for c in runner.calls][-5:-1] == ["scp"] * 4  # every worker's log is kept
    assert "retry budget is spent (retries off (RETRIES=0))" in caplog.records[-1].getMessage()
    assert "(no worker said which failed first" in caplog.records[-1].getMessage()


def test_a_configuration_error_is_never_retried(cfg: TpuConfig, caplog: pytest.LogCaptureFixture) -> None:
    said = ["worker 0: ended 2 1700000000.1 error: --steps: expected an integer 1..2147483647, found 0. Fix: ...",
            "worker 1: ended 2 1700000000.2 error: --steps: expected an integer 1..2147483647, found 0. Fix: ..."]
    runner = SimRunner(job_outcomes=[(2, None)] * 3, worker_outcomes=[said])
    assert tpu.pod(cfg, runner) == 2
    assert asked_outcomes(runner) == 1 and failure_retries(caplog) == []
    assert "exit code 2 (a configuration error) on worker 0: error: --steps" in caplog.records[-1].getMessage()
    assert "never retried" in caplog.records[-1].getMessage()


def _stopped_meanwhile(monkeypatch: pytest.MonkeyPatch) -> SimRunner:
    """A runner whose job ends 75 (then 0, were it rerun), `make tpu-stop` having run while it ran."""
    original = tpu_job.run_job

    def run_then_stop(c: TpuConfig, r: SimRunner) -> int:
        code = original(c, r)
        tpu_job.stop_job(c, r)  # as if `make tpu-stop` had run meanwhile
        return code

    monkeypatch.setattr(tpu_job, "run_job", run_then_stop)
    return SimRunner(node="READY", job_outcomes=[(REQUEUE, None), (0, None)])


def test_a_job_stopped_by_tpu_stop_is_not_restarted(cfg: TpuConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _stopped_meanwhile(monkeypatch)
    assert tpu.pod(cfg, runner) == REQUEUE
    assert sum(c[4] == "ssh" for c in runner.calls) == 5  # probe, setup, start, follow, stop: no second run


def test_an_existing_slice_of_another_type_is_not_reused(cfg: TpuConfig) -> None:
    runner = SimRunner(node="READY", accelerator="v4-8")
    with pytest.raises(ConfigError, match=r"ACCELERATOR.*v4-8"):
        Slice(cfg, runner).ensure_ready()
    assert verbs(runner) == []


def test_a_creating_slice_is_waited_for(cfg: TpuConfig) -> None:
    states = iter(["CREATING", "READY"])
    runner = SimRunner(node="CREATING")
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        runner.node = next(states)

    assert Slice(cfg, runner, sleep=sleep).ensure_ready() == "waited"
    assert verbs(runner) == [] and sleeps == [cfg.poll_s] * 2


def test_waiting_gives_up_after_the_timeout(cfg: TpuConfig) -> None:
    clock = iter(range(0, 10**6, 1000))
    runner = SimRunner(node="CREATING")
    with pytest.raises(TpuError, match="still CREATING"):
        Slice(cfg, runner, sleep=lambda s: None, clock=lambda: float(next(clock))).wait_ready()


def test_run_on_a_missing_slice_says_to_create_it(cfg: TpuConfig, capsys: pytest.CaptureFixture[str]) -> None:
    runner = SimRunner()
    assert tpu.main(["run", "--name=pod-1", "--zone=us-central2-b", "--accelerator=v4-8", f"--source-dir={ROOT}"],
                    runner=runner) == 1
    assert "NOT_FOUND, not READY" in capsys.readouterr().err
    assert [c[4] for c in runner.calls] == ["describe"]


def test_a_suspended_queued_resource_is_deleted_with_its_node_and_queued_again(cfg: TpuConfig) -> None:
    queued = dataclasses.replace(cfg, queued=True)
    runner = SimRunner(job_outcomes=[(255, "PREEMPTED"), (0, None)])
    assert tpu.pod(queued, runner) == 0
    changes = [(c[3], c[4], "--force" in c) for c in runner.calls if c[4] in ("create", "delete")]
    assert changes == [("queued-resources", "create", False), ("queued-resources", "delete", True),
                       ("queued-resources", "create", False)]


def follows(runner: SimRunner) -> int:
    return sum(c[4] == "ssh" and any(" -F logs/job.log" in a for a in c) for c in runner.calls)


def test_a_dropped_follow_on_a_ready_slice_is_followed_again_with_a_growing_wait(
        cfg: TpuConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(tpu_job.time, "sleep", waits.append)
    runner = SimRunner(job_outcomes=[(255, None), (255, None), (0, None)])
    assert tpu.pod(cfg, runner) == 0
    assert follows(runner) == 3 and waits == [1.0, 2.0]
    assert verbs(runner) == ["create"] and sum("setsid nohup" in " ".join(c) for c in runner.calls) == 1


def test_ssh_that_keeps_failing_is_given_up_but_the_job_is_left_running(
        cfg: TpuConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(tpu_job.time, "sleep", waits.append)
    runner = SimRunner(job_outcomes=[(255, None)] * 30)
    assert tpu.pod(cfg, runner) == 255
    assert follows(runner) == tpu_job.REATTACH_LIMIT + 1 and max(waits) == tpu_job.BACKOFF_MAX_S
    assert verbs(runner) == ["create"] and not any("stop" in " ".join(c[5:6]) for c in runner.calls)


def test_a_job_still_running_is_attached_to_not_started_again(cfg: TpuConfig) -> None:
    runner = SimRunner(node="READY", worker_job="running")
    assert tpu_job.run_job(cfg, runner) == 0
    assert follows(runner) == 1
    assert not any(c[4] == "scp" or "setsid nohup" in " ".join(c) for c in runner.calls)  # nothing shipped or started


def test_an_unanswered_probe_is_asked_again_and_never_starts_a_second_job(
        cfg: TpuConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(tpu_job.time, "sleep", waits.append)
    runner = SimRunner(node="READY", worker_job="running", probe_failures=2)
    assert tpu_job.run_job(cfg, runner) == 0  # the third answer says "running": attached
    assert waits[:2] == [1.0, 2.0] and follows(runner) == 1
    assert not any(c[4] == "scp" or "setsid nohup" in " ".join(c) for c in runner.calls)

    runner = SimRunner(node="READY", worker_job="running", probe_failures=tpu_job.PROBE_TRIES)
    with pytest.raises(TpuError, match="expected worker 0 of pod-1 to say whether a job runs there") as info:
        tpu_job.run_job(cfg, runner)
    assert "Connection timed out" in str(info.value) and "Fix:" in str(info.value)
    assert not any(c[4] == "scp" or "setsid nohup" in " ".join(c) for c in runner.calls)  # nothing shipped or started


def test_a_job_stopped_from_another_machine_is_not_restarted(cfg: TpuConfig) -> None:
    runner = SimRunner(node="READY", worker_job="ended 75 stopped", job_outcomes=[(REQUEUE, None), (0, None)])
    assert tpu.pod(cfg, runner) == REQUEUE  # no local stop marker: worker 0 says so
    assert follows(runner) == 1


# ---------------------------------------------------------------------- RUN_DIR/attempts.jsonl
RECORD_KEYS = ["event", "job", "attempt", "began", "ended", "code", "outcome", "node", "process", "cause", "nodes",
               "action", "says"]  # the keys, in the order every backend writes them (job/runs/attempts.py)


@pytest.fixture
def recorded(cfg: TpuConfig, tmp_path: Path) -> TpuConfig:
    """cfg whose run dir is a folder here: the loop's records land in it."""
    (tmp_path / "run").mkdir()
    return dataclasses.replace(cfg, job_args=("train", "--run-dir", str(tmp_path / "run")))


def records_of(cfg: TpuConfig) -> list[dict]:
    return [e.to_json() for e in attempt_records.ended(epath.Path(cfg.job_args[2]))]


def test_a_failure_then_a_success_are_two_records_naming_the_failed_worker(recorded: TpuConfig) -> None:
    runner = SimRunner(job_outcomes=[(1, None), (0, None)], worker_outcomes=[WORKER_2_CRASHED])
    before = time.time()
    assert tpu.pod(recorded, runner) == 0
    failed, completed = records_of(recorded)
    assert list(failed) == RECORD_KEYS and list(completed) == RECORD_KEYS
    assert {k: failed[k] for k in RECORD_KEYS if k not in ("began", "ended")} == {
        "event": "ended", "job": "pod-1", "attempt": 1, "code": 139, "outcome": "failed", "node": "pod-1 worker 2",
        "process": "2", "cause": "step 7: loss 2.301", "nodes": "pod-1", "action": "restart",
        "says": "restart 1 of 2 in the allocation, on the same nodes"}
    assert {k: completed[k] for k in ("attempt", "code", "outcome", "node", "process", "cause", "action")} == {
        "attempt": 2, "code": 0, "outcome": "completed", "node": "-", "process": "-", "cause": "", "action": "none"}
    spans = [round(before, 3), failed["began"], failed["ended"], completed["began"], completed["ended"]]
    assert spans == sorted(spans) and spans[-1] <= round(time.time(), 3)  # epoch seconds, to the millisecond


def test_a_spent_budget_is_recorded_and_the_run_reads_failed_naming_the_worker(recorded: TpuConfig) -> None:
    run_dir = Path(recorded.job_args[2])
    (run_dir / "config.json").write_text(json.dumps({"steps": 30}))  # the job started: it wrote its config
    runner = SimRunner(job_outcomes=[(1, None)] * 3, worker_outcomes=[WORKER_2_CRASHED] * 3)
    assert tpu.pod(recorded, runner) == 139
    records = records_of(recorded)
    assert [(r["attempt"], r["outcome"], r["says"]) for r in records] == [
        (1, "failed", "restart 1 of 2 in the allocation, on the same nodes"),
        (2, "failed", "restart 2 of 2 in the allocation, on the same nodes"),
        (3, "failed", "not retried: the retry budget is spent (2 of 2)")]
    status = state_of(run_dir)
    assert status.state is State.FAILED
    assert status.describe() == "failed (exit 139, process 2 on pod-1 worker 2) at step 0"


def test_a_restarted_failure_reads_retrying_until_the_next_attempt_starts(recorded: TpuConfig) -> None:
    run_dir = Path(recorded.job_args[2])
    (run_dir / "config.json").write_text(json.dumps({"steps": 30}))
    runner = SimRunner(job_outcomes=[(1, None), (0, None)], worker_outcomes=[WORKER_2_CRASHED])
    assert tpu.pod(recorded, runner) == 0
    (run_dir / "attempts.jsonl").write_text(json.dumps(records_of(recorded)[0]) + "\n")  # only the failed one yet
    status = state_of(run_dir)
    assert (status.state, status.describe()) == (State.RETRYING, "retrying at step 0 (restart 1 of 2 in the "
                                                 "allocation, on the same nodes after exit 139, process 2 on pod-1 "
                                                 "worker 2)")


def test_a_preemption_is_recorded_and_spends_no_retry(recorded: TpuConfig) -> None:
    runner = SimRunner(job_outcomes=[(255, "PREEMPTED"), (REQUEUE, None), (1, None), (0, None)],
                       worker_outcomes=[WORKER_2_CRASHED])
    assert tpu.pod(recorded, runner) == 0
    records = records_of(recorded)
    assert [(r["attempt"], r["code"], r["outcome"], r["node"], r["says"]) for r in records] == [
        (1, 255, "preempted", "-", "rerun (a preemption spends no retry)"),
        (2, REQUEUE, "preempted", "-", "rerun (a preemption spends no retry)"),
        (3, 139, "failed", "pod-1 worker 2", "restart 1 of 2 in the allocation, on the same nodes"),  # the first
        (4, 0, "completed", "-", "none")]


def test_a_configuration_error_is_recorded_as_never_retried(recorded: TpuConfig) -> None:
    said = ["worker 0: ended 2 1700000000.1 error: --steps: expected an integer, found 0",
            "worker 1: ended 2 1700000000.2 error: --steps: expected an integer, found 0"]
    assert tpu.pod(recorded, SimRunner(job_outcomes=[(2, None)], worker_outcomes=[said])) == 2
    (record,) = records_of(recorded)
    assert (record["outcome"], record["node"], record["process"], record["says"]) == (
        "configuration error", "pod-1 worker 0", "0", "not retried: the same flags would fail again")


def test_a_job_stopped_by_tpu_stop_is_recorded_as_the_policys_decision(recorded: TpuConfig,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert tpu.pod(recorded, _stopped_meanwhile(monkeypatch)) == REQUEUE
    (record,) = records_of(recorded)
    assert (record["attempt"], record["code"], record["outcome"], record["action"], record["says"]) == (
        1, REQUEUE, "stopped", "stop", "not retried: stopped by `tpu-stop`; the same command resumes")


def test_a_lost_connection_and_a_dry_run_record_nothing(recorded: TpuConfig,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tpu_job.time, "sleep", lambda s: None)
    assert tpu.pod(recorded, SimRunner(job_outcomes=[(255, None)] * 30)) == 255  # the job may still be running
    dry = dataclasses.replace(recorded, dry_run=True)
    assert tpu.pod(dry, SimRunner(dry_run=True)) == 0
    assert records_of(recorded) == []


def test_a_run_dir_absent_on_this_machine_is_one_warning_per_attempt_and_the_loop_goes_on(
        cfg: TpuConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = dataclasses.replace(cfg, job_args=("train", "--run-dir", str(tmp_path / "absent" / "run")))
    runner = SimRunner(job_outcomes=[(1, None), (0, None)], worker_outcomes=[WORKER_2_CRASHED])
    assert tpu.pod(elsewhere, runner) == 0
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attempts: ")]
    # the workers' own folder, or one the job never made: said as such, with no fix to make it writable here
    assert len(warnings) == 2 and all("does not exist on this machine" in w and "Fix: " not in w
                                      for w in warnings), warnings
    assert "(exit 139, failed)" in warnings[0] and "(exit 0, completed)" in warnings[1]
    assert not (tmp_path / "absent").exists()


def test_records_are_numbered_after_those_already_there(tmp_path: Path) -> None:
    (tmp_path / "attempts.jsonl").write_text('{"event": "started", "attempt": 1}\n{"event": "ended", "attempt": 1}\n'
                                             '{"event": "ended", "att')  # a torn last line
    record = attempt_records.Ended("pod-a", 1.0, 2.0, 0, attempt_records.Outcome.COMPLETED,
                                   attempt_records.Action.NONE, "none")
    written = attempt_records.append(tmp_path, record)
    assert written == dataclasses.replace(record, attempt=2)
    assert attempt_records.ended(epath.Path(tmp_path))[-1] == written
