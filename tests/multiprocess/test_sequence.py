"""Sequence parallelism on real processes: the example LM with its activations split along the sequence
(`--mesh ...,sequence=2`) trains with the per-step losses of the same LM with its batch split instead.

Every run is 2 processes x 2 devices. On `--mesh data=2,sequence=2` each pair of sequence devices holds
the same rows and each device computes half of their positions (tests/unit/test_model.py shows the
layout); the sums over positions (the loss, the gradients) then add across the sequence devices, so the
losses agree with the unsplit run's within float rounding (1e-5 relative), not bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launching import train
from tests.multiprocess.test_train import SMALL
from tests.records import summary, train_losses

pytestmark = pytest.mark.multiprocess

STEPS = 6
# --model.seq-len 32: the LM sees 32 positions of each row (of 33 tokens), a length the sequence axis divides
FLAGS = ("--steps", str(STEPS), "--log-every", "1", "--eval-every", str(STEPS), "--model.seq-len", "32", *SMALL)
SPLIT = {  # name -> the flags of a run split along the sequence
    "data2_sequence2": ("--mesh", "data=2,sequence=2"),
    "fsdp": ("--mesh", "data=2,sequence=2", "--rule", "fsdp"),
    "tensor": ("--mesh", "data=1,sequence=2,model=2", "--rule", "tensor"),  # 4 heads: 2 per model device
}


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the LM with its batch over all four devices (--mesh data=4), whole along the sequence."""
    run_dir = tmp_path_factory.mktemp("sequence") / "data4"
    train(2, 2, run_dir, *FLAGS, "--mesh", "data=4")
    return run_dir


@pytest.mark.parametrize("name", list(SPLIT))
def test_the_lm_split_along_the_sequence_trains_with_the_losses_of_the_unsplit_run(
        name: str, unsplit: Path, tmp_path: Path) -> None:
    proc = train(2, 2, tmp_path, *FLAGS, *SPLIT[name])
    assert "fell back" not in proc.stdout + proc.stderr
    reference, losses = train_losses(unsplit), train_losses(tmp_path)
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), (name, step)
    assert summary(tmp_path)["eval_loss"] == pytest.approx(summary(unsplit)["eval_loss"], rel=1e-5)
