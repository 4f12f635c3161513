"""Sweeps: how one is said (a grid, a file), its runs' names, flags and folders, and every run checked before
anything starts, with the lm task's own config and validation (job/runs/sweep.py, job/train/sweep_check.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from job.core.errors import ConfigError
from job.runs import sweep
from job.runs.sweep import plan
from job.train import sweep_check

BASE = ["train", "--steps", "40", "--run-dir", "runs/sweep1"]


def test_a_grid_is_the_product_in_the_order_given_the_last_name_varying_fastest() -> None:
    runs = sweep.parse("optim.lr=1e-3,3e-3,1e-2 seed=0,1")
    assert runs == (
        (("optim.lr", "1e-3"), ("seed", "0")), (("optim.lr", "1e-3"), ("seed", "1")),
        (("optim.lr", "3e-3"), ("seed", "0")), (("optim.lr", "3e-3"), ("seed", "1")),
        (("optim.lr", "1e-2"), ("seed", "0")), (("optim.lr", "1e-2"), ("seed", "1")),
    )
    assert sweep.parse("  model.layers=2  ") == ((("model.layers", "2"),),)


def test_a_sweep_file_holds_one_run_per_line_with_comments_and_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "lr.txt"
    path.write_text("# learning rates\n--optim.lr 1e-3 --seed 0\n\n--optim.lr=-1e-3 --seed 1  # negative\n"
                    "--model.no-scan --data.source 'a file,with comma.npy'\n--model.scan\n")
    assert sweep.parse(str(path)) == (
        (("optim.lr", "1e-3"), ("seed", "0")),
        (("optim.lr", "-1e-3"), ("seed", "1")),
        (("model.scan", "false"), ("data.source", "a file,with comma.npy")),
        (("model.scan", "true"),),
    )


@pytest.mark.parametrize(("spec", "words"), [
    ("optim.lr", ["expected NAME=V1,V2,... words, or the path of a sweep file", "FileNotFoundError"]),
    ("seed=0 optim.lr", ["SWEEP word 'optim.lr'", "expected NAME=V1,V2,..."]),
    ("--optim.lr=1e-3,3e-3", ["SWEEP word '--optim.lr=1e-3,3e-3'", "without dashes", "write optim.lr=..."]),
    ("data.source=\"a,b\",c", ["cannot be in the grid form", "sweep file"]),
    ("optim.lr=1e-3,,3e-3", ["with no empty value", "optim.lr=1e-3,3e-3"]),
    ("optim.lr=1e-3,", ["with no empty value", "Fix: remove the stray comma: optim.lr=1e-3"]),
    ("seed=0,1,0", ["each value of seed once", "write seed=0,1"]),
    ("seed=0 seed=1", ["seed once in the sweep"]),
    ("optim.warmup_steps=1 optim.warmup-steps=2", ["optim.warmup-steps once in the sweep"]),
    ("run-dir=a,b", ["the sweep gives each run SWEEP_DIR/NAME", "--run-dir in ARGS"]),
    ("optim..lr=1", ["a config field as a dotted name"]),
    ("1seed=1", ["a config field as a dotted name"]),
])
def test_each_bad_spec_word_is_one_error_naming_the_word_and_the_fix(spec: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        plan(spec, BASE)
    message = str(caught.value)
    assert "expected" in message and "Fix:" in message
    for word in words:
        assert word in message, message


def test_a_bad_line_of_a_sweep_file_is_named_by_its_line(tmp_path: Path) -> None:
    path = tmp_path / "runs.txt"
    path.write_text("--seed 0\n--seed 1\nseed 2\n")
    with pytest.raises(ConfigError, match=r"runs.txt line 3: expected --name value pairs, found 'seed'"):
        sweep.parse(str(path))
    path.write_text("--seed 0\n# again\n--seed   0\n")
    with pytest.raises(ConfigError, match="line 3: expected each run once.*line 1 is the same run"):
        sweep.parse(str(path))
    path.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="a sweep file with at least one run"):
        sweep.parse(str(path))


def test_run_names_are_stable_filesystem_safe_and_say_the_values() -> None:
    spec = "optim.lr=1e-3,3e-3 seed=0,1 data.source=data/a.npy model.dtype=bfloat16"
    first, again = plan(spec, BASE), plan(spec, BASE)
    assert [r.name for r in first.runs] == [r.name for r in again.runs]
    assert first.runs[1].name == "lr=1e-3,seed=1,source=data_a.npy,dtype=bfloat16"
    assert all(re.fullmatch(r"[A-Za-z0-9._=,+-]+", r.name) for r in first.runs)
    assert [r.run_dir for r in first.runs][:2] == ["runs/sweep1/lr=1e-3,seed=0,source=data_a.npy,dtype=bfloat16",
                                                  "runs/sweep1/lr=1e-3,seed=1,source=data_a.npy,dtype=bfloat16"]


def test_names_sharing_a_last_part_keep_their_whole_dotted_name() -> None:
    names = [r.name for r in plan("seed=0 data.seed=1,2 model.dtype=float32", BASE).runs]
    assert names == ["seed=0,data.seed=1,dtype=float32", "seed=0,data.seed=2,dtype=float32"]


def test_names_alike_once_cleaned_get_a_hash_and_long_names_are_cut_with_one() -> None:
    names = sweep.run_names([(("data.source", "a/b"),), (("data.source", "a:b"),), (("data.source", "a_b"),)])
    assert len(set(names)) == 3
    assert all(re.fullmatch(r"source=a_b\+[0-9a-f]{8}", n) for n in names), names
    assert names == sweep.run_names([(("data.source", "a/b"),), (("data.source", "a:b"),), (("data.source", "a_b"),)])
    long = sweep.run_names([(("data.source", "x" * 300),), (("data.source", "x" * 299 + "y"),)])
    assert all(len(n) == sweep.MAX_NAME for n in long) and long[0] != long[1]
    assert long[0].startswith("source=xxx") and re.search(r"\+[0-9a-f]{8}$", long[0])


def test_a_runs_values_win_over_the_base_flags_of_the_same_name() -> None:
    base = ["train", "--seed", "5", "--optim.lr=9", "--run-dir", "runs/s", "--steps", "40", "--run_dir=runs/old"]
    run = plan("optim.lr=1e-3 seed=1", base).runs[0]
    # the last --run-dir given is the one the parser takes: the sweep folder
    assert run.flags == ("train", "--steps", "40", "--run-dir", "runs/old/lr=1e-3,seed=1", "--optim.lr", "1e-3",
                         "--seed", "1")
    assert plan("optim.warmup_steps=5", ["--run-dir", "r"]).runs[0].flags == (
        "--run-dir", "r/warmup_steps=5", "--optim.warmup-steps", "5")


def test_a_bool_field_sweeps_as_its_switch_and_the_bases_switch_goes() -> None:
    base = ["train", "--model.no-scan", "--run-dir", "runs/s", "--model.scan"]
    runs = plan("model.scan=true,off", base, switches={"model.scan"}).runs
    assert [r.flags for r in runs] == [("train", "--run-dir", "runs/s/scan=true", "--model.scan"),
                                       ("train", "--run-dir", "runs/s/scan=off", "--model.no-scan")]
    with pytest.raises(ConfigError, match=r"SWEEP value model.scan=maybe: expected 1 or 0 \(or true/false\)"):
        plan("model.scan=maybe", base, switches={"model.scan"})
    assert sweep_check.switches(_lm()) >= {"model.scan", "resume", "eval-full", "ckpt.async-save"}


def test_the_sweep_folder_is_the_base_run_dir_and_a_sweep_needs_one() -> None:
    assert plan("seed=0", ["--run-dir", "gs://bucket/sweeps/a/"]).runs[0].run_dir == "gs://bucket/sweeps/a/seed=0"
    with pytest.raises(ConfigError, match=r"ARGS: expected --run-dir SWEEP_DIR.*Fix: add e.g. --run-dir runs/sweep1"):
        plan("seed=0,1", ["train", "--steps", "40"])
    with pytest.raises(ConfigError, match=r"ARGS: expected the flags of python -m job train"):
        plan("seed=0,1", ["eval", "--run-dir", "runs/x"])


def test_the_dry_run_lists_every_run_with_its_run_dir_and_flags() -> None:
    text = sweep.listing(plan("optim.lr=1e-3,3e-3 seed=0,1", BASE))
    lines = text.splitlines()
    assert lines[0] == "sweep runs/sweep1: 4 run(s)"
    assert lines[4] == ("  runs/sweep1/lr=3e-3,seed=1: python -m job train --steps 40 "
                        "--run-dir runs/sweep1/lr=3e-3,seed=1 --optim.lr 3e-3 --seed 1")
    assert len(lines) == 5


def test_a_plan_reads_back_from_sweep_json_with_its_folder_as_found(tmp_path: Path) -> None:
    made = plan("optim.lr=1e-3,3e-3 seed=0", ["--run-dir", str(tmp_path / "a")])
    sweep.save_plan(made)
    (tmp_path / "a").rename(tmp_path / "b")  # copied elsewhere: the runs are where the record is
    read = sweep.load_plan(tmp_path / "b")
    assert read is not None and [r.values for r in read.runs] == [r.values for r in made.runs]
    assert [r.run_dir for r in read.runs] == [f"{tmp_path / 'b'}/{r.name}" for r in made.runs]
    assert sweep.load_plan(tmp_path) is None


def _lm() -> object:
    from job.train import task

    return task.load("lm")


def test_a_valid_sweep_passes_every_check_a_run_makes(tmp_path: Path) -> None:
    base = ["train", "--steps", "40", "--run-dir", str(tmp_path / "sweep")]
    made = sweep_check.checked_sweep("optim.lr=1e-3,3e-3 model.layers=1,2", base, devices=8)
    assert len(made.runs) == 4
    cfg = sweep_check.check_run(made.runs[3])
    assert (cfg.optim.lr, cfg.model.layers, cfg.steps, cfg.run_dir) == (3e-3, 2, 40, made.runs[3].run_dir)
    assert not (tmp_path / "sweep").exists(), "a check writes nothing"


def test_a_sweep_with_one_invalid_value_is_one_error_naming_that_run_and_value(tmp_path: Path) -> None:
    base = ["train", "--steps", "40", "--run-dir", str(tmp_path / "sweep")]
    with pytest.raises(ConfigError) as caught:
        sweep_check.checked_sweep("seed=0,1 optim.lr=1e-3,-1,3e-3", base)
    assert str(caught.value) == ("sweep run 'seed=0,lr=-1': --optim.lr: expected a finite learning rate > 0, "
                                 "found -1.0. Fix: pass --optim.lr 3e-3. 1 other run(s) fail too: seed=1,lr=-1")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(("spec", "message"), [
    # the task's own validation (job/tasks/lm/model.py)
    ("model.heads=4,3", "sweep run 'heads=3': --model.heads: expected a divisor of --model.dim=64, found 3"),
    # the parser's own error, its reason kept
    ("optim.lr=abc", "sweep run 'lr=abc': flags: expected flags that python -m job train parses, found \"Error "
                     "parsing --optim.lr: could not convert string to float: 'abc'\""),
    ("steps=10,1.5", "sweep run 'steps=1.5': flags: expected flags that python -m job train parses, found \"Error "
                     "parsing --steps: expected an integer, found '1.5'\""),
    # a config's own check as the parser builds it (DataConfig.__post_init__)
    ("data.global-batch=0", "--data.global-batch: expected an integer >= 1, found 0."),
    ("optim.lrr=1e-3", "sweep run 'lrr=1e-3': SWEEP name 'optim.lrr': expected a config field of the lm task, "
                       "found 'optim.lrr=1e-3'. Fix: did you mean optim.lr?"),
    ("preset=tiny,huge", "sweep run 'preset=huge': --preset: expected one of the lm task's presets"),
    ("rule=fsdp,diagonal", "sweep run 'rule=diagonal': --rule: expected one of replicated"),
])
def test_each_check_a_run_makes_at_its_start_is_made_for_every_run(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        sweep_check.checked_sweep(spec, BASE)
    assert message in str(caught.value)


def test_a_sweep_over_an_optim_flag_a_tasks_own_optimizer_never_reads_is_refused() -> None:
    base = ["train", "--task", "tests.user_tasks.digits:TASK", "--steps", "40", "--run-dir", "runs/digits"]
    with pytest.raises(ConfigError) as caught:
        sweep_check.checked_sweep("optim.lr=1e-3,1e-2", base)
    assert str(caught.value).startswith("sweep run 'lr=1e-3': --optim.lr: expected only --optim.* flags task ")
    assert "1 other run(s) fail too: lr=1e-2" in caught.value.fix
    sweep_check.checked_sweep("seed=0,1", base)  # what the task reads sweeps as before


def test_with_the_device_count_known_the_batch_and_the_model_axis_must_split() -> None:
    with pytest.raises(ConfigError) as caught:
        sweep_check.checked_sweep("data.global-batch=32,12", BASE, devices=8)
    assert str(caught.value) == ("sweep run 'global-batch=12': --data.global-batch: expected a multiple of the "
                                 "data-parallel size 8 = 8, found 12. Fix: use --data.global-batch 16")
    with pytest.raises(ConfigError, match=r"'accum-steps=4': .* size 16 x --accum-steps 4 = 64, found 32"):
        sweep_check.checked_sweep("accum-steps=1,4", BASE, devices=16)
    with pytest.raises(ConfigError, match=r"sweep run 'model-axis=3': --model-axis: expected a divisor of the "
                                          r"job's 8 devices, found 3. Fix: pass --model-axis one of \[1, 2, 4, 8\]"):
        sweep_check.checked_sweep("model-axis=2,3", BASE, devices=8)
    sweep_check.checked_sweep("data.global-batch=32,12", BASE, devices=None)  # not known: not checked
    sweep_check.checked_sweep("model-axis=2 data.global-batch=12", BASE, devices=12)  # 6 data-parallel: 12 splits


def test_python_m_job_sweep_checks_and_lists_the_runs_or_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from job.__main__ import main

    assert main(["sweep", "seed=0,1", "--devices", "2", "--", *BASE]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "sweep runs/sweep1: 2 run(s)"
    assert "runs/sweep1/seed=1: python -m job train --steps 40 --run-dir runs/sweep1/seed=1 --seed 1" in out
    assert "checked 2 run(s): every one parses and validates, and its batch splits over 2 devices" in err
    assert main(["sweep", "seed=0,-1", "--", *BASE]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("error: sweep run 'seed=-1': --seed: expected an integer 0..")
