"""On a real TPU chip: the Pallas kernel against XLA's attention, the GPT-2-small preset's step fitting with
its own batch, a SIGTERM saving within a step and the same command resuming bitwise, a profile's trace; a user's model in its own
package reaching splash through job.kernels, and the same model at the memory's edge surviving its saves."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# float32 model on the chip: splash against XLA's attention (bf16 matmul passes inside both kernels)
LOSS_TOL, GRAD_TOL = 2e-3, 2e-3
SIZES = dict(vocab_size=256, seq_len=512, dim=128, heads=2, mlp_dim=256)
# run in a process of its own, as every test here: this pytest process never holds the chip (conftest.py)
COMPARE = f"""
import json, jax, jax.numpy as jnp
from tests.unit.test_kernels import loss_and_grads
loss_x, grads_x = loss_and_grads("xla", **{SIZES!r})
loss_s, grads_s = loss_and_grads("splash", **{SIZES!r})
worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), grads_x, grads_s)))
print(json.dumps({{"backend": jax.default_backend(), "loss": abs(float(loss_s - loss_x)), "grad": worst}}))
"""


def _train(tmp: Path, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "job", "train", "--run-dir", str(tmp / "run"), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_splash_on_the_chip_gives_xlas_loss_and_gradients() -> None:
    done = subprocess.run([sys.executable, "-c", COMPARE], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["backend"] == "tpu"
    assert found["loss"] < LOSS_TOL and found["grad"] < GRAD_TOL, found


PRESET = ("--preset", "gpt2-small", "--steps", "60", "--eval-every", "1000", "--profile.steps", "30:31")


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One straight run of the preset, read by the preset's test and as the SIGTERM test's reference: a run of
    its own for each cost a process start, a compile and the steps (one sitting holds the whole tier)."""
    tmp = tmp_path_factory.mktemp("straight")
    return tmp, _train(tmp, *PRESET)


def test_the_gpt2_small_preset_trains_at_its_own_batch_with_splash_and_the_remat_that_fits(preset_run) -> None:
    _, done = preset_run
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "attention: splash, blocks of 512 for queries (16, 1024, 12, 64), 12 kv heads" in out


def test_sigterm_saves_within_a_step_says_when_exits_75_and_the_same_command_resumes_bitwise_with_a_profile(
        tmp_path: Path, preset_run) -> None:
    """The signal after step 40's line (the loop waits for a log step's end to print it, and a step takes about
    140 ms): the chip runs step 41 when the signal lands, or is between 40 and 41, and the save is the next step's
    at the latest (42), never one of the steps the host would have dispatched ahead; its line says how long after
    the signal it was written; the summary leaves the slow figures out; the same command resumes and ends bitwise
    where a straight run (the preset's, above) ends."""
    flags = PRESET
    straight_dir, straight = preset_run
    assert straight.returncode == 0, straight.stderr[-4000:]
    proc = subprocess.Popen([sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path / "run"), *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:  # type: ignore[union-attr]
        log.append(line)
        if "step 40/60" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    out = "".join(log) + rest
    assert proc.returncode == 75, out
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 40 <= stopped["final_step"] <= 42 and stopped["params_sha256"] is None, stopped
    assert re.search(rf"preempted: saved step {stopped['final_step']}; exiting with 75 \(requeue\); written "
                     r"\d+\.\d s after this process's signal", out), out
    resumed = _train(tmp_path, *flags)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from step {stopped['final_step']}" in resumed.stdout + resumed.stderr
    ended = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert ended["params_sha256"] == json.loads((straight_dir / "run" / "summary.json").read_text())[
        "params_sha256"]
    traces = list((tmp_path / "run").rglob("*.xplane.pb"))
    assert traces and all(t.stat().st_size > 0 for t in traces)


def test_an_out_of_memory_is_one_error_with_the_bytes_and_a_fix_that_trains(tmp_path: Path) -> None:
    """XLA's attention and no remat over the scanned stack need ~28 GiB a chip at the preset's batch (unrolled,
    XLA frees each layer's scores in time and it fits): one error, then its fix trains."""
    flags = ("--preset", "gpt2-small", "--model.attention", "xla", "--model.scan", "--steps", "2")
    failed = _train(tmp_path / "over", *flags, "--model.remat", "none")
    out = failed.stdout + failed.stderr
    assert failed.returncode == 2, out[-4000:]
    assert "Traceback" not in out and "GiB per device" in out and "--model.remat" in out
    fixed = _train(tmp_path / "fits", *flags, "--model.remat", "dots")
    assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-4000:]


USER = ("--preset", "gpt2-small-size", "--eval-every", "1000")


def test_a_users_model_after_the_documented_lines_reaches_splash_with_its_grouped_heads_and_trains(
        tmp_path: Path) -> None:
    done = _train(tmp_path, "--task", "tests.user_tasks.llama_fast:TASK", *USER, "--steps", "3")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    # the preset's --accum-steps 2: micro-batches of 8; 12 query heads over 4 kv heads, read in place
    assert "attention: splash, blocks of 512 for queries (8, 1024, 12, 64), 4 kv heads" in out


def test_a_users_model_at_the_memorys_edge_survives_its_saves_and_resumes(tmp_path: Path) -> None:
    """Batch 8 without remat: the step takes 15.51 GiB of the chip's 15.75. A save copies the state from its live
    arrays to the host and holds no device memory, so the next step's program always loads: all 5 saves are kept,
    and the run resumes from the last. The model does not read remat `auto`: its one program runs, though over 90%
    of the chip (job/train/remat_auto.py)."""
    flags = ("--task", "tests.user_tasks.llama:TASK", *USER, "--data.global-batch", "8", "--model.no-remat",
             "--ckpt.every", "10", "--ckpt.keep", "5")
    first = _train(tmp_path, *flags, "--steps", "50")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "RuntimeProgramAllocationFailure" not in out
    assert re.search(r"remat auto: none \(1[45]\.\d\d GiB per device of 15\.75 GiB\)", out), out[-4000:]
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [
        10, 20, 30, 40, 50]
    resumed = _train(tmp_path, *flags, "--steps", "55")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert "resumed from step 50" in resumed.stdout + resumed.stderr
