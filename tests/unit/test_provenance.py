"""A run's record covers the task's own package: its module file, a hash of the package's *.py files, its
own repository's commit and uncommitted changes, and PYTHONPATH; `python -m job rerun` says what changed.

Each test builds a user's package in its own git repository under tmp_path, as `--task mypkg.tasks:TASK`
finds it; the template's own commit and diff are held fixed (not what is tested here).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etils import epath

from job.runs import provenance

TOPOLOGY = {"kind": "single", "processes": 1, "local_devices": 1}
SPEC = "mypkg.tasks:TASK"


def _in_repo(repo: Path, *args: str) -> str:
    """`git ARGS` in `repo`, as a user with no git identity of their own would run it."""
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=u", "-c", "user.email=u@example.com", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's repository holding mypkg (tasks.py, model/net.py), committed; the template's code held fixed."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed here: no user's repository can be made")
    repo = tmp_path / "user"
    for name, text in {"mypkg/__init__.py": "", "mypkg/tasks.py": "TASK = None\n",
                       "mypkg/model/__init__.py": "", "mypkg/model/net.py": "WIDTH = 8\n"}.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _in_repo(repo, "init", "-q")
    _in_repo(repo, "add", ".")
    _in_repo(repo, "commit", "-q", "-m", "first")
    monkeypatch.setattr(provenance, "code_state", lambda: ({"commit": "c" * 40, "diff_sha256": "d" * 16}, ""))
    return repo


@contextlib.contextmanager
def _importable(repo: Path) -> Iterator[None]:
    """`repo` on this process's import path, as PYTHONPATH puts it on a run's."""
    sys.path.insert(0, str(repo))
    try:
        yield
    finally:
        sys.path.remove(str(repo))


def _recorded(repo: Path, run_dir: Path) -> dict[str, Any]:
    """The attempt a run of mypkg.tasks:TASK started with PYTHONPATH=REPO writes."""
    with _importable(repo):
        entry, _ = provenance.attempt(["train", "--task", SPEC, "--run-dir", str(run_dir)], TOPOLOGY,
                                      {"PYTHONPATH": str(repo)})
    return entry


def test_a_users_task_records_its_module_file_its_package_hash_commit_and_pythonpath(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(repo))
    with _importable(repo):
        provenance.record(epath.Path(tmp_path / "run"), ["train", "--task", SPEC], TOPOLOGY)
    task = json.loads((tmp_path / "run" / provenance.RECORD).read_text())["attempts"][-1]["task"]
    assert task["file"] == str(repo / "mypkg" / "tasks.py") and task["package"] == "mypkg"
    assert task["paths"] == [str(repo / "mypkg")] and task["files"] == 4 and task["complete"] is True
    assert task["pythonpath"] == str(repo) and task["sha256"]
    assert task["git"] == {"root": str(repo.resolve()), "commit": _in_repo(repo, "rev-parse", "HEAD"),
                           "dirty": False}


def test_an_unchanged_users_package_reruns_as_the_same(repo: Path, tmp_path: Path) -> None:
    entry = _recorded(repo, tmp_path / "run")
    assert provenance.changes(entry, str(repo), {"PYTHONPATH": str(repo)}) == []


def test_a_committed_change_to_the_users_model_is_said_with_the_old_and_new_hash_and_commit(
        repo: Path, tmp_path: Path) -> None:
    entry = _recorded(repo, tmp_path / "run")
    before = _in_repo(repo, "rev-parse", "HEAD")
    (repo / "mypkg" / "model" / "net.py").write_text("WIDTH = 16\n")
    _in_repo(repo, "commit", "-q", "-am", "wider")
    now = provenance.task_state(SPEC, {"PYTHONPATH": str(repo)}, [str(repo)], {})
    (line,) = provenance.changes(entry, str(repo), {"PYTHONPATH": str(repo)})
    assert line == (f"task package mypkg: its files changed since the run (hash {entry['task']['sha256']} -> "
                    f"{now['sha256']}); its commit {before[:12]} -> {_in_repo(repo, 'rev-parse', 'HEAD')[:12]}")


def test_an_uncommitted_change_to_the_users_package_is_said_as_its_hash_and_its_repositorys_state(
        repo: Path, tmp_path: Path) -> None:
    entry = _recorded(repo, tmp_path / "run")
    (repo / "mypkg" / "model" / "extra.py").write_text("DEPTH = 2\n")
    (line,) = provenance.changes(entry, str(repo), {"PYTHONPATH": str(repo)})
    assert line.startswith("task package mypkg: its files changed since the run")
    assert line.endswith("uncommitted changes in its repository: none at the run, some here")


def test_a_moved_package_another_pythonpath_and_a_missing_package_are_each_said(repo: Path, tmp_path: Path) -> None:
    entry = _recorded(repo, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (repo / "mypkg").rename(elsewhere / "mypkg")
    lines = provenance.changes(entry, str(tmp_path), {"PYTHONPATH": str(elsewhere)})
    assert lines[0].startswith(f"task package mypkg: its module is {elsewhere / 'mypkg' / 'tasks.py'} here (recorded "
                               f"{repo / 'mypkg' / 'tasks.py'})")
    assert "its files changed" not in lines[0]  # the same files, by their names inside the package
    assert lines[1] == f"PYTHONPATH: recorded {repo}, here {elsewhere}"
    (missing,) = provenance.changes(entry, str(tmp_path), {"PYTHONPATH": str(repo)})
    assert missing.startswith(f"task package mypkg: not found here (recorded at {repo / 'mypkg'}")


def test_caches_and_dot_folders_are_not_hashed_and_a_single_module_task_hashes_its_own_file(
        repo: Path, tmp_path: Path) -> None:
    state = provenance.task_state(SPEC, {}, [str(repo)], {})
    for junk in ("mypkg/__pycache__/tasks.py", "mypkg/.ipynb_checkpoints/net.py"):
        (repo / junk).parent.mkdir(parents=True, exist_ok=True)
        (repo / junk).write_text("ignored = True\n")
    assert provenance.task_state(SPEC, {}, [str(repo)], {})["sha256"] == state["sha256"]

    (tmp_path / "solo.py").write_text("TASK = None\n")
    solo = provenance.task_state("solo:TASK", {}, [str(tmp_path)], {})
    assert (solo["package"], solo["paths"], solo["files"]) == ("solo", [str(tmp_path / "solo.py")], 1)
    (tmp_path / "solo.py").write_text("TASK = 1\n")
    assert provenance.task_state("solo:TASK", {}, [str(tmp_path)], {})["sha256"] != solo["sha256"]


@pytest.mark.parametrize("bound", ["TASK_ENTRIES", "TASK_FILES"])
def test_a_walk_past_its_bound_stops_says_so_and_hashes_the_same_files_each_time(
        repo: Path, monkeypatch: pytest.MonkeyPatch, bound: str) -> None:
    monkeypatch.setattr(provenance, bound, 3)
    first = provenance.task_state(SPEC, {}, [str(repo)], {})
    assert first["complete"] is False and first["files"] < 4
    assert provenance.task_state(SPEC, {}, [str(repo)], {})["sha256"] == first["sha256"]


def test_a_task_of_job_tasks_records_its_folder_and_leaves_its_commit_to_the_templates() -> None:
    state, folder = provenance.task_state("lm", {}, sys.path, {}), provenance.ROOT / "job" / "tasks" / "lm"
    assert state["package"] == "job.tasks.lm" and state["paths"] == [str(folder)]
    assert state["file"] == str(folder / "task.py") and state["files"] == len(list(folder.rglob("*.py")))
    assert state["git"] == ("template" if (provenance.ROOT / ".git").exists() else None)


def test_a_run_recorded_without_the_tasks_package_compares_as_before() -> None:
    old = {"code": {"commit": "c"}, "python": "3.13", "packages": {}, "locks": {}}
    now = {**old, "task": {"spec": "lm", "pythonpath": "/elsewhere", "sha256": "x"}}
    assert provenance.differences(old, now) == []
