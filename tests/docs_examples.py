"""The examples of a docs page, as the tests run them: each fenced block of one language, in order."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def code_blocks(page: str, language: str = "python") -> list[str]:
    """Every ```language block of docs/<page> (e.g. "your-model.md"), its text without the fences."""
    text = (DOCS / page).read_text()
    return [body for lang, body in _FENCE.findall(text) if lang == language]
