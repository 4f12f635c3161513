"""Every link between the project's pages resolves: the file exists and, for a link to a section, a heading of
that file has that anchor (GitHub's rule: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page`."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_of_a_page_reaches_a_file_and_its_heading(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:, gs:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, "\n".join(broken)


def test_make_help_lists_each_target_in_a_line_of_at_most_120_characters() -> None:
    """`make help` lists; the docs explain: each target's line, as the help target prints it, fits 120."""
    helps = re.findall(r"^([a-z][a-z0-9-]*):.*?## (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert len(helps) > 20
    long = [f"{target}: {len(f'  make {target:<17} {text}')}" for target, text in helps
            if len(f"  make {target:<17} {text}") > 120]
    assert not long, long
