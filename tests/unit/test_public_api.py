"""What a fork may import: every name docs/api.md lists ("What a fork may import", read from the page, so the
page and this test cannot drift) imports from its path; the old paths of moved modules still import, with a
DeprecationWarning naming the new path; a user's task built from the listed names uses nothing else."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## What a fork may import"
USER_TASK = ROOT / "tests" / "user_tasks" / "textures.py"  # a task built from the listed names alone
# what `job.batches` exported before it moved (git show 14eb513^:job/batches.py), all still importable from it
OLD_BATCHES = ("Prefetch", "below", "global_batch", "row_bits", "row_span", "to_global", "uniform")


def _tables() -> dict[str, list[list[str]]]:
    """The section's tables by the first cell of their header: rows of cells, header and rule left out."""
    text = (ROOT / "docs" / "api.md").read_text()
    assert text.count(SECTION) == 1, f"docs/api.md has one section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            tables[rows[0][0]] = [row for row in rows[2:]]
            rows = []
    return tables


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


TABLES = _tables()
LISTED = {_ticked(row[0])[0]: _ticked(row[1]) for row in TABLES["module"]}
MOVED = {_ticked(row[0])[0]: _ticked(row[1])[0] for row in TABLES["old path"]}


def test_the_page_lists_the_task_interface_the_annotations_the_errors_and_the_row_randomness() -> None:
    assert {"Task", "Rows", "SPLITS"} <= set(LISTED["job.task"])
    assert {"axes", "partitioned", "LAYERS_AXIS"} <= set(LISTED["job.sharding"])
    assert {"ConfigError", "require"} <= set(LISTED["job.errors"])
    assert LISTED["job.random"] == ["row_bits", "below", "uniform"]
    assert MOVED["job.batches"] == "job.random"
    assert not set(LISTED) & set(MOVED), "a listed path is never an old one"


@pytest.mark.parametrize("module", sorted(LISTED))
def test_every_listed_name_imports_from_its_path(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in LISTED[module] if not hasattr(imported, name)]
    assert not missing, f"docs/api.md lists {missing} in {module}, which has no such names"
    exported = getattr(imported, "__all__", None)
    if exported is not None:  # a public module hands on what it lists
        assert set(LISTED[module]) <= set(exported), sorted(set(LISTED[module]) - set(exported))


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_still_imports_with_a_deprecation_warning_naming_the_new_one(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)  # a first import, as a fork's process makes it
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: import .*{re.escape(MOVED[old])}") as caught:
        module = __import__(old, fromlist=["_"])
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and f"{old} is deprecated" in str(w.message)]
    assert [w.filename for w in ours] == [__file__], "one warning, at the line that imports the old path"
    for name in module.__all__:
        assert getattr(module, name) is getattr(new, name, getattr(module, name)), name


def test_job_batches_warns_and_still_gives_row_bits_below_and_uniform() -> None:
    sys.modules.pop("job.batches", None)
    with pytest.warns(DeprecationWarning, match="job.batches is deprecated: import row_bits, below and uniform "
                                                "from job.random"):
        import job.batches  # noqa: F401 - the old path a fork's data source imported
    from job import random
    from job.batches import below, row_bits, uniform

    assert (row_bits, below, uniform) == (random.row_bits, random.below, random.uniform)
    assert sorted(sys.modules["job.batches"].__all__) == sorted(OLD_BATCHES)
    for name in OLD_BATCHES:
        assert hasattr(sys.modules["job.batches"], name), name


def _imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each `from module import name`, (module, None) for each `import module`."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def test_the_users_task_imports_only_listed_names() -> None:
    used = [(module, name) for module, name in _imported_names(USER_TASK)
            if module == "job" or module.startswith("job.")]
    assert used, "the task imports from job"
    unlisted = [(module, name) for module, name in used
                if not (module in LISTED and (name is None or name in LISTED[module])
                        or module == "job" and name in LISTED)]
    assert not unlisted, f"{USER_TASK.name} imports names docs/api.md does not list: {unlisted}"


def test_nothing_in_the_repository_imports_an_old_path() -> None:
    users = []
    for top in ("job", "deploy", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            if any(module in MOVED or f"{module}.{name}" in MOVED for module, name in _imported_names(path)):
                users.append(str(path.relative_to(ROOT)))
    assert not users, f"import the new paths instead: {users}"

