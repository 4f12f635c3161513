"""job/core/rundir.py: a run directory's files named in one module, and the one reader of its JSON-lines
files (a missing file empty, a torn or foreign line skipped), importable where the Slurm supervisor runs."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from etils import epath

from job.core import rundir
from tests.launching import ROOT

LAYOUT = "job/core/rundir.py"
# A string literal (or an f-string's part) that starts with a run dir's file name, or a path into one of its
# folders, spells the layout; a folder's bare name spells it as a path's part (`run_dir / "checkpoints"`).
SPELLED = re.compile(r"/?(config\.json|summary\.json|metrics\.jsonl|goodput\.jsonl|attempts\.jsonl|provenance\.json"
                     r"|sweep\.json|metrics\.png|eval_loss\.png|wandb_run_id|eval-|code-|(checkpoints|logs|profile)/"
                     r"|checkpoints\.)")
FOLDERS = {rundir.CHECKPOINTS, rundir.LOGS, rundir.PROFILE}
# Folders of the same name that are not a run dir's: a TPU slice's logs (LOCAL_DIR/NAME/logs on this machine,
# REMOTE_DIR/logs on each worker), and `make tpu-logs`' command name.
NOT_A_RUN_DIR = {"deploy/tpu/": {rundir.LOGS}}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _spelled(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every literal in `path` that spells a file or folder of a run dir."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        joined = [node.right] if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) else (
            node.args if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "joinpath" else [])
        for part in joined:
            if isinstance(part, ast.Constant) and part.value in FOLDERS:
                found.append((part.lineno, part.value))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            match = SPELLED.match(node.value)
            if match:
                found.append((node.lineno, node.value))
    return sorted(set(found))


def _allowed(rel: str, text: str) -> bool:
    return any(rel.startswith(folder) and any(text.lstrip("/").startswith(name) for name in names)
               for folder, names in NOT_A_RUN_DIR.items())


def test_a_run_dirs_files_are_named_only_in_its_layout_module() -> None:
    spelled = {}
    for top in ("job", "deploy"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == LAYOUT:
                continue
            found = [f"{line}: {text!r}" for line, text in _spelled(path) if not _allowed(rel, text)]
            if found:
                spelled[rel] = found
    assert not spelled, (f"a run dir's file named outside {LAYOUT}: ask it instead (rundir.metrics(run_dir), "
                         f"rundir.CONFIG, ...): {spelled}")


def test_the_check_finds_a_name_spelled_as_a_literal(tmp_path: Path) -> None:
    module = tmp_path / "spelled.py"
    module.write_text('"""Reads metrics.jsonl."""\n'
                      'a = run_dir / "metrics.jsonl"\n'
                      'b = run_dir / "checkpoints"\n'
                      'c = f"{run_dir}/eval-{step}.json"\n'
                      'd = run_dir.joinpath("logs", "process-0.log")\n'
                      'e = ("profile", "logging")  # a name, not a path\n'
                      'f = "checkpoints in the run dir"  # a word in a message\n')
    assert [line for line, _ in _spelled(module)] == [2, 3, 4, 5]


def test_a_run_dirs_paths_keep_the_type_and_the_bucket_they_were_given() -> None:
    bucket = epath.Path("gs://bucket/sweep1/run1")
    assert isinstance(rundir.metrics(bucket), epath.Path)
    assert str(rundir.metrics(bucket)) == "gs://bucket/sweep1/run1/metrics.jsonl"
    assert str(rundir.process_log(bucket, 3)) == "gs://bucket/sweep1/run1/logs/process-3.log"
    assert rundir.evaluation(Path("runs/a"), 40) == Path("runs/a/eval-40.json")
    assert rundir.trace(Path("runs/a"), 1) == Path("runs/a/profile/process-1")
    assert rundir.checkpoints(Path("r")).with_name(f"{rundir.FRESH_START}7").name == "checkpoints.before-fresh-start-7"
    assert rundir.code_diff(2) == "code-2.diff"


def test_records_skip_a_torn_line_a_line_that_is_not_json_and_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.5}\n'
                     b'\n'
                     b'[1, 2]\n'
                     b'"a string"\n'
                     b'not json\n'
                     b'{"step": 2, "loss": NaN}\n'
                     b'{"step": 3, "lo\xc3')  # killed mid-write, inside a character
    found = rundir.records(path)
    assert [r["step"] for r in found] == [1, 2]
    assert found[0] == {"step": 1, "loss": 2.5}
    assert rundir.records(tmp_path / "missing.jsonl") == []
    assert rundir.records(tmp_path / "metrics.jsonl" / "not-a-folder.jsonl") == []


def test_a_document_that_is_missing_or_torn_is_none(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text('{"final_step": 40, "completed": true}\n')
    (tmp_path / "config.json").write_text('{"steps": 4')
    assert rundir.document(rundir.summary(tmp_path)) == {"final_step": 40, "completed": True}
    assert rundir.document(rundir.config(tmp_path)) is None
    assert rundir.document(rundir.provenance(tmp_path)) is None


def test_append_ends_a_torn_last_line_so_the_record_never_joins_it(tmp_path: Path) -> None:
    path = rundir.attempts(tmp_path)
    rundir.append(path, {"event": "ended", "attempt": 1})
    assert path.read_text() == '{"event": "ended", "attempt": 1}\n'
    path.write_text(path.read_text() + '{"event": "resu')
    rundir.append(path, {"event": "ended", "attempt": 2})
    assert [r["attempt"] for r in rundir.records(path)] == [1, 2]
    assert path.read_text().splitlines()[1] == '{"event": "resu'
    rundir.append(path, {"event": "ended", "attempt": 3}, old="")
    assert rundir.records(path) == [{"event": "ended", "attempt": 3}]
    assert rundir.parse(rundir.line({"a": [1]}) * 2) == [{"a": [1]}, {"a": [1]}]


def test_the_slurm_supervisor_records_an_attempt_in_a_local_run_dir_without_etils(tmp_path: Path) -> None:
    # The batch host runs the supervisor with whatever python3 it has: etils (and jax) may be missing there.
    run_dir, log = tmp_path / "run", tmp_path / "5-attempts.jsonl"
    run_dir.mkdir()
    log.write_text(json.dumps({"event": "started", "attempt": 1, "run_dir": str(run_dir)}) + "\n")
    script = ("import sys; sys.modules['etils'] = None; sys.modules['jax'] = None\n"
              "from pathlib import Path\n"
              "import deploy.slurm.supervise\n"
              "from job.runs.attempts import Action, Ended, JobLog, Outcome\n"
              "JobLog(Path(sys.argv[1])).add(Ended('5', 1.0, 2.0, 137, Outcome.FAILED, Action.STOP))\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('etils', 'jax') and sys.modules[m]))")
    proc = subprocess.run([sys.executable, "-c", script, str(log)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
    (record,) = rundir.records(rundir.attempts(run_dir))
    assert (record["event"], record["attempt"], record["code"], record["action"]) == ("ended", 1, 137, "stop")
    assert [r["event"] for r in rundir.records(log)] == ["started", "ended"]
