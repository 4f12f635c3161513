"""`make run-local SWEEP=...` (deploy/local/sweep.py) without training: its order, skips and failure policy."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from deploy.local import sweep as local_sweep
from job.runs.sweep import Run


def _fake_launch(codes: dict[str, int], ran: list[str]):  # noqa: ANN202
    def argv(run: Run, nproc: int, devices: int | None) -> list[str]:
        ran.append(run.name)
        return [sys.executable, "-c", f"import sys; sys.exit({codes.get(run.name, 0)})"]
    return argv


def test_the_first_failed_run_stops_the_sweep_with_its_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []
    monkeypatch.setattr(local_sweep, "launch_argv", _fake_launch({"seed=1": 3}, ran))
    code = local_sweep.main(["--sweep", "seed=0,1,2", "-n", "2", "--devices-per-process", "1", "--",
                             "train", "--run-dir", str(tmp_path / "sweep")])
    assert code == 3 and ran == ["seed=0", "seed=1"]
    assert "run seed=1 failed with exit code 3: the sweep stops here; not started: seed=2" in caplog.text
    assert [r["name"] for r in json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]] == [
        "seed=0", "seed=1", "seed=2"]


def test_completed_runs_are_skipped_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    done = tmp_path / "sweep" / "seed=0"
    done.mkdir(parents=True)
    (done / "config.json").write_text(json.dumps({"steps": 4}))
    (done / "summary.json").write_text(json.dumps({"completed": True, "final_step": 4}))
    caplog.set_level(logging.INFO, logger="deploy.local.sweep")
    ran: list[str] = []
    monkeypatch.setattr(local_sweep, "launch_argv", _fake_launch({}, ran))
    argv = ["--sweep", "seed=0,1", "-n", "2", "--", "train", "--steps", "4", "--run-dir", str(tmp_path / "sweep")]
    assert local_sweep.main(argv) == 0 and ran == ["seed=1"]
    assert "1 of 2 already complete, skipped: seed=0; 1 to run" in caplog.text


def test_a_dry_run_lists_every_run_and_its_launcher_command_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sweep", "optim.lr=1e-3,3e-3", "-n", "4", "--devices-per-process", "2", "--dry-run", "1", "--",
            "train", "--run-dir", str(tmp_path / "sweep")]
    assert local_sweep.main(argv) == 0
    out = capsys.readouterr()
    assert "sweep " in out.out and "2 run(s)" in out.out
    assert "-m job.launch -n 4 --devices-per-process 2 --" in out.out and "--optim.lr 3e-3" in out.out
    assert "DRY_RUN=1: 2 run(s) to run; nothing run" in out.err
    assert not (tmp_path / "sweep").exists()


def test_a_bad_value_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sweep", "optim.lr=1e-3,-1", "-n", "2", "--", "train", "--run-dir", str(tmp_path / "sweep")]
    assert local_sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: sweep run 'lr=-1': --optim.lr" in err and "nothing was run" in err
    assert not (tmp_path / "sweep").exists()
