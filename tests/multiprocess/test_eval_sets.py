"""Eval sets: a user's batch-norm and dropout classifier (tests/user_tasks/digits.py, started from the
user's own entry point, outside job/) declares two finite held-out splits whose sizes are no multiple
of the batch or of the data shards. Under every sharding rule on 2 processes x 2 devices each
evaluation is one full pass over each split, equal to the trained model evaluated on all of that
split's rows at once, and each split is reported under its own name in metrics.jsonl, TensorBoard
and the summary; `python -m job eval` on one device gives the same figures from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.events import scalars
from tests.launching import ROOT, child_env, explain, launcher_argv, run
from tests.records import records, summary

pytestmark = pytest.mark.multiprocess

ENTRY = [sys.executable, "-m", "tests.user_tasks.train_digits"]  # the user's script: no --task
FLAGS = ("--steps", "20", "--eval-every", "10", "--log-every", "10", "--ckpt.every", "20")
RULES = {"replicated": (), "fsdp": ("--rule", "fsdp"), "tensor": ("--rule", "tensor", "--model-axis", "2"),
         "fsdp_tensor": ("--rule", "fsdp_tensor", "--model-axis", "2")}
SPLITS = {"eval": 50, "test": 37}  # rows: 3 x 16 + 2 and 2 x 16 + 5, neither a multiple of 4 data shards


def whole_split_metrics(run_dirs: list[Path]) -> list[dict]:
    """Each run's trained model (job.train.trained.load_model) on every row of each split as one batch."""
    script = textwrap.dedent(f"""
        import json, sys
        from job.train.trained import load_model
        from tests.user_tasks import digits
        out = []
        for run_dir in {[str(d) for d in run_dirs]!r}:
            model, cfg = load_model(run_dir)
            out.append({{split: {{k: float(v) for k, v in digits.loss(model, digits.full_split(cfg.data, cfg.model,
                        split))[1].items()}} for split in {list(SPLITS)!r}}})
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The user's classifier trained 20 steps on 2 processes x 2 devices under each rule: {rule: (run dir, output)}."""
    root = tmp_path_factory.mktemp("eval-sets")
    out = {}
    for rule, flags in RULES.items():
        proc = run(launcher_argv(2, [*ENTRY, "--run-dir", str(root / rule), *FLAGS, *flags], devices=2), timeout=300)
        assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
        out[rule] = (root / rule, proc.stdout + proc.stderr)
    return out


def test_every_split_is_one_full_pass_equal_to_the_model_on_all_its_rows_under_every_rule(
        digits_runs: dict[str, tuple[Path, str]]) -> None:
    expected = whole_split_metrics([run_dir for run_dir, _ in digits_runs.values()])
    for (rule, (run_dir, output)), reference in zip(digits_runs.items(), expected):
        assert "fell back" not in output, (rule, output)  # its annotations fit every rule
        assert "eval split eval: 50 rows in 4 batches" in output and "eval split test: 37 rows in" in output
        result = summary(run_dir)
        assert result["task"] == "digits" and result["completed"] is True, result
        for split in SPLITS:
            for name in ("loss", "accuracy"):  # the mean over every row: no row padded, none seen twice
                assert result[f"{split}_{name}"] == pytest.approx(reference[split][name], rel=1e-5, abs=1e-6), (
                    rule, split, name)
        assert result["eval_accuracy"] >= 0.8, result  # it learned its clusters
        for split in SPLITS:  # each split under its own name, at each evaluation
            assert [r["step"] for r in records(run_dir) if r["split"] == split] == [10, 20], rule
        tags = scalars(run_dir)
        assert [s for s, _ in tags["eval/loss"]] == [10, 20] and [s for s, _ in tags["test/accuracy"]] == [10, 20]
        assert tags["test/loss"][-1][1] == pytest.approx(result["test_loss"], rel=1e-6)


def test_the_rules_train_alike(digits_runs: dict[str, tuple[Path, str]]) -> None:
    losses = {rule: [r["loss"] for r in records(run_dir) if r["split"] == "train"]
              for rule, (run_dir, _) in digits_runs.items()}
    for rule, values in losses.items():  # the same dropout masks and batch statistics on every layout
        assert values == pytest.approx(losses["replicated"], rel=1e-4), rule


def test_eval_of_the_checkpoint_on_one_device_gives_the_runs_figures(digits_runs: dict[str, tuple[Path, str]]) -> None:
    run_dir = digits_runs["fsdp"][0]
    proc = run(launcher_argv(1, [sys.executable, "-m", "job", "eval", "--run-dir", str(run_dir)], devices=1),
               timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    written = json.loads((run_dir / "eval-20.json").read_text())
    result = summary(run_dir)
    assert written["step"] == 20 and sorted(written["splits"]) == sorted(SPLITS)
    for split, rows in SPLITS.items():  # one device: the batches of 16 and one last partial batch
        assert written["splits"][split]["rows"] == rows
        assert written["splits"][split]["batches"] == -(-rows // 16)
        for name in ("loss", "accuracy"):
            assert written["splits"][split][name] == pytest.approx(result[f"{split}_{name}"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("rule", list(RULES))
def test_the_users_task_saves_and_resumes_bitwise_under_every_rule(
        rule: str, digits_runs: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    # stopped by its checkpoint at step 10, then resumed to 20: the same dropout keys, batch statistics
    # and Adam moments come back, so the parameters and every split's figures are the uninterrupted run's
    flags = (*FLAGS, *RULES[rule])
    for steps in ("10", "20"):
        argv = [*ENTRY, "--run-dir", str(tmp_path), *flags, "--steps", steps]
        proc = run(launcher_argv(2, argv, devices=2), timeout=300)
        assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert "resumed from step 10" in proc.stderr
    straight, resumed = summary(digits_runs[rule][0]), summary(tmp_path)
    assert resumed["params_sha256"] == straight["params_sha256"], rule
    for name in ("train_loss", "eval_loss", "eval_accuracy", "test_loss", "test_accuracy"):
        assert resumed[name] == straight[name], (rule, name)
