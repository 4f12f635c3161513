"""A user's model in its own package (tests/user_tasks/llama_fast.py) calling the library's kernels, with 12
query heads over 4 kv heads, trains on 2 processes x 2 devices under every rule: the same losses under each,
as the same model on the same batches must give (the tensor rules on `--mesh data=2,model=2`: 6 query and 2 kv
heads a device), each step compiled without XLA replicating an activation whole on either process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import train
from tests.records import COMPILER_LOG, involuntary_rematerializations, records, summary

pytestmark = pytest.mark.multiprocess

SMALL = ("--task", "tests.user_tasks.llama_fast:TASK", "--model.dim", "96", "--model.heads", "12",
         "--model.kv-heads", "4", "--steps", "12", "--log-every", "4", "--eval-every", "12",
         "--compile-cache", "none")  # every step compiled afresh: the compiler's log is there to read
RULES = {"replicated": (), "fsdp": (), "tensor": ("--mesh", "data=2,model=2"),
         "fsdp_tensor": ("--mesh", "data=2,model=2")}


def test_a_users_grouped_query_model_trains_on_several_processes_under_every_rule(tmp_path: Path) -> None:
    losses = {}
    for rule, mesh in RULES.items():
        proc = train(2, 2, tmp_path / rule, *SMALL, "--rule", rule, *mesh, **COMPILER_LOG)
        result = summary(tmp_path / rule)
        assert result["completed"] is True and result["final_step"] == 12, (rule, result)
        assert "for queries (8, 32, 12, 8), 4 kv heads" in proc.stderr, rule  # the library's attention, grouped
        # its embedding looked up by rows as its blocks' inputs are: no activation replicated to change layout
        assert involuntary_rematerializations(proc.stdout + proc.stderr, 2) == {0: [], 1: []}, (rule, proc.stderr)
        # its remat auto chosen by the loop, said for the first candidate too, and recorded for `python -m job eval`
        assert "remat auto: none (memory not reported here)" in proc.stderr, rule
        assert json.loads((tmp_path / rule / "remat.json").read_text())["policy"] == "none", rule
        losses[rule] = [r["loss"] for r in records(tmp_path / rule) if r["split"] == "train"]
        assert losses[rule][-1] < losses[rule][0] - 0.3, (rule, losses[rule])  # it learns
    for rule, seen in losses.items():
        assert seen == pytest.approx(losses["replicated"], abs=1e-4), rule
