"""Metric writers (jsonl, TensorBoard, W&B offline), the goodput timer, --profile.steps and the cache folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from job.errors import ConfigError
from job.observe.goodput import Goodput, describe
from job.observe.metrics import WANDB_ID_FILE, WandbConfig, WandbWriter, open_writers
from job.observe.profile import parse_steps
from job.runs import attempts
from job.runtime import compile_cache
from tests.events import event_files, scalars, wandb_history, wandb_run
from tests.records import records


def write_steps(run_dir: Path, start: int, steps: range, offset: float = 0.0) -> None:
    writers = open_writers(run_dir, start_step=start)
    for step in steps:
        for writer in writers:
            writer.scalars(step, "train", {"loss": step + offset, "lr": 0.5})
            if step % 2 == 0:
                writer.scalars(step, "eval", {"loss": 10.0 * step + offset})
    for writer in writers:
        writer.close()


def test_tensorboard_event_files_hold_every_scalar_at_its_step(tmp_path: Path) -> None:
    write_steps(tmp_path, 0, range(1, 5))
    assert len(event_files(tmp_path)) == 1
    got = scalars(tmp_path)
    assert got["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert got["train/lr"] == [(s, 0.5) for s in (1, 2, 3, 4)]
    assert got["eval/loss"] == [(2, 20.0), (4, 40.0)]
    assert [(r["step"], r["split"]) for r in records(tmp_path)] == [
        (1, "train"), (2, "train"), (2, "eval"), (3, "train"), (4, "train"), (4, "eval")]


def test_a_resumed_run_replaces_the_steps_it_redoes_in_jsonl_and_tensorboard(tmp_path: Path) -> None:
    write_steps(tmp_path, 0, range(1, 7))  # reached step 6, but the newest checkpoint is step 4
    write_steps(tmp_path, 4, range(5, 9), offset=100.0)
    train = [(r["step"], r["loss"]) for r in records(tmp_path) if r["split"] == "train"]
    assert train == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    assert len(event_files(tmp_path)) == 2
    got = scalars(tmp_path)
    assert got["train/loss"] == train
    assert got["eval/loss"] == [(2, 20.0), (4, 40.0), (6, 160.0), (8, 180.0)]


def test_a_torn_last_line_does_not_stop_a_resume(tmp_path: Path) -> None:
    write_steps(tmp_path, 0, range(1, 4))
    with (tmp_path / "metrics.jsonl").open("a") as out:
        out.write('{"step": 4, "spl')  # killed mid-write
    write_steps(tmp_path, 3, range(4, 5))
    assert [(r["step"], r["split"]) for r in records(tmp_path)[-3:]] == [(3, "train"), (4, "train"), (4, "eval")]


def test_wandb_offline_logs_the_scalars_and_a_requeued_attempt_resumes_the_same_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    (tmp_path / "wb").mkdir()
    cfg = WandbConfig(project="job-tests")
    ids = []
    for attempt in range(2):
        writer = WandbWriter(tmp_path, cfg, {"steps": 8, "optim": {"lr": 0.003}})
        ids.append((tmp_path / WANDB_ID_FILE).read_text().strip())
        for step in range(1 + 4 * attempt, 5 + 4 * attempt):
            writer.scalars(step, "train", {"loss": float(step)})
        writer.close()
    assert ids[0] == ids[1]
    # offline-run-TIME-ID, and -ID-1 for a second attempt started within the same second
    runs = sorted(p for p in (tmp_path / "wb" / "wandb").glob("offline-run-*") if (p / f"run-{ids[0]}.wandb").exists())
    assert len(runs) == 2, runs  # one folder per attempt, both for the one run id
    for attempt, folder in enumerate(runs):
        run_file = folder / f"run-{ids[0]}.wandb"
        expected = [(s, float(s)) for s in range(1 + 4 * attempt, 5 + 4 * attempt)]
        # wandb's service process may still be writing the file when finish() returns: read until it holds
        # the attempt's records (or 30 s pass: records never written fail here)
        deadline = time.monotonic() + 30
        while True:
            history = [(int(h["_step"]), float(h["train/loss"])) for h in wandb_history(run_file)]
            if history == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert history == expected
        run = wandb_run(run_file)
        assert run.run_id == ids[0] and run.project == "job-tests"
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert config["steps"] == 8 and config["optim"] == {"lr": 0.003}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_goodput_splits_the_time_and_the_first_step_pays_for_compilation() -> None:
    clock = FakeClock()
    timer = Goodput(clock=clock, wall=clock)
    clock.now = 3.0
    timer.started()
    for _ in range(5):  # the first step takes 10 s, the others 1 s each
        with timer.step():
            clock.now += 10.0 if timer.first_step_s is None else 1.0
        with timer.part("input_wait"):
            clock.now += 0.5
    with timer.part("checkpoint"):
        clock.now += 2.0
    clock.now += 1.0  # nothing measured this
    split = timer.finish()
    assert split["startup_s"] == 3.0 and split["compile_s"] == 9.0 and split["steps_s"] == 5.0
    assert split["input_wait_s"] == 2.5 and split["checkpoint_s"] == 2.0 and split["other_s"] == 1.0
    assert split["total_s"] == 22.5 and split["goodput"] == round(5.0 / 22.5, 4)
    assert "goodput 22% of 22.5 s" in describe(split)


def test_what_the_steps_beside_a_write_lose_is_the_saves_cost_not_the_steps() -> None:
    clock = FakeClock()
    timer = Goodput(clock=clock, wall=clock)
    timer.started()
    # a first step (compile), 10 plain steps of 1 s, a save holding the loop 0.5 s, then 3 steps beside its write:
    # 3 s, 1.5 s and 1 s; then plain steps again (one of 0.8 s: faster than the median is no gain)
    for took, beside in [(10.0, False), *[(1.0, False)] * 10, (3.0, True), (1.5, True), (1.0, True), (0.8, False)]:
        if beside and timer.stalls() == 0.0 and clock.now == 20.0:  # the save, after the 11th step
            with timer.part("checkpoint"):
                clock.now += 0.5
        with timer.step(beside_write=beside):
            clock.now += took
    assert timer.stalls() == 2.5  # (3 - 1) + (1.5 - 1) + 0
    split = timer.finish()
    assert split["checkpoint_stalls_s"] == 2.5
    assert split["checkpoint_s"] == 3.0  # the 0.5 s it held the loop, and what the steps beside it lost
    assert split["steps_s"] == round(10 + 3 + 1.5 + 1 + 0.8 - 2.5 + 1.0, 3)  # the first step's ordinary part: 1 s
    assert "checkpoint 3.0 s (2.5 s of it steps slowed beside writes)" in describe(split)
    plain = Goodput(clock=clock, wall=clock)
    for _ in range(3):
        with plain.step(beside_write=True):  # no plain step to compare with: they stay steps
            clock.now += 2.0
    assert plain.finish()["checkpoint_stalls_s"] == 0.0


def test_a_compile_timed_before_the_start_is_compile_not_start_up() -> None:
    """The loop compiles the train step before it restores the state (job/train/plan.py's compile_step): that
    part is compile time, and start-up is what came before and after it until the loop started."""
    clock = FakeClock()
    timer = Goodput(clock=clock, wall=clock)
    clock.now = 2.0  # initialisation and the build
    with timer.part("compile"):
        clock.now += 7.0
    clock.now += 1.5  # the restore
    timer.started()
    with timer.part("compile"):  # the eval step's
        clock.now += 0.5
    split = timer.finish()
    assert split["startup_s"] == 3.5 and split["compile_s"] == 7.5 and split["other_s"] == 0.0
    assert split["total_s"] == 11.0


def test_goodput_of_a_requeued_attempt_counts_the_restart_and_the_steps_redone(tmp_path: Path) -> None:
    clock = FakeClock()
    first = Goodput(clock=clock, wall=clock)
    first.resume(tmp_path, 0, attempts.note_start(tmp_path))
    for step in range(1, 11):
        with first.step():
            clock.now += 2.0
        first.progress(tmp_path, step)  # reached step 10, killed; the newest checkpoint is step 8
    clock.now += 30.0
    second = Goodput(clock=clock, wall=clock)
    second.resume(tmp_path, 8, attempts.note_start(tmp_path))
    split = second.finish()
    assert split["attempt"] == 2 and split["restart_s"] == 30.0
    assert split["redone_steps"] == 2 and split["redone_s"] == 4.0
    assert "attempt 2: 30.0 s since the previous one, 2 steps redone (4.0 s)" in describe(split)


def test_goodput_counts_the_time_lost_after_failures_apart_from_preemptions(tmp_path: Path) -> None:
    """Attempt 1 is killed (no end record), attempt 2 saves after a preemption signal (its end record),
    attempt 3 fails where the batch script's record says so although it wrote its end record."""
    clock = FakeClock()

    def attempt(start: int, steps: int, *, end: bool) -> Goodput:
        timer = Goodput(clock=clock, wall=clock)
        timer.resume(tmp_path, start, attempts.note_start(tmp_path))
        for step in range(start + 1, start + steps + 1):
            with timer.step():
                clock.now += 2.0
            timer.progress(tmp_path, step)
        if end:
            timer.progress(tmp_path, start + steps, "end")
        clock.now += 10.0
        return timer

    attempt(0, 5, end=False)  # reached 5, resumes from 4: 10 s restart + 1 step (2 s) lost to a failure
    attempt(4, 4, end=True)  # reached 8 and saved it: 10 s lost to a preemption
    third = attempt(8, 2, end=True)
    began = third.began_wall
    with (tmp_path / "attempts.jsonl").open("a") as f:  # the backend's record of attempt 3, after its start's
        f.write(json.dumps({"event": "ended", "attempt": 3, "ended": began + 5, "code": 137, "outcome": "failed"})
                + "\n")
    split = attempt(9, 1, end=True).finish()
    assert split["attempt"] == 4 and split["failed_attempts"] == 2
    assert split["lost_to_failures_s"] == 12.0 + 12.0 and split["lost_to_preemption_s"] == 10.0
    assert "lost to 2 failure(s) 24.0 s, to preemption 10.0 s" in describe(split)
    lines = [json.loads(line) for line in (tmp_path / "goodput.jsonl").read_text().splitlines()]
    assert [r.get("after") for r in lines if r["event"] == "attempt"] == [None, "failure", "preemption", "failure"]


@pytest.mark.parametrize("text", ["", "5", "a:b", "0:3", "5:3", "3:99", "3:", "-1:2", "1:2:3",
                                  "+1:2", "\u0661:\u0662", "1_0:12"])
def test_bad_profile_steps_get_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_steps(text, 20)
    assert str(err.value) == (f"--profile.steps: expected A:B with 1 <= A <= B <= 20 (--steps), both steps "
                              f"included, found {text!r}. Fix: pass --profile.steps 10:15")


@pytest.mark.parametrize(("text", "expected"), [("10:15", (10, 15)), ("3:3", (3, 3)), (" 1 : 20 ", (1, 20))])
def test_profile_steps_are_a_closed_range(text: str, expected: tuple[int, int]) -> None:
    assert parse_steps(text, 20) == expected


@pytest.mark.parametrize(("setting", "env", "expected"), [
    ("", {"HOME": "/h"}, "/h/.cache/job/jax"),
    ("", {"HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/x/job/jax"),
    ("", {"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/j"),
    ("", {"HOME": "/h", "JOB_COMPILE_CACHE": "/c", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/c"),
    ("/flag", {"JOB_COMPILE_CACHE": "/c"}, "/flag"),
    ("none", {"JOB_COMPILE_CACHE": "/c"}, None),
    ("", {"JOB_COMPILE_CACHE": "None"}, None),
])
def test_the_compile_cache_folder_is_chosen_by_flag_then_environment_then_default(
        setting: str, env: dict[str, str], expected: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", env.get("HOME", "/h"))
    assert compile_cache.resolve(setting, env) == expected


@pytest.mark.parametrize(("setting", "env", "run_dir", "expected"), [
    ("", {}, "gs://bucket/runs/one", "gs://bucket/.cache/job/jax"),  # every worker of a slice reads one folder
    ("", {"XDG_CACHE_HOME": "/x"}, "runs/one", "/x/job/jax"),  # a local run dir: the user's cache folder
    ("", {"JOB_COMPILE_CACHE": "/c"}, "gs://bucket/run", "/c"),  # what the user gave wins
    ("", {"JAX_COMPILATION_CACHE_DIR": "gs://other/jax"}, "gs://bucket/run", "gs://other/jax"),
    ("/flag", {}, "gs://bucket/run", "/flag"),
    ("none", {}, "gs://bucket/run", None),
])
def test_a_gs_run_dir_without_a_cache_folder_caches_in_its_bucket(
        setting: str, env: dict[str, str], run_dir: str, expected: str | None) -> None:
    assert compile_cache.resolve(setting, env, run_dir) == expected


def test_the_summary_holds_every_process_cache_counts_and_process_0s_at_the_top() -> None:
    assert compile_cache.summary_entry("/c", [[19, 0, 1.6789], [0, 19, 40.86]]) == {
        "dir": "/c", "hits": 19, "misses": 0,
        "by_process": {"hits": [19, 0], "misses": [0, 19], "compile_s": [1.679, 40.86]}}
    assert compile_cache.summary_entry(None, [[0, 0, 2.0]]) == {
        "dir": None, "hits": 0, "misses": 0, "by_process": {"hits": [0], "misses": [0], "compile_s": [2.0]}}


def test_a_cache_lookup_without_a_hit_is_a_miss_on_every_process() -> None:
    import jax

    with compile_cache.CacheEvents() as events:
        for event in (events.LOOKUP, events.HIT, events.LOOKUP, events.LOOKUP, "/jax/other"):
            jax.monitoring.record_event(event)
    jax.monitoring.record_event(events.LOOKUP)  # after the exit: not counted
    assert (events.lookups, events.hits, events.misses) == (3, 1, 2)


def test_a_bad_profile_range_stops_the_command_line_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from job.__main__ import main

    assert main(["train", "--steps", "20", "--profile.steps", "15:10"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: --profile.steps: expected A:B with 1 <= A <= B <= 20 (--steps), both steps "
                           "included, found '15:10'. Fix: pass --profile.steps 10:15")


def test_plot_of_a_folder_without_metrics_says_what_it_needs(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from job.observe import plot

    assert plot.main([str(tmp_path)]) == 2
    assert "expected a run directory whose metrics.jsonl has train records" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()


def test_a_compile_cache_folder_that_cannot_be_made_turns_the_cache_off_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import jax

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        with caplog.at_level("WARNING", logger="job.train"):
            assert compile_cache.enable(str(blocker / "jax"), env={}) is None
        assert jax.config.jax_enable_compilation_cache is False
        assert "running without the cache" in caplog.text and str(blocker / "jax") in caplog.text
        assert compile_cache.enable(str(tmp_path / "cache"), env={}) == str(tmp_path / "cache")
        assert jax.config.jax_enable_compilation_cache is True
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
