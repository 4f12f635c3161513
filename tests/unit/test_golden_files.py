"""tests/golden.py: a golden test fails when it differs, and fails again on the run that rewrites its file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.golden import UPDATE_VARIABLE, check_golden


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    path = tmp_path / "golden" / "case.txt"
    path.parent.mkdir()
    path.write_text("a\n")
    return path


def test_an_equal_file_passes_with_or_without_the_update_variable(golden: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UPDATE_VARIABLE, raising=False)
    check_golden(golden, "a\n")
    monkeypatch.setenv(UPDATE_VARIABLE, "1")
    before = golden.stat().st_mtime_ns
    check_golden(golden, "a\n")
    assert golden.stat().st_mtime_ns == before  # nothing to rewrite, nothing written


def test_a_differing_file_fails_with_the_diff_and_stays_as_it_was(golden: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UPDATE_VARIABLE, raising=False)
    with pytest.raises(pytest.fail.Exception) as failed:
        check_golden(golden, "b\n")
    message = str(failed.value)
    assert f"golden file {golden}: expected the text this run made, found a different file" in message
    assert "-a\n+b" in message and f"rerun with {UPDATE_VARIABLE}=1" in message
    assert golden.read_text() == "a\n"


def test_a_missing_file_fails_and_says_how_to_create_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UPDATE_VARIABLE, raising=False)
    path = tmp_path / "golden" / "new.txt"
    with pytest.raises(pytest.fail.Exception, match=f"found none. Fix: run this test once with {UPDATE_VARIABLE}=1"):
        check_golden(path, "a\n")
    assert not path.exists()


@pytest.mark.parametrize("exists", [True, False], ids=["differing", "missing"])
def test_the_run_that_rewrites_a_golden_file_fails(exists: bool, golden: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if not exists:
        golden.unlink()
    monkeypatch.setenv(UPDATE_VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        check_golden(golden, "b\n")
    assert str(failed.value) == f"rewrote {golden}; review it and rerun without {UPDATE_VARIABLE}"
    assert golden.read_text() == "b\n"
    monkeypatch.delenv(UPDATE_VARIABLE)
    check_golden(golden, "b\n")  # the rerun without the variable compares against the reviewed file


@pytest.mark.parametrize("value", ["0", "", "true", "yes"])
def test_only_update_golden_1_rewrites(value: str, golden: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UPDATE_VARIABLE, value)
    with pytest.raises(pytest.fail.Exception, match="found a different file"):
        check_golden(golden, "b\n")
    assert golden.read_text() == "a\n"
