"""Preflight's comparison and report, from recorded rows (no processes)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from job.errors import ConfigError
from job.runtime import preflight
from tests.unit.test_cluster import gpu_task

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


def test_a_probe_left_by_an_earlier_run_is_not_taken_for_process_0s(tmp_path: Path) -> None:
    # process 0 of an earlier attempt ran on this host and was stopped during its preflight: its probe stayed
    # in this host's own folder, where this attempt's process 1 now looks for this attempt's process 0's
    assert preflight.writable(tmp_path, 0, keep=True, token="earlier") == preflight.WRITABLE
    assert (tmp_path / ".preflight-0").read_text() == "earlier"
    seen = preflight.sees_process_0(tmp_path, "this-run")
    assert seen == ("found a .preflight-0 that process 0 of this job did not write (an earlier run's, left in this "
                    "host's own folder): not a folder the hosts share")
    table = rows({"run dir shared": preflight.SHARED}, {"run dir shared": seen})
    assert preflight.problems(table) == ["run dir shared"]
    assert preflight.writable(tmp_path, 0, keep=True, token="this-run") == preflight.WRITABLE  # overwritten
    assert preflight.sees_process_0(tmp_path, "this-run") == preflight.SHARED
    assert preflight.sees_process_0(tmp_path / "elsewhere", "this-run").startswith("cannot see process 0's")


def test_a_probe_that_cannot_be_read_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert preflight.writable(tmp_path, 0, keep=True, token="this-run") == preflight.WRITABLE

    def failing(self: Path, *args: object, **kwargs: object) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Path, "read_text", failing)
    assert preflight.sees_process_0(tmp_path, "this-run") == (
        "cannot read process 0's .preflight-0: OSError: [Errno 5] Input/output error")


def test_removing_a_probe_never_raises(tmp_path: Path) -> None:
    preflight.writable(tmp_path, 1, keep=True)
    assert (tmp_path / ".preflight-1").exists()
    preflight.remove_probe(tmp_path, 1)
    preflight.remove_probe(tmp_path, 1)  # already gone
    preflight.remove_probe(tmp_path / "file-not-folder" / "x", 1)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- GPUs

SLURM_TASK = gpu_task(4, 1, SLURM_GPUS_ON_NODE="4")


@pytest.mark.parametrize(
    ("env", "jax_visible", "expected"),
    [
        ({}, "all", None),  # a CPU job
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "all", 4),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "2", 1),  # job.initialize gave jax local_device_ids (2,)
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "2,3", 2),
        ({"CUDA_VISIBLE_DEVICES": "GPU-a1"}, "all", 1),
        ({"CUDA_VISIBLE_DEVICES": ""}, "all", None),  # hidden on purpose
        ({**SLURM_TASK, "CUDA_VISIBLE_DEVICES": ""}, "all", None),  # CUDA_VISIBLE_DEVICES decides
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles", **SLURM_TASK}, "all", None),
        (SLURM_TASK, "all", 4),  # Slurm says so, nothing narrowed the process
        ({"SLURM_STEP_GPUS": "2,3", **SLURM_TASK}, "all", 2),
        (gpu_task(4, 1, SLURM_JOB_GPUS="0,1,2"), "all", 3),
        (gpu_task(4, 3), "3", None),  # a CPU job several tasks a node: jax_cuda_visible_devices is moot
        ({"SLURM_GPUS_ON_NODE": "4"}, "all", None),  # not a Slurm task: its variables say nothing
    ],
)
def test_gpus_given_to_this_process(env: dict[str, str], jax_visible: str, expected: int | None) -> None:
    assert preflight.gpus_given(env, jax_visible) == expected


@pytest.mark.parametrize(
    ("given", "backend", "found", "expected"),
    [
        (None, "cpu", 8, preflight.NO_GPUS),
        (4, "gpu", 4, preflight.GPUS_OK),
        (4, "cpu", 8, "expected 4 GPU(s), found 8 cpu device(s)"),
        (1, "cpu", 1, "expected 1 GPU(s), found 1 cpu device(s)"),
        (1, "gpu", 8, "expected 1 GPU(s), found 8 gpu device(s)"),  # jax took every GPU: two processes share
        (2, "gpu", 1, "expected 2 GPU(s), found 1 gpu device(s)"),
    ],
)
def test_gpu_check(given: int | None, backend: str, found: int, expected: str) -> None:
    assert preflight.gpu_check(given, backend, found, {}) == expected
    assert len(expected) <= 60  # a report cell shows 60 characters


def test_the_gpu_check_is_skipped_for_stand_in_gpus_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="job.runtime.preflight"):
        fact = preflight.gpu_check(4, "cpu", 8, {"JOB_SKIP_GPU_CHECK": "1"})
    assert fact == preflight.GPUS_SKIPPED
    assert [r.getMessage() for r in caplog.records] == [
        "preflight: GPU check skipped (JOB_SKIP_GPU_CHECK=1): this process was given 4 GPU(s), jax runs on 8 cpu "
        "device(s)"]
    caplog.clear()
    assert preflight.gpu_check(None, "cpu", 8, {"JOB_SKIP_GPU_CHECK": "1"}) == preflight.NO_GPUS
    assert preflight.gpu_check(4, "cpu", 8, {"JOB_SKIP_GPU_CHECK": "0"}).startswith("expected 4 GPU(s)")
    assert caplog.records == []


@pytest.mark.parametrize("value", ["2", " 1", "maybe"])
def test_a_skip_value_that_is_no_on_off_word_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        preflight.gpu_check(4, "cpu", 8, {"JOB_SKIP_GPU_CHECK": value})
    assert str(caught.value).startswith(
        f"JOB_SKIP_GPU_CHECK: expected 1 or 0 (or true/false), found {value!r}. Fix: set JOB_SKIP_GPU_CHECK=1 only")


@pytest.mark.parametrize(("value", "skips"), [("yes", True), ("true", True), ("ON", True), ("no", False),
                                              ("false", False), ("", False)])
def test_the_skip_takes_every_on_off_word_as_the_make_variables_do(value: str, skips: bool) -> None:
    fact = preflight.gpu_check(4, "cpu", 8, {"JOB_SKIP_GPU_CHECK": value})
    assert (fact == preflight.GPUS_SKIPPED) is skips


def test_a_process_without_its_gpus_fails_preflight_with_a_fix() -> None:
    table = rows({"gpus": preflight.GPUS_OK}, {"gpus": "expected 4 GPU(s), found 8 cpu device(s)"})
    assert preflight.problems(table) == ["gpus"]
    text = preflight.report(table, ["gpus"], Path("/r"))
    assert text.splitlines()[2].split() == ["gpus", "as", "given", "expected", "4", "GPU(s),", "found", "8", "cpu",
                                            "device(s)"]
    assert "Fix: give jax the GPUs each process was given: found cpu devices, run a CUDA build of jax" in text
    assert "make docker-build FLAVOR=cuda" in text and "JOB_SKIP_GPU_CHECK=1" in text


def test_gpus_pass_when_none_were_given_or_the_check_was_skipped() -> None:
    assert preflight.problems(rows({"gpus": preflight.NO_GPUS}, {"gpus": preflight.GPUS_SKIPPED}, {})) == []


def test_an_unwritable_run_dir_and_missing_gpus_are_both_reported() -> None:
    table = rows({"run dir": "OSError: x", "run dir shared": "-", "gpus": "expected 1 GPU(s), found 2 cpu device(s)"})
    assert preflight.problems(table) == ["run dir", "gpus"]


def test_check_stops_a_cpu_backend_that_was_given_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The whole check in this process: jax here runs on the CPU, the environment says 2 GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("JOB_SKIP_GPU_CHECK", raising=False)
    with pytest.raises(preflight.PreflightError) as caught:
        preflight.check({"steps": 1}, tmp_path)
    text = str(caught.value)
    assert "preflight: stopping before training: 1 processes" in text
    assert "gpus  expected 2 GPU(s), found " in text and " cpu device(s)" in text
    monkeypatch.setenv("JOB_SKIP_GPU_CHECK", "1")
    assert preflight.check({"steps": 1}, tmp_path).facts["gpus"] == preflight.GPUS_SKIPPED
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert preflight.check({"steps": 1}, tmp_path).facts["gpus"] == preflight.NO_GPUS
