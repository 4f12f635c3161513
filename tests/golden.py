"""Golden files: text a test must reproduce exactly, kept next to the tests that check it.

    check_golden(Path(__file__).parent / "golden" / "submitit_basic.sbatch", text)

After an intended change, `UPDATE_GOLDEN=1 pytest ...` rewrites each file that
differs, and each test that rewrote one fails, so no run passes by writing what it
compares against: review the diff (`git diff tests/`), then rerun without UPDATE_GOLDEN.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

UPDATE_VARIABLE = "UPDATE_GOLDEN"
DIFF_LINES = 60  # a differing file's message shows at most this many lines of the unified diff


def updating() -> bool:
    """True when this run rewrites golden files that differ (UPDATE_GOLDEN=1)."""
    return os.environ.get(UPDATE_VARIABLE) == "1"


def check_golden(path: Path, text: str) -> None:
    """Fail unless `text` equals the file at `path`. With UPDATE_GOLDEN=1 a missing or differing
    file is rewritten with `text`, and the test fails all the same, naming the file to review."""
    old = path.read_text() if path.exists() else None
    if old == text:
        return
    if updating():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        pytest.fail(f"rewrote {path}; review it and rerun without {UPDATE_VARIABLE}", pytrace=False)
    if old is None:
        pytest.fail(f"golden file {path}: expected it to exist, found none. Fix: run this test once with "
                    f"{UPDATE_VARIABLE}=1 and review the file it writes", pytrace=False)
    diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), f"{path} (golden)", "this run",
                                     lineterm=""))
    shown = "\n".join(diff[:DIFF_LINES]) + (f"\n... {len(diff) - DIFF_LINES} more lines" if len(diff) > DIFF_LINES
                                            else "")
    pytest.fail(f"golden file {path}: expected the text this run made, found a different file:\n{shown}\n"
                f"Fix: if the change is intended, rerun with {UPDATE_VARIABLE}=1 and review the diff",
                pytrace=False)
