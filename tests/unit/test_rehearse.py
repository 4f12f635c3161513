"""`make rehearse` without a run: the argv of each launch, the flags it overrides, the comparisons and the lines
it prints, with launches answered by a recording runner that leaves what the job would leave."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from deploy import rehearse, row_contract
from deploy.rehearse import Shrink
from job.core import flags, rundir
from tests.doubles import RecordingRunner
from tests.records import check_lines
from tests.unit.test_security import make_tpu, nul_split
from tests.user_tasks import range_seeded, regression

IMPURE = ("[rank 1] ConfigError: the task's rows: expected rows(split, step, start, stop) a pure function of its "
          "arguments, found \"process 0: rows('train', 0, 0, 8) asked twice\". Fix: draw the rows' randomness from "
          "job.random\n[launch] rank 1 exited with code 2; stopping the other 1 process(es)\n")


def straight_loss(processes: int, step: int) -> float:
    return 4.0 - step / 8


@dataclasses.dataclass
class JobDouble(RecordingRunner):
    """Each launch recorded and answered as the job would leave its run dir: metrics.jsonl (train losses from
    `loss(processes, step)`, an eval at the last step), summary.json, eval-S.json; `failing`: the exit code and
    stderr of the launch at that index."""

    loss: Callable[[int, int], float] = straight_loss
    failing: dict[int, tuple[int, str]] = dataclasses.field(default_factory=dict)
    eval_drift: float = 0.0  # added to what `python -m job eval` computes

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:  # type: ignore[override]
        super().run(argv, **kwargs)
        argv = self.calls[-1]
        if len(self.calls) - 1 in self.failing:
            code, stderr = self.failing[len(self.calls) - 1]
            return subprocess.CompletedProcess(argv, code, "", stderr)
        processes, job = int(argv[argv.index("-n") + 1]), argv[argv.index("--") + 4:]
        run_dir = Path(str(flags.value(job, "--run-dir")))
        if job[0] == "eval":
            return self.evaluate(argv, run_dir)
        steps, resumed = int(str(flags.value(job, "--steps"))), "--resume" in job
        start = len(rehearse.train_losses(run_dir)) if resumed else 0
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(rundir.metrics(run_dir), "a", encoding="utf-8") as out:
            for step in range(start + 1, steps + 1):
                out.write(json.dumps({"step": step, "split": "train", "loss": self.loss(processes, step)}) + "\n")
            out.write(json.dumps({"step": steps, "split": "eval", "loss": 3.5, "accuracy": 0.25}) + "\n")
        rundir.summary(run_dir).write_text(json.dumps({"params_sha256": f"sha-{self.loss(processes, steps)}"}))
        said = f"[rank 0] INFO job.train: resumed from step {start} ({run_dir}/checkpoints)\n" if resumed else ""
        return subprocess.CompletedProcess(argv, 0, "", said)

    def evaluate(self, argv: list[str], run_dir: Path) -> subprocess.CompletedProcess[str]:
        step = max(rehearse.train_losses(run_dir))
        record = {"step": step, "splits": {"eval": {"rows": 64, "batches": 2, "loss": 3.5 + self.eval_drift,
                                                     "accuracy": 0.25}}}
        rundir.evaluation(run_dir, step).write_text(json.dumps(record))
        return subprocess.CompletedProcess(argv, 0, "", "")


ARGS = ("train", "--model.dim", "32", "--steps", "200", "--log-every=10", "--run-dir", "runs/mine")


def rehearsed(runner: JobDouble, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              *argv: str) -> tuple[int, str]:
    """`python -m deploy.rehearse ARGV` with `runner`, its folder made under tmp_path: (exit code, stdout)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = rehearse.main(list(argv), runner)
    return code, capsys.readouterr().out


def test_each_run_is_args_with_only_what_must_shrink_replaced_in_place() -> None:
    shrink = Shrink.of(ARGS, 6)
    assert shrink.argv(ARGS, Path("/r/2x2")) == [
        "train", "--model.dim", "32", "--steps", "6", "--log-every", "1", "--run-dir", "/r/2x2", "--eval-every", "6",
        "--ckpt.every", "3", "--optim.decay-steps", "6"]
    assert flags.value(shrink.argv(ARGS, Path("/r/resume"), 3), "--steps") == "3"  # the resume's first part


def test_a_decay_horizon_args_give_is_kept_and_one_they_leave_unset_is_pinned_to_s() -> None:
    assert not Shrink.of((*ARGS, "--optim.decay-steps", "1000"), 6).pin_horizon
    assert Shrink.of((*ARGS, "--optim.decay-steps=0"), 6).pin_horizon  # 0: the horizon would be --steps
    said = Shrink.of((*ARGS, "--optim.decay-steps", "1000"), 8).said()
    assert "but --steps 8 --eval-every 8 --log-every 1 --ckpt.every 4 and --run-dir in a temporary folder" in said
    assert "decay-steps" not in said and "(the resume: --steps 4, then --steps 8 --resume)" in said


def test_a_passing_rehearsal_launches_five_runs_on_their_layouts_and_removes_its_folder(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = JobDouble()
    code, out = rehearsed(runner, capsys, tmp_path, monkeypatch, *ARGS)
    assert code == 0, out
    lines, shrink = out.splitlines(), Shrink.of(ARGS, 6)
    assert lines[0] == shrink.said() and lines[-1].startswith("rehearsed in ")
    assert [line.split(":")[0] for line in lines[1:-1]] == [f"ok    {name}" for name in
                                                            ("args", "topology", "resume", "eval")]
    folder = Path(str(flags.value(runner.calls[0], "--run-dir"))).parent
    launches = [(call[:8], call[8:11], call[11:]) for call in runner.calls]
    launcher = [sys.executable, "-m", "job.launch", "-n"]
    assert [head for head, _, _ in launches] == [[*launcher, n, "--devices-per-process", d, "--"] for n, d in
                                                 [("2", "2"), ("1", "4"), ("2", "2"), ("2", "2"), ("2", "2")]]
    assert {tuple(job) for _, job, _ in launches} == {(sys.executable, "-m", "job")}
    assert [rest for _, _, rest in launches] == [
        shrink.argv(ARGS, folder / "2x2"), shrink.argv(ARGS, folder / "1x4"), shrink.argv(ARGS, folder / "resume", 3),
        [*shrink.argv(ARGS, folder / "resume"), "--resume"], ["eval", "--run-dir", str(folder / "2x2")]]
    assert not folder.exists()


def test_the_first_step_whose_loss_differs_on_1_x_4_is_named_with_both_values(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def loss(processes: int, step: int) -> float:  # 1 x 4 drifts from step 4 on
        return straight_loss(processes, step) + (processes == 1 and step >= 4) / 64

    runner = JobDouble(loss=loss)
    code, out = rehearsed(runner, capsys, tmp_path, monkeypatch, *ARGS)
    lines = check_lines(out)
    assert code == 1
    assert lines["topology"] == (
        "FAIL  topology: the train loss of step 4 differs: 3.5 on 2 x 2, 3.515625 on 1 x 4 (expected within 1e-4 "
        "relative). Fix: a row's values are a function of split, step and its global row index, never of the range "
        "[start, stop) a process asks for; the task's rows keep it (steps 0-6 asked whole, in halves and in "
        "quarters), so look in the model for what depends on the devices or the process (an rng drawn per device, "
        "a sum in another order beyond float noise)")
    assert lines["resume"].startswith("ok ") and lines["eval"].startswith("ok ")  # they need only the 2 x 2 run
    folder = Path(str(flags.value(runner.calls[0], "--run-dir"))).parent
    assert f"the rehearsal's runs are kept in {folder}" in out and (folder / "1x4.log").is_file()


def test_rows_seeded_by_the_range_asked_break_the_contract_at_a_named_row_and_field() -> None:
    # a user's sources: seeded by (step, start) of the range asked, a pure function of (split, step, start, stop);
    # and seeded by (step, global row)
    assert row_contract.first_difference(range_seeded.Rows(3), 8, 2) == (
        "step 0, global row 4, field 'x': asked as rows [0, 8) and as [4, 8) (the 2nd of 2 ranges) it differs")
    assert row_contract.first_difference(regression.Rows(3), 8, 2) is None
    check = rehearse.topologies_agree({1: 4.0}, {1: 4.5}, 1,
                                      lambda: row_contract.first_difference(range_seeded.Rows(3), 8, 1))
    assert check.line() == (
        "FAIL  topology: the train loss of step 1 differs: 4.0 on 2 x 2, 4.5 on 1 x 4 (expected within 1e-4 relative)."
        " Fix: a row's values are a function of split, step and its global row index, never of the range [start, "
        "stop) a process asks for; the task's rows break it at step 0, global row 4, field 'x': asked as rows [0, 8) "
        "and as [4, 8) (the 2nd of 2 ranges) it differs: draw each row's randomness from its global row index "
        "(job.random.row_bits(seed, split_id, step, start, stop, width) gives row r the same words whatever range "
        "holds it)")


@pytest.mark.parametrize(("task", "found"), [
    ("range_seeded", "step 0, global row 8, field 'x': asked as rows [0, 16) and as [8, 16) (the 2nd of 2 ranges) it "
                     "differs"),
    ("regression", None),
])
def test_the_rows_checked_are_those_of_the_task_args_name(task: str, found: str | None, tmp_path: Path) -> None:
    args = ("train", "--task", f"tests.user_tasks.{task}:TASK")
    assert rehearse.Rehearsal(args, Shrink.of(args, 6), tmp_path, RecordingRunner()).rows() == found


def test_a_loss_within_1e_4_relative_passes_the_topology_check_but_would_fail_a_bitwise_one() -> None:
    wide, tall = {1: 2.0, 2: 1.0}, {1: 2.0, 2: 1.0 + 5e-5}
    assert rehearse.topologies_agree(wide, tall, 2).ok
    assert rehearse.first_difference(wide, tall, [1, 2], 0.0) == (2, 1.0, 1.0 + 5e-5)
    assert rehearse.first_difference(wide, {1: 2.0}, [1, 2], 1e-4) == (2, 1.0, None)  # a step not logged differs


def test_a_resume_that_differs_names_the_first_step_after_it_and_what_to_look_at() -> None:
    straight = {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.5, 5: 1.25, 6: 1.0}
    resumed = {**straight, 5: 1.2500001}
    check = rehearse.resume(straight, resumed, Shrink(6, True), ("a", "a"))
    assert check.line() == (
        "FAIL  resume: losses after resume differ from step 5: 1.2500001 resumed, 1.25 straight. Fix: is the source a "
        "pure function of (split, step, row)? is every rng stream in the model's state? does a task's own optimizer "
        "take its schedule's length from its `steps` argument?")
    other = rehearse.resume(straight, straight, Shrink(6, True), ("a", "b"))
    assert not other.ok and "params_sha256 after resume differs: b resumed, a straight" in other.detail
    assert rehearse.resume(straight, straight, Shrink(6, True), ("a", "a")).ok


def test_an_eval_metric_that_differs_from_the_runs_own_fails_naming_split_metric_and_values(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = rehearsed(JobDouble(eval_drift=1e-3), capsys, tmp_path, monkeypatch, *ARGS)
    assert code == 1
    assert check_lines(out)["eval"].startswith("FAIL  eval: split eval's loss at step 6: 3.501 from python -m job eval "
                                               "on 2 x 2, 3.5 in the run's metrics.jsonl (expected within 1e-6")
    nothing = rehearse.eval_agrees([], {"step": 6, "splits": {}}, 6)  # a task without eval splits: nothing to compare
    assert nothing.skipped and not nothing.ok and not nothing.failed
    assert not rehearse.eval_agrees([], None, 6).ok


def test_a_failed_run_is_its_checks_fail_line_with_the_runs_error_and_the_checks_after_it_are_skipped(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = JobDouble(failing={0: (2, "[rank 0] INFO job.train: step 0\n" + IMPURE)})
    code, out = rehearsed(runner, capsys, tmp_path, monkeypatch, "--args", " ".join(ARGS))
    assert code == 1 and len(runner.calls) == 1
    assert check_lines(out)["topology"].startswith(
        "FAIL  topology: the 2 x 2 run exited 2: ConfigError: the task's rows: expected rows(split, step, start, stop) "
        "a pure function")
    assert check_lines(out)["topology"].endswith("Fix: draw the rows' randomness from job.random")  # its own fix only
    assert "skip  resume: not run: it needs the 2 x 2 run, which failed" in out.splitlines()
    assert "skip  eval: not run: it needs the 2 x 2 run, which failed" in out.splitlines()
    assert "1 check(s) failed" in out


def test_a_failed_resume_says_which_part_failed_and_where_its_output_is(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = JobDouble(failing={3: (1, "[rank 0] Traceback (most recent call last):\n[rank 0]   File \"x.py\"\n"
                                      "[rank 0] KeyError: 'rng'\n[launch] rank 0 exited with code 1\n")})
    code, out = rehearsed(runner, capsys, tmp_path, monkeypatch, *ARGS)
    folder = Path(str(flags.value(runner.calls[0], "--run-dir"))).parent
    assert code == 1 and check_lines(out)["resume"] == (
        f"FAIL  resume: the resumed run (--steps 6 on 2 x 2) exited 1: KeyError: 'rng'. Fix: read the run's whole "
        f"output in {folder / 'resume-2.log'}")
    assert "rank 0 exited with code 1" in (folder / "resume-2.log").read_text()


def test_the_last_words_of_a_run_are_its_last_error_else_the_launchers() -> None:
    assert rehearse.last_words(IMPURE).startswith("ConfigError: the task's rows")
    assert rehearse.last_words("[rank 0] step 3\n[launch] rank 1 was killed by SIGKILL\n[rank 0] I0000 noise\n") == \
        "[launch] rank 1 was killed by SIGKILL"
    assert rehearse.last_words("[rank 1] error: --run-dir: expected ...\n") == "error: --run-dir: expected ..."
    assert rehearse.last_words("") == "no output"


def test_args_whose_batch_does_not_split_over_4_devices_exit_2_and_run_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = JobDouble()
    code, out = rehearsed(runner, capsys, tmp_path, monkeypatch, "--args", "train --data.global-batch 30")
    assert code == 2 and runner.calls == [] and list(tmp_path.iterdir()) == []
    assert check_lines(out)["args"] == (
        "FAIL  args: --data.global-batch: expected a multiple of the data-parallel size 4 = 4, found 30 on 4 devices "
        "(2 x 2 and 1 x 4). Fix: use --data.global-batch 32")
    assert out.splitlines()[-1] == "nothing was run"


@pytest.mark.parametrize(("args", "said"), [
    ("train --mesh data=2,modle=2 --rule tensor", "Fix: did you mean 'model'? --mesh data=2,model=2"),
    ("train --mesh data=-1,model=3", "Fix: model=3 does not divide 4 devices; e.g. --mesh data=-1,model=2"),
])
def test_a_mesh_axis_no_rule_maps_to_or_a_size_that_does_not_divide_exits_2_and_runs_nothing(
        args: str, said: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = JobDouble()
    code, out = rehearsed(runner, capsys, tmp_path, monkeypatch, "--args", args)
    assert code == 2 and runner.calls == [] and said in check_lines(out)["args"], out


@pytest.mark.parametrize(("argv", "said"), [
    (["--args", "--steps 3"], "found '--steps 3'. Fix: ARGS='train --steps 3'"),
    (["--args", "eval --run-dir runs/x"], "expected `train` first (a rehearsal trains), found 'eval --run-dir runs/x'"),
    (["train", "--optim.lr", "-1"], "--optim.lr: expected a finite learning rate > 0"),
    (["train", "--task", "nope"], "--task: expected one of classify, lm"),
])
def test_args_that_train_nothing_or_do_not_validate_exit_2(argv: list[str], said: str,
                                                           capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = rehearsed(JobDouble(), capsys, tmp_path, monkeypatch, *argv)
    assert code == 2 and said in check_lines(out)["args"], out


def test_make_rehearse_hands_args_and_steps_on_as_one_word_each() -> None:
    words = "train --task 'my pkg:TASK' --model.dim \"$(id)\""
    with tempfile.TemporaryDirectory() as here:
        proc = make_tpu("rehearse", here, ARGS=words, STEPS="8")
        assert proc.returncode == 0, proc.stderr
        received = nul_split((Path(here) / "argv").read_bytes())
        assert received == ["-m", "deploy.rehearse", "--steps=8", f"--args={words}"]
        make_tpu("rehearse", here, ARGS="train")
        assert nul_split((Path(here) / "argv").read_bytes()) == ["-m", "deploy.rehearse", "--args=train"]
