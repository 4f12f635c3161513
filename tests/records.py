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
