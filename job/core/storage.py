"""Run directories on a local disk or in Cloud Storage, through one path type (etils.epath).

    run_dir = storage.run_path(cfg.run_dir)        # epath.Path: pathlib's API, for "runs/x" and "gs://BUCKET/x"
    storage.check_writable(run_dir)                # None, or one line: expected, found, fix
    python -m job check-run-dir gs://BUCKET/run1   # the same from a shell: exit 0, or that line and exit 2

gs:// paths go through gcsfs (etils.epath's backend when TensorFlow is absent);
orbax writes the arrays with tensorstore and marks a complete step with a
`commit_success.txt` object instead of renaming a folder. Credentials are the
clients' own: the worker's service account on Google Cloud, else Application
Default Credentials. GCS has no folders: nothing here creates one (gcsfs
would create a missing *bucket* when asked for a folder in it).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable

from etils import epath
from etils.epath import backend

REMOTE_PREFIXES = ("gs://",)
BUCKET_ROLE = "roles/storage.objectAdmin"
NOT_A_NAME = "not a usable name"
COMMIT_MARKER = "commit_success.txt"  # orbax's last object of a complete step in gs:// (its atomicity.py)


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for a gs:// path (an object store: no folders, no rename, no append)."""
    return os.fspath(path).startswith(REMOTE_PREFIXES)


def bucket_of(path: str | os.PathLike[str]) -> str:
    """'gs://b/run/x' -> 'b' ('' for a local path)."""
    return os.fspath(path).split("://", 1)[1].split("/", 1)[0] if is_remote(path) else ""


def bucket_name_problem(name: str) -> str | None:
    """Why `name` cannot be a bucket name (Cloud Storage's naming rules), or None."""
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")
    if not 3 <= len(name) <= (222 if "." in name else 63):
        return "a bucket name has 3-63 characters (222 with dots)"
    if not set(name) <= allowed:
        return "a bucket name has only lowercase letters, digits, '-', '_' and '.'"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return "a bucket name starts and ends with a letter or digit"
    if name.startswith("goog") or ".." in name:
        return "a bucket name cannot start with 'goog' or contain '..'"
    return None


def url_problem(run_dir: str) -> str | None:
    """Why `run_dir` cannot be a run directory's name (a URL of another kind, a bad bucket), or None."""
    if not run_dir or not run_dir.isprintable():
        return "a non-empty path without control characters"
    if "://" in run_dir and not is_remote(run_dir):
        return f"only {', '.join(REMOTE_PREFIXES)} URLs are supported"
    if is_remote(run_dir):
        bucket, _, inside = run_dir.split("://", 1)[1].partition("/")
        if not inside.strip("/"):
            return "a folder inside the bucket, not the bucket's root"
        return bucket_name_problem(bucket)
    return None


def run_path(path: str | os.PathLike[str]) -> epath.Path:
    """The run directory (or any path in it) as an epath.Path; local paths as given (relative stays relative)."""
    return epath.Path(path)


def endpoint() -> str:
    """Where this process's gs:// paths go: STORAGE_EMULATOR_HOST (an emulator, as gcsfs reads it), else Cloud
    Storage's own endpoint."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    return emulator if emulator not in ("", "default") else "https://storage.googleapis.com"


def load_client(path: str | os.PathLike[str]) -> None:
    """Import the client of `path` (gcsfs for gs://) now, in the calling thread: a thread that would import it on
    its first gs:// call, alongside another thread's imports, may find modules half made."""
    if is_remote(path):
        import gcsfs  # noqa: F401 - imported here: see above; etils.epath would, on the first call


def make_dirs(path: epath.Path) -> None:
    """mkdir -p for a local folder; nothing for gs:// (objects need no folders, and gcsfs's
    mkdir would create a missing bucket in whatever project the credentials name)."""
    if not is_remote(path):
        path.mkdir(parents=True, exist_ok=True)


class Appender:
    """Lines appended to one file, for a whole run: a local file is appended to and flushed at once;
    a Cloud Storage object (no append there) is kept in memory and rewritten whole at most once
    every `every_s` seconds and on `flush`/`close`, so a long run does not rewrite it at every line."""

    def __init__(self, path: epath.Path, *, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.every_s, self._clock = path, every_s, clock
        self._file = None if is_remote(path) else path.open("a", encoding="utf-8")
        self._text = path.read_text(encoding="utf-8") if self._file is None and path.exists() else ""
        self._dirty, self._written = False, clock()

    def write(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
            return
        self._text += text
        self._dirty = True
        if self._clock() - self._written >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self._file is None and self._dirty:
            self.path.write_text(self._text, encoding="utf-8")
            self._dirty, self._written = False, self._clock()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()


def move_aside(source: epath.Path, target: epath.Path) -> None:
    """Rename a folder; on gs:// (no rename there) copy every object, then delete the source.

    A step's commit marker goes first, so a move cut short leaves a step that orbax no longer
    lists (`commit_success.txt` is how it tells a complete gs:// step), never a half-moved one
    that it would try to restore again.
    """
    if not is_remote(source):
        source.rename(target)
        return
    marker = source / COMMIT_MARKER
    if marker.exists():
        marker.unlink()
    source.rename(target)  # gcsfs: every object copied (or moved), then the source's removed
    forget_listings(source.parent)


def forget_listings(path: epath.Path) -> None:
    """Drop this process's cached listings (gcsfs keeps them): another process changed `path`."""
    if is_remote(path):
        backend.fsspec_backend.fs(os.fspath(path)).invalidate_cache()  # the client epath itself uses


def _reason(exc: BaseException, remote: bool) -> str:
    """A short account of why a write failed ('bucket does not exist (404)', 'PermissionError: ...')."""
    text = str(exc).strip().splitlines()
    detail = text[-1][:160] if text else type(exc).__name__
    if remote:
        if isinstance(exc, FileNotFoundError):
            return "bucket does not exist (404)"
        if "Forbidden" in str(exc) or isinstance(exc, PermissionError):
            return f"permission denied (403): {detail}"
        if "Bad Request" in str(exc):
            return f"request refused (400): {detail}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {detail}"


def probe(directory: epath.Path, name: str, *, keep: bool = False, content: str = "ok") -> str | None:
    """Write `content` to the file `directory/name` (and, unless `keep`, delete it); None, or a short reason
    it failed."""
    remote = is_remote(directory)
    try:
        make_dirs(directory)
        (directory / name).write_text(content)
        if not keep:
            (directory / name).unlink()
    except Exception as exc:  # noqa: BLE001 - each client has its own errors; all mean "cannot write here"
        return _reason(exc, remote)
    return None


def explain(path: str | os.PathLike[str], reason: str) -> str:
    """The one line for a run directory that cannot be written: expected, found, fix."""
    shown = os.fspath(path)
    if reason.startswith(NOT_A_NAME):
        return (f"--run-dir: expected a folder path or gs://BUCKET/FOLDER, found {shown}: {reason}. "
                "Fix: pass e.g. --run-dir runs/example or --run-dir gs://my-bucket/run1")
    if not is_remote(path):
        return (f"--run-dir: expected a folder the job can write, found {shown}: {reason}. "
                "Fix: create it and make it writable for the job's user, or pass another --run-dir")
    bucket = bucket_of(path)
    if "(404)" in reason:
        fix = (f"create it (gcloud storage buckets create gs://{bucket}) or pass an existing bucket, "
               f"and grant {BUCKET_ROLE} on it to the workers' service account")
    elif "(403)" in reason:
        fix = (f"grant {BUCKET_ROLE} on gs://{bucket} to the workers' service account "
               f"(gcloud storage buckets add-iam-policy-binding gs://{bucket} --member=serviceAccount:SA "
               f"--role={BUCKET_ROLE})")
    else:
        fix = (f"check that gs://{bucket} exists and that the workers' service account has {BUCKET_ROLE} "
               "on it, or pass another --run-dir")
    return f"--run-dir: expected a bucket the job can write, found {shown}: {reason}. Fix: {fix}"


def check_writable(path: str | os.PathLike[str]) -> str | None:
    """None when this process can create and delete an object (file) in `path`; else the one-line error."""
    problem = url_problem(os.fspath(path))
    if problem is not None:
        return explain(path, f"{NOT_A_NAME}: {problem}")
    reason = probe(run_path(path), f".job-probe-{socket.gethostname()}-{os.getpid()}")
    return None if reason is None else explain(path, reason)


def check_run_dir_command(argv: list[str]) -> int:
    """`python -m job check-run-dir URL`: exit 0 when this host can write URL, else print why and exit 2."""
    if len(argv) != 1:
        print("usage: python -m job check-run-dir RUN_DIR   (a folder or gs://BUCKET/FOLDER)", file=sys.stderr)
        return 2
    error = check_writable(argv[0])
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{argv[0]}: writable")
    return 0

