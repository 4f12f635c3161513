"""Every process's output also in its own file, RUN_DIR/logs/process-N.log, beside the console.

    with process_log.teed(cfg.run_dir, info.process_id):   # loop.run, once the process knows its index
        ...

What Python writes to stdout and stderr goes to both: the job's log lines, a task's prints, warnings, the
watchdog's stacks and the error that ended the process. Output that native code writes straight to file
descriptors 1 and 2 (XLA's own C++ log lines) reaches the console only. A requeued or restarted run appends to
the same file under a header line per attempt. On a gs:// run dir the file is rewritten whole at most every
30 s and when the process ends (storage.Appender).

A list too long for the console goes to the file alone through the logger named FILE_ONLY (the console says in
one line where it is):

    logging.getLogger(process_log.FILE_ONLY).info("replicated: %s", names)   # inside `teed`: the file only
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import TextIO

from etils import epath

from job.core import rundir, storage
from job.core.errors import ConfigError

log = logging.getLogger("job.observe.process_log")

# the logger whose records go to the process's log file and not to the console, inside `teed` (outside it, or
# when the file cannot be opened, to the console as any other logger's)
FILE_ONLY = "job.log_file"


class Tee(io.TextIOBase):
    """A text stream that writes to `stream` and to `copy` (the process's log file): the console stays the
    console (its file descriptor, its tty), and a failing copy never fails the write to the console."""

    def __init__(self, stream: TextIO, copy: storage.Appender, lock: threading.Lock) -> None:
        super().__init__()
        self.stream, self._copy, self._lock = stream, copy, lock

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        with self._lock, contextlib.suppress(OSError, ValueError):  # a full disk or a closed file: console only
            self._copy.write(text)
        return written

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # the console's, read-only: TextIOBase types it writable
        return self.stream.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]  # the console's, read-only, as encoding
        return self.stream.errors


class _ToFile(logging.Handler):
    """Writes FILE_ONLY's records to the log file alone, formatted as the console's lines."""

    def __init__(self, copy: storage.Appender, lock: threading.Lock, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self._copy, self._lock = copy, lock
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record) + "\n"
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._copy.write(text)


def _ending(exc: BaseException) -> str:
    """What ended the process, as the file keeps it: a ConfigError's one line, else the traceback."""
    if isinstance(exc, ConfigError):
        return f"{type(exc).__name__}: {exc}\n"
    return "".join(traceback.format_exception(exc))


@contextlib.contextmanager
def teed(run_dir: str, process: int) -> Iterator[epath.Path]:
    """Inside: sys.stdout, sys.stderr and the root logger's console handlers also write to process
    `process`'s log file in `run_dir` (its path is yielded); an exception that leaves is written there too."""
    path = rundir.process_log(storage.run_path(run_dir), process)
    try:
        storage.make_dirs(path.parent)
        copy, lock = storage.Appender(path), threading.Lock()
    except OSError as exc:  # an unwritable run dir is the preflight's to report, in one line, on every process
        if path.parent.parent.is_dir():
            log.warning("no per-process log file %s: %s", path, exc)
        yield path
        return
    copy.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} process {process} (pid {os.getpid()}): "
               f"{' '.join(sys.argv)}\n")
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (Tee(stream, copy, lock) for stream in streams)
    handlers = [h for h in logging.getLogger().handlers
                if type(h) is logging.StreamHandler and h.stream in streams]
    for handler in handlers:
        handler.setStream(sys.stderr if handler.stream is streams[1] else sys.stdout)
    file_only = logging.getLogger(FILE_ONLY)
    to_file, propagated = _ToFile(copy, lock, handlers[0].formatter if handlers else None), file_only.propagate
    file_only.addHandler(to_file)
    file_only.propagate = False
    try:
        yield path
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            with lock, contextlib.suppress(OSError, ValueError):
                copy.write(_ending(exc))
        raise
    finally:
        file_only.removeHandler(to_file)
        file_only.propagate = propagated
        for handler in handlers:
            handler.setStream(streams[1] if handler.stream is sys.stderr else streams[0])
        sys.stdout, sys.stderr = streams
        with lock:
            try:
                copy.close()
            except OSError as exc:
                log.warning("could not write %s: %s", path, exc)


__all__ = ["FILE_ONLY", "Tee", "teed"]
