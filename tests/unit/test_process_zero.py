"""`on_process_zero` and `only_specific_processes` (job/parallel/multihost.py), with the process index patched:
what runs where, what comes back, and that both say "process 0 only" the same way."""

from __future__ import annotations

import time
import warnings

import jax
import pytest

from job import multihost as public
from job.parallel import multihost


@pytest.mark.parametrize("index", [0, 1, 3])
def test_on_process_zero_runs_the_call_on_process_zero_only_and_returns_its_result_there(
        index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_index", lambda backend=None: index)
    calls = []

    def record(*args: object, **kwargs: object) -> str:
        calls.append((args, kwargs))
        return "done"

    result = multihost.on_process_zero(record, 1, "two", func="a keyword named func", step=3)
    if index == 0:
        assert result == "done"
        assert calls == [((1, "two"), {"func": "a keyword named func", "step": 3})]
    else:
        assert result is None and calls == []


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_the_decorator_runs_where_its_processes_say_and_its_default_is_on_process_zero(
        index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_index", lambda backend=None: index)
    assert multihost.only_specific_processes()(str)(7) == multihost.on_process_zero(str, 7)
    assert multihost.only_specific_processes()(str)(7) == ("7" if index == 0 else None)
    assert multihost.only_specific_processes([1, 3])(str)(7) == ("7" if index in (1, 3) else None)
    assert multihost.only_specific_processes(2)(str)(7) == ("7" if index == 2 else None)


def test_a_warning_raised_through_it_names_the_line_that_called_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_index", lambda backend=None: 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        multihost.on_process_zero(warnings.warn, "from process 0", UserWarning, stacklevel=2)
        multihost.only_specific_processes()(warnings.warn)("from process 0", UserWarning, stacklevel=2)
    assert [w.filename for w in caught] == [__file__, __file__]


def test_the_public_multihost_hands_on_the_same_function() -> None:
    assert public.on_process_zero is multihost.on_process_zero


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("command", "argv", "says"), [("train", ["--stpes", "3"], "Unrecognized options: --stpes"),
                                                     ("eval", ["--run-dri", "x"], "required: --run-dir")])
def test_a_flag_typo_is_printed_by_process_zero_only_and_every_process_exits_2_the_others_after_a_grace(
        rank: int, command: str, argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from job.train import entry, trained

    monkeypatch.setenv("JOB_LAUNCH_COORDINATOR", "127.0.0.1:1")  # as python -m job.launch starts process `rank`
    monkeypatch.setenv("JOB_LAUNCH_NUM_PROCESSES", "2")
    monkeypatch.setenv("JOB_LAUNCH_PROCESS_ID", str(rank))
    monkeypatch.setattr(entry, "PARSE_GRACE_S", 0.5)  # how long process 1 gives process 0 to print it first
    began = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        entry.train(argv) if command == "train" else trained.eval_command(argv)
    took = time.monotonic() - began
    said = capsys.readouterr()
    assert exited.value.code == 2
    if rank == 0:
        assert says in said.err + said.out
    else:
        assert said.err == said.out == "" and took >= 0.5


@pytest.mark.parametrize("index", [0, 1])
def test_a_warning_from_process_zero_prints_no_python_source_line(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_index", lambda backend=None: index)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        multihost.warn_on_process_zero("3 variable(s) fell back to replicated", where="job.train.state")
    if index:
        assert caught == []
        return
    [warning] = caught
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno, warning.line)
    assert shown == "job.train.state:0: UserWarning: 3 variable(s) fell back to replicated\n"
