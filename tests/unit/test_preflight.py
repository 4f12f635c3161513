"""Preflight's comparison and report, from recorded rows (no processes)."""

from __future__ import annotations

from pathlib import Path

from job import preflight

BASE = {"process": 0, "host": "a", "python": "3.11.7", "jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8",
        "orbax-checkpoint": "0.12.8", "optax": "0.2.8", "job code": "abc", "device kind": "cpu",
        "local devices": 2, "run dir": preflight.WRITABLE, "config.steps": 10, "config.model.dim": 64}


def rows(*changes: dict) -> list[dict]:
    return [{**BASE, "process": i, "host": f"h{i}", **change} for i, change in enumerate(changes)]


def test_identical_hosts_have_no_problems() -> None:
    assert preflight.problems(rows({}, {}, {})) == []


def test_every_differing_field_is_listed_library_facts_before_config() -> None:
    found = preflight.problems(rows({}, {"config.steps": 11, "jaxlib": "0.9"}, {"local devices": 1}))
    assert found == ["jaxlib", "local devices", "config.steps"]


def test_a_run_dir_no_process_can_write_is_a_problem_even_when_all_agree() -> None:
    assert preflight.problems(rows({"run dir": "OSError: x"}, {"run dir": "OSError: x"})) == ["run dir"]


def test_the_report_has_a_column_per_process_and_a_fix_per_kind() -> None:
    table = rows({}, {"jax": "0.4.1", "config.model.dim": 32})
    text = preflight.report(table, preflight.problems(table), Path("/runs/x"))
    lines = text.splitlines()
    assert lines[0] == "preflight: stopping before training: 2 processes, these facts differ or fail."
    assert lines[1].split() == ["process", "0", "(h0)", "process", "1", "(h1)"]
    assert lines[2].split() == ["jax", "0.10.2", "0.4.1"]
    assert lines[3].split() == ["config.model.dim", "64", "32"]
    assert "run the same image or environment" in lines[4] and "pass the same flags" in lines[4]


def test_a_run_dir_the_hosts_do_not_share_is_a_problem() -> None:
    table = rows({"run dir shared": "shared"}, {"run dir shared": "cannot see process 0's .preflight-0: ..."})
    assert preflight.problems(table) == ["run dir shared"]
    assert "one folder every host can write" in preflight.report(table, ["run dir shared"], Path("/r"))


def test_a_large_job_is_reported_by_groups_the_rarest_named() -> None:
    many = rows(*({"jax": "0.4.1"} if i in (17, 40) else {} for i in range(64)))
    text = preflight.report(many, preflight.problems(many), Path("/r"))
    assert "jax: 0.10.2 on 62 processes; 0.4.1 on 2 process(es) 17, 40 (hosts h17, h40)" in text
    assert max(len(line) for line in text.splitlines()) < 200


def test_flatten_nests_with_dots() -> None:
    assert preflight.flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {"a.b": 1, "a.c.d": "x", "e": None}


def test_writable_probe(tmp_path: Path) -> None:
    assert preflight.writable(tmp_path / "new" / "dir", 3) == preflight.WRITABLE
    assert list((tmp_path / "new" / "dir").iterdir()) == []  # the probe is removed
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert preflight.writable(blocker / "sub", 0).startswith("FileExistsError") or \
        preflight.writable(blocker / "sub", 0).startswith("NotADirectoryError")


def test_code_hash_changes_with_any_source_byte_or_file(tmp_path: Path) -> None:
    def tree(name: str, files: dict[str, str]) -> Path:
        for rel, text in files.items():
            (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / rel).write_text(text)
        return tmp_path / name

    base = {"a.py": "x = 1\n", "sub/b.py": "y = 2\n"}
    same = preflight.code_hash(tree("one", base))
    assert preflight.code_hash(tree("two", base)) == same
    assert preflight.code_hash(tree("edit", {**base, "a.py": "x = 2\n"})) != same
    assert preflight.code_hash(tree("more", {**base, "c.py": ""})) != same
    assert preflight.code_hash(tree("moved", {"a.py": "x = 1\n", "b.py": "y = 2\n"})) != same
    assert len(preflight.code_hash()) == 12


def test_removing_a_probe_never_raises(tmp_path: Path) -> None:
    preflight.writable(tmp_path, 1, keep=True)
    assert (tmp_path / ".preflight-1").exists()
    preflight.remove_probe(tmp_path, 1)
    preflight.remove_probe(tmp_path, 1)  # already gone
    preflight.remove_probe(tmp_path / "file-not-folder" / "x", 1)
    assert list(tmp_path.iterdir()) == []
