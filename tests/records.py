"""Read what the job leaves: a run dir's summary and metrics records, a doctor's check lines."""

from __future__ import annotations

import json
import re
from pathlib import Path


def summary(run_dir: Path) -> dict:
    """summary.json of a run dir, as a dict."""
    return json.loads((run_dir / "summary.json").read_text())


def records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl, in order (train, eval and every eval split's records)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Each step's logged training loss (a resumed run's own, where it redid a step)."""
    return {r["step"]: r["loss"] for r in records(run_dir) if r["split"] == "train"}


def check_lines(out: str) -> dict[str, str]:
    """Each check's line of a doctor's output by its name: 'ok    account: ...' -> {'account': 'ok    account: ...'}."""
    found = (re.match(r"(?:ok|FAIL|skip) +([^:]+): ", line) for line in out.splitlines())
    return {m.group(1): m.string for m in found if m}


# what XLA's SPMD partitioner writes to a process's stderr where two layouts of one array disagree and it
# replicates the array whole on every device to go from one to the other
INVOLUNTARY = "Involuntary full rematerialization"
# the environment that keeps XLA's warnings on a process's stderr (its default level, whatever the caller's)
COMPILER_LOG = {"TF_CPP_MIN_LOG_LEVEL": "0"}


def involuntary_rematerializations(output: str, ranks: int) -> dict[int, list[str]]:
    """{rank: the lines of its compiler's log saying INVOLUNTARY} for each of `ranks` launched processes, read
    from their relayed output (the launcher starts each line `[rank N] `). A rank with no line at all fails
    the test: its log is not there to read."""
    lines = {rank: [line for line in output.splitlines() if line.startswith(f"[rank {rank}] ")]
             for rank in range(ranks)}
    assert all(lines.values()), f"a rank relayed no output: {[rank for rank, said in lines.items() if not said]}"
    return {rank: [line for line in said if INVOLUNTARY in line] for rank, said in lines.items()}
