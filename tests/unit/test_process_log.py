"""job.observe.process_log: a process's output in RUN_DIR/logs/process-N.log beside the console, and the logger
whose lines go to that file alone (a list the console names in one line)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from job.observe import process_log


@contextlib.contextmanager
def console() -> Iterator[None]:
    """The root logger with one console handler on this moment's stderr at INFO, as python -m job sets it up
    (alone: a handler left on a stream since closed would fail every line)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handlers, level = root.handlers[:], root.level
    root.handlers, root.level = [handler], logging.INFO
    try:
        yield
    finally:
        root.handlers, root.level = handlers, level


def test_the_file_only_logger_writes_to_the_log_file_and_not_the_console(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with console():
        with process_log.teed(str(tmp_path), 0) as path:
            logging.getLogger("job.train").info("step 1")
            logging.getLogger(process_log.FILE_ONLY).info("replicated:\n  model/a\n  model/b")
        err = capsys.readouterr().err
        assert "step 1" in err and "replicated" not in err, err
        text = Path(str(path)).read_text()
        assert "INFO job.train: step 1\n" in text
        assert "INFO job.log_file: replicated:\n  model/a\n  model/b\n" in text, text  # as the console's lines
        logging.getLogger(process_log.FILE_ONLY).info("after")  # outside: to the console, as any other logger's
        assert "after" in capsys.readouterr().err and "after" not in Path(str(path)).read_text()
