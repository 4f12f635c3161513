"""A state too big for one device: created as its shards, trained alike under every rule, accumulated
over micro-batches, resumed on other topologies, and a user's own model (dropout, its own optimizer,
axis name, extra state and train step, an EMA) from outside the package under fsdp and tensor, and a mesh
axis a user's task declares (tests/user_tasks/own_axis.py), and the one warning about a model without
annotations (tests/user_tasks/normed.py).

Each run goes through tests/scenarios/held.py, which records on every process the shape of the
shards it holds right after the state was created and right after it was restored."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.launching import explain, launcher_argv, run, scenario
from tests.multiprocess.test_train import SMALL
from tests.records import COMPILER_LOG, involuntary_rematerializations, records, summary, train_losses

pytestmark = pytest.mark.multiprocess

STEPS = 30
COMPILED = ("--compile-cache", "none")  # every step compiled afresh: the compiler's log is there to read
FLAGS = ("--steps", str(STEPS), "--log-every", "1", "--eval-every", str(STEPS), "--ckpt.every", "15", *SMALL)
RULES = {  # rule flags -> {leaf: the shape each process holds of it}; the model is 32 wide, its mlp 64
    "replicated": ((), (32, 32), (64, 32)),
    "fsdp": (("--rule", "fsdp"), (8, 32), (64, 8)),  # "embed" over data = 4
    "tensor": (("--rule", "tensor", "--model-axis", "2"), (32, 16), (32, 32)),  # heads, mlp over model = 2
    "fsdp_tensor": (("--rule", "fsdp_tensor", "--model-axis", "2"), (16, 16), (32, 16)),
}
# the scanned LM's stacked kernels: a leading "layers" dimension (1 layer here), kept whole by every rule
Q = "blocks/attn/q/kernel/value"  # ("layers", "embed", "heads"), 1 x 32 x 32
DOWN = "blocks/mlp/down/kernel/value"  # ("layers", "mlp", "embed"), 1 x 64 x 32


def held_train(n: int, devices: int, run_dir: Path, *flags: str) -> str:
    """`python -m job train` on n x devices through held.py; its output (every rank's, XLA's warnings among it)."""
    argv = launcher_argv(n, scenario("held.py", "train", "--run-dir", str(run_dir), *flags), devices=devices)
    proc = run(argv, timeout=300, **COMPILER_LOG)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    return proc.stdout + proc.stderr


def held_shapes(run_dir: Path, n: int) -> list[dict]:
    """What held.py recorded on each of n processes: the shapes of the shards it held."""
    return [json.loads((run_dir / f"held-{rank}.json").read_text()) for rank in range(n)]


def assert_held(records: list[dict], moment: str, q: tuple[int, int], down: tuple[int, int]) -> None:
    """On every process: the shards of two kernels, in the model and in both Adam moments, have the
    rule's shape."""
    for rank, record in enumerate(records):
        shapes = record[moment]["shapes"]
        for leaf, whole, part in ((Q, [1, 32, 32], (1, *q)), (DOWN, [1, 64, 32], (1, *down))):
            found = {path: shape for path, shape in shapes.items() if path.endswith(leaf)}
            assert sorted(found) == ["model/" + leaf, *(f"optimizer/opt_state/1/0/{m}/{leaf}" for m in ("mu", "nu"))]
            assert all(shape == [whole, list(part)] for shape in found.values()), (rank, moment, found)


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The LM trained 30 steps on 2 processes x 2 devices under each rule, compiled afresh: {rule: (run dir,
    output)}."""
    root = tmp_path_factory.mktemp("rules")
    return {rule: (root / rule, held_train(2, 2, root / rule, *FLAGS, *flags, *COMPILED))
            for rule, (flags, _, _) in RULES.items()}


@pytest.mark.parametrize("rule", list(RULES))
def test_the_lm_state_is_created_as_its_shards_and_trains_alike_under_every_rule(
        rule: str, lm_runs: dict[str, tuple[Path, str]]) -> None:
    run_dir, output = lm_runs[rule]
    _, q, down = RULES[rule]
    assert_held(held_shapes(run_dir, 2), "init", q, down)
    assert "experimental" not in output and "fell back" not in output, output  # first-class: no warning
    # one layout for each activation: XLA never replicates one whole to go between two, on either process
    assert involuntary_rematerializations(output, 2) == {0: [], 1: []}, output
    reference = train_losses(lm_runs["replicated"][0])
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (rule, step)
    assert summary(run_dir)["completed"] is True


@pytest.mark.parametrize(("n", "devices"), [(4, 1), (1, 4)])
def test_an_fsdp_run_resumes_on_another_topology_with_the_losses_of_one_uninterrupted(
        n: int, devices: int, lm_runs: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    straight = lm_runs["fsdp"][0]
    shutil.copytree(straight, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(STEPS))  # as if stopped after the save at step 15
    for copied in [tmp_path / "run" / "metrics.jsonl", *(tmp_path / "run").glob("held-*.json")]:
        copied.unlink()
    output = held_train(n, devices, tmp_path / "run", *FLAGS, "--rule", "fsdp")
    assert "resumed from step 15" in output
    held = held_shapes(tmp_path / "run", n)
    assert all(record["restore"]["step"] == 15 and "init" not in record for record in held)
    assert_held(held, "restore", (8, 32), (64, 8))  # "embed" over data = 4 on either topology
    resumed, reference = train_losses(tmp_path / "run"), train_losses(straight)
    assert sorted(resumed) == list(range(16, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def test_gradient_accumulation_gives_the_losses_of_the_whole_batch(
        lm_runs: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    held_train(2, 2, tmp_path, *FLAGS, "--rule", "fsdp", "--accum-steps", "4")  # 32 rows: 4 x 8, 2 per device
    reference, accumulated = train_losses(lm_runs["fsdp"][0]), train_losses(tmp_path)
    assert sorted(accumulated) == sorted(reference)
    for step, loss in reference.items():
        assert accumulated[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_a_global_batch_that_micro_batches_cannot_split_over_the_data_shards_is_refused(tmp_path: Path) -> None:
    # 32 rows in 16 micro-batches is 2 rows each, fewer than the 4 data shards (the mesh has 4 on "data")
    proc = run(launcher_argv(2, [sys.executable, "-m", "job", "train", "--run-dir", str(tmp_path), *FLAGS,
                                 "--accum-steps", "16"], devices=2), timeout=300)
    assert proc.returncode == 2, explain(proc, proc.stdout, proc.stderr)
    assert "--data.global-batch: expected a multiple of the data-parallel size 4 x --accum-steps 16 = 64" in proc.stdout + proc.stderr
    # no step saved (a process the launcher stopped in its preflight may leave its hidden probe file there)
    assert sorted((tmp_path / "checkpoints").glob("[0-9]*")) == []


USER = ("--task", "tests.user_tasks.minigpt:TASK", "--log-every", "1", "--eval-every", "6", "--ema.decay", "0.9")


def test_a_users_dropout_model_with_its_own_optimizer_axis_state_and_step_trains_under_fsdp(tmp_path: Path) -> None:
    output = held_train(2, 2, tmp_path, *USER, "--steps", "12", "--rule", "fsdp")
    assert "fell back" not in output, output
    losses = train_losses(tmp_path)
    assert losses[12] < 0.85 * losses[1], losses  # it learns its counting sequences
    for record in held_shapes(tmp_path, 2):  # "embed" (32) over data = 4, its own "hidden" kept whole under fsdp
        shapes = record["init"]["shapes"]
        assert shapes["model/blocks/0/qkv/kernel/value"] == shapes["ema/model/blocks/0/qkv/kernel/value"]
        assert shapes["model/blocks/0/qkv/kernel/value"] == [[32, 96], [8, 96]]
        assert shapes["model/blocks/0/dropout1/rngs/key/value"] == [[], []]
        assert shapes["seen/rows/value"] == [[], []]
    rows_seen = [r["rows_seen"] for r in records(tmp_path) if r["split"] == "train"]
    assert rows_seen == [8.0 * step for step in range(1, 13)]  # its own step, on its own state
    evals = [r for r in records(tmp_path) if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [6, 12] and all("ema_loss" in r for r in evals)
    assert evals[0]["ema_loss"] != evals[0]["loss"]  # the average lags the trained parameters
    assert summary(tmp_path)["eval_ema_loss"] == evals[-1]["ema_loss"]


def test_a_users_dropout_model_resumes_bitwise_under_tensor_parallelism(tmp_path: Path) -> None:
    flags = (*USER, "--rule", "tensor", "--model-axis", "2")
    held_train(2, 2, tmp_path / "straight", *flags, "--steps", "12")
    for record in held_shapes(tmp_path / "straight", 2):  # its own "hidden" over model = 2
        assert record["init"]["shapes"]["model/blocks/0/qkv/kernel/value"] == [[32, 96], [32, 48]]
    held_train(2, 2, tmp_path / "resumed", *flags, "--steps", "6")
    output = held_train(2, 2, tmp_path / "resumed", *flags, "--steps", "12")
    assert "resumed from step 6" in output
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert [resumed[s] for s in range(7, 13)] == [straight[s] for s in range(7, 13)]  # the same dropout masks
    assert summary(tmp_path / "resumed")["params_sha256"] == summary(tmp_path / "straight")["params_sha256"]
    assert summary(tmp_path / "resumed")["eval_ema_loss"] == summary(tmp_path / "straight")["eval_ema_loss"]
    last = [r for r in records(tmp_path / "resumed") if r["split"] == "train"][-1]
    assert last["rows_seen"] == 96.0  # its extra state came back with the rest


def test_a_mesh_axis_a_users_task_declares_splits_what_the_task_maps_to_it(tmp_path: Path) -> None:
    output = held_train(2, 2, tmp_path, "--task", "tests.user_tasks.own_axis:TASK", "--steps", "2", "--log-every", "1",
                        "--eval-every", "2", "--mesh", "data=2,width=2", "--rule", "tensor")
    assert "fell back" not in output and "mesh {'data': 2, 'width': 2}; rule tensor" in output, output
    for record in held_shapes(tmp_path, 2):  # its "hidden" over its own axis, width = 2, on every process
        assert record["init"]["shapes"]["model/blocks/0/qkv/kernel/value"] == [[32, 96], [32, 48]]


def test_a_users_layer_norm_without_annotations_under_fsdp_gets_one_warning_showing_its_argument(
        tmp_path: Path) -> None:
    output = held_train(2, 2, tmp_path, "--task", "tests.user_tasks.normed:TASK", "--steps", "1", "--rule", "fsdp")
    lines = output.splitlines()
    [start] = [i for i, line in enumerate(lines) if "fell back" in line]  # one warning, from process 0 alone
    assert lines[start].startswith("[rank 0] job.train.state:0: UserWarning: --rule fsdp: 6 variable(s) fell back "
                                   "to replicated on the mesh {'data': 4, 'model': 1}:"), lines[start]
    warning = [line.removeprefix("[rank 0] ") for line in lines[start:start + 10]]
    assert warning[1:9] == [
        '- 1 norm scale(s) without an annotation (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm): '
        'scale_metadata=job.sharding.axes("embed")',
        "    model/norm/scale",
        '- 1 norm bias(es) without an annotation (nnx.LayerNorm, nnx.BatchNorm): '
        'bias_metadata=job.sharding.axes("embed")',
        "    model/norm/bias",
        '- 2 kernel(s) without an annotation (nnx.Linear; an nnx.Conv\'s is axes(None, None, "embed", "mlp")): '
        'kernel_metadata=job.sharding.axes("embed", "mlp")',
        "    model/hidden/kernel, model/out/kernel",
        '- 2 bias(es) without an annotation (nnx.Linear, nnx.Conv): bias_metadata=job.sharding.axes("mlp") (the name '
        "of its kernel's last dimension)",
        "    model/hidden/bias, model/out/bias"], warning
    assert warning[9].startswith("Fix: annotate where the layer is built"), warning
    assert "warn_on_process_zero(" not in output and "warnings.warn" not in output, output  # no Python source line
