"""A newcomer's first hour, end to end, with a task in a package of the user's own (outside job/, on PYTHONPATH):
trained tensor-parallel on 2 x 2, stopped with Ctrl-C, resumed by the same command to an uninterrupted run's
parameters, evaluated on one process of one device, its package named in the provenance; its per-process logs
in RUN_DIR/logs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launching import ROOT, child_env, explain, launcher_argv, run, train, wait_for_line
from tests.records import records, summary

pytestmark = pytest.mark.multiprocess

# written as docs/training.md "Write your own task" and docs/your-model.md write one
USER_TASK = '''
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import job.task
    from job.random import row_bits, uniform
    from job.task import SPLITS


    @dataclasses.dataclass(frozen=True)
    class ModelConfig:
        features: int = 8
        hidden: int = 32


    @dataclasses.dataclass(frozen=True)
    class DataConfig:
        global_batch: int = 16
        eval_batches: int = 1


    class MLP(nnx.Module):
        def __init__(self, cfg, *, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(cfg.features, cfg.hidden, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
            self.down = nnx.Linear(cfg.hidden, 1, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", None)))

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))[:, 0]


    def loss(model, batch):
        error = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return error, {"loss": error}


    class Rows:
        def __init__(self, features):
            self.features = features

        def rows(self, split, step, start, stop):
            bits = row_bits(0, SPLITS.index(split), step, start, stop, self.features)
            x = (2 * uniform(bits) - 1).astype(np.float32)
            return {"x": x, "y": np.sin(x).sum(axis=1)}


    TASK = job.task.Task(name="mine", model_config=ModelConfig, data_config=DataConfig,
                         build=lambda cfg, rngs: MLP(cfg, rngs=rngs), loss=loss,
                         source=lambda data_cfg, model_cfg: Rows(model_cfg.features))
'''


def test_a_users_own_package_trains_tensor_parallel_stops_on_ctrl_c_resumes_bitwise_and_evaluates_on_one_device(
        tmp_path: Path) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tasks.py").write_text(textwrap.dedent(USER_TASK))
    user = {"PYTHONPATH": str(tmp_path)}
    flags = ("--task", "mypkg.tasks:TASK", "--rule", "tensor", "--model-axis", "2", "--steps", "3000",
             "--optim.decay-steps", "3000", "--ckpt.every", "1000", "--eval-every", "1000", "--log-every", "2")
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    command = [sys.executable, "-m", "job", "train", "--run-dir", str(run_dir), *flags]
    proc = subprocess.Popen(launcher_argv(2, command, devices=2), env=child_env(**user), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = wait_for_line(proc, "step 6/3000", timeout=180)
    os.kill(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
    out, _ = proc.communicate(timeout=120)
    output = "".join(seen) + out
    assert proc.returncode == 130 and "Traceback" not in output, output
    stopped = int(re.search(r"stopped \(Ctrl-C\): saved step (\d+); exiting with 130", output).group(1))

    end = ("--steps", str(stopped + 4))
    train(2, 2, reference, *flags, *end, **user)
    resumed = train(2, 2, run_dir, *flags, *end, **user)
    assert f"resumed from step {stopped}" in resumed.stderr, explain(resumed)
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]

    evaluated = run(launcher_argv(1, [sys.executable, "-m", "job", "eval", "--run-dir", str(run_dir)], devices=1),
                    timeout=300, **user)
    assert evaluated.returncode == 0, explain(evaluated)
    final = [r for r in records(run_dir) if r["split"] == "eval"][-1]
    written = json.loads((run_dir / f"eval-{stopped + 4}.json").read_text())["splits"]["eval"]
    assert written["loss"] == pytest.approx(final["loss"], rel=1e-5)

    task = json.loads((run_dir / "provenance.json").read_text())["attempts"][-1]["task"]
    assert (task["spec"], task["package"], task["file"]) == ("mypkg.tasks:TASK", "mypkg",
                                                             str(tmp_path / "mypkg" / "tasks.py")), task
    for process in (0, 1):  # both attempts of each process in its own file, and the evaluation's process 0 in its
        log = (run_dir / "logs" / f"process-{process}.log").read_text()
        assert log.count(f"process {process} (pid ") == 2 + (process == 0), log
        assert f"process {process} of 2 (local)" in log, log
        assert (" eval --run-dir " in log.split("\n--- ")[-1].partition("\n")[0]) == (process == 0), log
