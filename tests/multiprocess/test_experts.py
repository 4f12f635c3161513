"""Expert parallelism on 2 processes x 2 devices: a user's mixture of experts (tests/user_tasks/moe.py) trained
on meshes with an "expert" axis under fsdp and fsdp_tensor, and under tensor on the default mesh, with every
variable split as annotated; its expert kernels split over "expert" in the checkpoint; the losses of plain
fsdp; a bitwise resume; and a checkpoint saved on one mesh resumed on another."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launching import train
from tests.records import records, summary, train_losses

pytestmark = pytest.mark.multiprocess

STEPS, SAVED = 8, 4
TASK = ("--task", "tests.user_tasks.moe:TASK", "--log-every", "1", "--eval-every", str(STEPS),
        "--ckpt.every", str(SAVED))
EXPERT_MESH = ("--mesh", "data=2,expert=2")
LAYOUTS = {  # name -> flags; "fsdp" on the default mesh (data=4, no expert axis) is the reference
    "expert_fsdp": (*EXPERT_MESH, "--rule", "fsdp"),
    "expert_fsdp_tensor": ("--mesh", "data=1,expert=2,model=2", "--rule", "fsdp_tensor"),
    "tensor": ("--rule", "tensor", "--model-axis", "2"),
    "fsdp": ("--rule", "fsdp"),
}
EXPERT_KERNELS = ("moe.wi.value", "moe.wo.value")  # ("experts", "embed", "mlp"), ("experts", "mlp", "embed")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, str]]:
    """layout -> (its run dir, its output): the MoE trained STEPS steps under LAYOUTS[layout], once per module."""
    root = tmp_path_factory.mktemp("experts")
    done: dict[str, tuple[Path, str]] = {}

    def get(layout: str) -> tuple[Path, str]:
        if layout not in done:
            proc = train(2, 2, root / layout, *TASK, "--steps", str(STEPS), *LAYOUTS[layout])
            done[layout] = (root / layout, proc.stdout + proc.stderr)
        return done[layout]

    return get


def saved_specs(run_dir: Path, step: int) -> dict[str, list]:
    """{"model.moe.wi.value": partition spec, ...} of every leaf of a checkpoint, as orbax recorded them, over
    the mesh axes of size > 1 (an axis of size 1 splits nothing, and a copy of the state may leave it out)."""
    shardings = json.loads((run_dir / "checkpoints" / str(step) / "default" / "_sharding").read_text())
    specs = {}
    for key, value in shardings.items():
        record = json.loads(value)
        sizes = dict(zip(record["axis_names"], record["shape"], strict=True))
        spec = [None if entry is None or sizes[entry] == 1 else entry for entry in record["partition_spec"]]
        while spec and spec[-1] is None:
            spec.pop()
        specs[base64.b64decode(key).decode()] = spec
    return specs


def assert_losses_agree(losses: dict[int, float], reference: dict[int, float], steps: range, what: str) -> None:
    """Each step's loss within 1e-4 relative of the reference run's."""
    for step in steps:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), (what, step, losses, reference)


@pytest.mark.parametrize("layout", ["expert_fsdp", "expert_fsdp_tensor", "tensor"])
def test_the_moe_trains_with_every_variable_split_as_annotated_and_the_losses_of_plain_fsdp(
        layout: str, trained: Callable[[str], tuple[Path, str]]) -> None:
    run_dir, output = trained(layout)
    assert "fell back to replicated" not in output and "Involuntary" not in output, output
    result = summary(run_dir)
    assert result["completed"] is True and result["parameters"] == 2656, result
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < 0.6 * losses[1], losses  # it learns
    assert_losses_agree(losses, train_losses(trained("fsdp")[0]), range(1, STEPS + 1), layout)
    step = next(r for r in records(run_dir) if r["split"] == "train" and r["step"] == STEPS)
    # the load-balancing loss is reported and added to the loss with its weight (--model.balance-weight 0.01)
    assert step["loss"] == pytest.approx(step["xent"] + 0.01 * step["balance"], rel=1e-6) and step["balance"] > 0.5
    assert 0.0 <= step["dropped"] < 0.5, step  # the assignments past an expert's capacity


def test_the_expert_kernels_and_their_adam_moments_are_split_over_the_expert_axis_in_the_checkpoint(
        trained: Callable[[str], tuple[Path, str]]) -> None:
    expected = {  # layout -> (wi's spec, wo's spec)
        "expert_fsdp": (["expert", "data"], ["expert", None, "data"]),  # embed over data under fsdp
        "expert_fsdp_tensor": (["expert", None, "model"], ["expert", "model"]),  # its data axis is of size 1
        "tensor": ([None, None, "model"], [None, "model"]),  # the default mesh has no expert axis: experts whole
    }
    for layout, specs in expected.items():
        found = saved_specs(trained(layout)[0], STEPS)
        for kernel, spec in zip(EXPERT_KERNELS, specs, strict=True):
            for leaf in (f"model.{kernel}", f"optimizer.opt_state.0.mu.{kernel}", f"optimizer.opt_state.0.nu.{kernel}"):
                assert found[leaf] == spec, (layout, leaf, found)
        assert found["model.moe.router.kernel.value"] == (["data"] if layout == "expert_fsdp" else []), found


def test_a_stop_and_resume_on_an_expert_mesh_is_bitwise_the_straight_run(
        tmp_path: Path, trained: Callable[[str], tuple[Path, str]]) -> None:
    straight = summary(trained("expert_fsdp")[0])
    train(2, 2, tmp_path, *TASK, "--steps", str(SAVED), *LAYOUTS["expert_fsdp"])
    resumed = train(2, 2, tmp_path, *TASK, "--steps", str(STEPS), *LAYOUTS["expert_fsdp"])
    assert f"resumed from step {SAVED}" in resumed.stderr
    assert summary(tmp_path)["params_sha256"] == straight["params_sha256"]


def test_a_checkpoint_saved_on_one_mesh_resumes_on_another_and_its_losses_continue(
        tmp_path: Path, trained: Callable[[str], tuple[Path, str]]) -> None:
    straight_dir, _ = trained("expert_fsdp")
    saved = tmp_path / "saved"
    train(2, 2, saved, *TASK, "--steps", str(SAVED), *LAYOUTS["expert_fsdp"])
    for mesh in ("data=4", "data=1,expert=4"):
        run_dir = tmp_path / mesh
        shutil.copytree(saved, run_dir)
        proc = train(2, 2, run_dir, *TASK, "--steps", str(STEPS), "--mesh", mesh, "--rule", "fsdp")
        assert f"resumed from step {SAVED}" in proc.stderr, proc.stderr
        assert f"--mesh 'data=2,expert=2' -> '{mesh}'" in proc.stderr  # said, not refused
        assert_losses_agree(train_losses(run_dir), train_losses(straight_dir), range(SAVED + 1, STEPS + 1), mesh)
        # the checkpoint saved at the end is laid out by the new mesh: experts over 4, or whole and embed over 4
        assert saved_specs(run_dir, STEPS)["model.moe.wi.value"] == (["expert"] if "expert" in mesh else [None, "data"])
