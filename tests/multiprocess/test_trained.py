"""After training: `python -m job eval` of a checkpoint on this and another topology, the model loaded on
one host without its optimizer (`job.train.trained.load_model`, EMA included), `python -m job export`, and the
LM's `python -m job sample`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launching import explain, launcher_argv, run, train
from tests.multiprocess.test_train import SMALL
from tests.records import records, summary

pytestmark = pytest.mark.multiprocess

FLAGS = ("--steps", "6", "--log-every", "3", "--eval-every", "6", "--rule", "fsdp", "--ema.decay", "0.9", *SMALL)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(2, 2, run_dir, *FLAGS)
    return run_dir


def final_eval(run_dir: Path) -> dict:
    return [r for r in records(run_dir) if r["split"] == "eval"][-1]


@pytest.mark.parametrize(("n", "devices"), [(2, 2), (1, 1)])
def test_eval_of_a_checkpoint_gives_the_runs_own_final_eval_on_any_topology(
        trained_run: Path, n: int, devices: int) -> None:
    proc = run(launcher_argv(n, [sys.executable, "-m", "job", "eval", "--run-dir", str(trained_run)],
                             devices=devices), timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    record = json.loads((trained_run / "eval-6.json").read_text())
    expected = final_eval(trained_run)
    assert record["step"] == 6 and list(record["splits"]) == ["eval"]  # the LM's one split
    written = record["splits"]["eval"]
    assert written["batches"] == 2 and written["rows"] == 2 * 32  # --data.eval-batches 2 of its endless split
    assert sorted(k for k in written if k not in ("batches", "rows")) == sorted(
        k for k in expected if k not in ("step", "split"))
    tolerance = 1e-6 if (n, devices) == (2, 2) else 1e-5  # the same topology: the same arithmetic
    for name in ("loss", "accuracy", "ema_loss", "ema_accuracy"):
        assert written[name] == pytest.approx(expected[name], rel=tolerance, abs=1e-7), name


def test_eval_of_a_step_never_saved_is_one_clear_error(trained_run: Path) -> None:
    proc = run(launcher_argv(1, [sys.executable, "-m", "job", "eval", "--run-dir", str(trained_run), "--step", "5"],
                             devices=1), timeout=300)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert "--step: expected a saved step of" in proc.stderr and "found 5" in proc.stderr


def test_the_trained_model_loads_on_one_host_without_its_optimizer_and_exports(
        trained_run: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import json, sys
        import jax.numpy as jnp
        import orbax.checkpoint as ocp
        from flax import nnx
        from job.train import trained
        from job.parallel.fingerprint import fingerprint
        model, cfg = trained.load_model({str(trained_run)!r})
        ema, _ = trained.load_model({str(trained_run)!r}, ema=True)
        exported = ocp.StandardCheckpointer().restore({str(tmp_path / "out")!r})
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
            __import__("jax").tree.leaves(exported), __import__("jax").tree.leaves(nnx.state(model))))
        print(json.dumps({{"sha": fingerprint(nnx.state(model, nnx.Param)), "steps": cfg.steps,
                          "rule": cfg.rule,
                          "logits": list(model(jnp.zeros((1, 8), jnp.int32)).shape),
                          "ema_differs": bool(jnp.any(ema.head.kernel.get_value() != model.head.kernel.get_value())),
                          "exported_equal": same}}))
    """)
    export = subprocess.run([sys.executable, "-m", "job", "export", "--run-dir", str(trained_run),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stdout + export.stderr
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["sha"] == summary(trained_run)["params_sha256"]  # the very parameters the run trained
    assert (loaded["steps"], loaded["rule"], loaded["logits"]) == (6, "fsdp", [1, 8, 32])
    assert loaded["ema_differs"] and loaded["exported_equal"]
    assert json.loads((tmp_path / "out.config.json").read_text())["ema"]["decay"] == 0.9


def test_the_lm_samples_from_its_trained_checkpoint(trained_run: Path) -> None:
    def sample(*flags: str) -> list[int]:
        proc = subprocess.run([sys.executable, "-m", "job", "sample", "--task", "lm", "--run-dir", str(trained_run),
                               "--prompt", "1 5 6 7", "--tokens", "10", *flags], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [int(t) for t in proc.stdout.split()]

    greedy = sample("--top-k", "1")
    assert greedy[:4] == [1, 5, 6, 7] and len(greedy) == 14 and all(0 <= t < 32 for t in greedy)
    assert sample("--top-k", "1") == greedy  # greedy is deterministic
    assert len(sample("--top-k", "4", "--seed", "3", "--ema")) == 14


@pytest.fixture(scope="module")
def tensor_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("tensor") / "run"
    train(2, 2, run_dir, "--steps", "4", "--log-every", "2", "--eval-every", "4", "--rule", "tensor",
          "--model-axis", "2", *SMALL)
    return run_dir


@pytest.mark.parametrize(("n", "devices"), [(1, 1), (1, 3)])
def test_a_tensor_parallel_run_is_evaluated_and_sampled_on_devices_its_model_axis_does_not_divide(
        tensor_run: Path, n: int, devices: int) -> None:
    proc = run(launcher_argv(n, [sys.executable, "-m", "job", "eval", "--run-dir", str(tensor_run)],
                             devices=devices), timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    assert (f"the run's --model-axis 2 does not fit this job's {devices} device(s): evaluating with a model axis "
            "of 1") in proc.stderr
    written, expected = json.loads((tensor_run / "eval-4.json").read_text())["splits"]["eval"], final_eval(tensor_run)
    assert written["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    sampled = subprocess.run([sys.executable, "-m", "job", "sample", "--task", "lm", "--run-dir", str(tensor_run),
                              "--prompt", "1 5", "--tokens", "3"], capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0 and len(sampled.stdout.split()) == 5, sampled.stdout + sampled.stderr


def test_eval_on_three_processes_of_a_two_by_two_fsdp_tensor_run_says_its_fallbacks_in_one_line(
        tmp_path: Path) -> None:
    """Three devices split none of the model's widths: the run's warning listed every variable, optimizer state
    included; the evaluation reads no optimizer state, counts what it reads in one line and lists it in process
    0's log file, and every process's output goes to its own file as a run's does."""
    run_dir = tmp_path / "run"
    train(2, 2, run_dir, "--steps", "2", "--log-every", "1", "--eval-every", "2", "--rule", "fsdp_tensor",
          "--mesh", "data=2,model=2", *SMALL)
    proc = run(launcher_argv(3, [sys.executable, "-m", "job", "eval", "--run-dir", str(run_dir)], devices=1),
               timeout=300)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "fell back" in line]
    assert len(said) == 1 and said[0].startswith("[rank 0]"), said
    assert "variable(s) the evaluation reads fell back to replicated under --rule fsdp_tensor" in said[0], said
    assert "optimizer/" not in said[0] and f"the list in {run_dir / 'logs' / 'process-0.log'}" in said[0], said
    count = int(said[0].split("UserWarning: ")[1].split()[0])
    for rank in range(3):  # each process's evaluation appended to its own file, after the run's
        evaluation = (run_dir / "logs" / f"process-{rank}.log").read_text().split("\n--- ")[-1]  # its last part
        assert evaluation.partition("\n")[0].endswith(f"eval --run-dir {run_dir}"), evaluation
        assert ("eval of step 2 on eval: " in evaluation) == (rank == 0), evaluation  # process 0 logs
        listed = [line for line in evaluation.splitlines() if line.startswith("  model/")]
        assert len(listed) == (count if rank == 0 else 0), evaluation
        assert "optimizer/" not in evaluation, evaluation


def test_a_model_axis_that_does_not_divide_the_devices_names_the_users_flag_in_train_and_eval(
        tensor_run: Path, tmp_path: Path) -> None:
    proc = run(launcher_argv(1, [sys.executable, "-m", "job", "eval", "--run-dir", str(tensor_run),
                                 "--model-axis", "3"], devices=2), timeout=300)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert ("--model-axis: expected a positive divisor of the device count 2, found 3. Fix: pass --model-axis one "
            "of [1, 2]") in proc.stderr and "make_mesh" not in proc.stderr
    trained = train(2, 2, tmp_path, "--steps", "2", "--model-axis", "3", expect=2)
    assert "--model-axis: expected a positive divisor of the device count 4, found 3. Fix: pass --model-axis one " \
           "of [1, 2, 4]" in trained.stderr and "make_mesh" not in trained.stderr
