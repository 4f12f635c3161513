"""What a run dir records so that the run can be repeated, and the command that repeats it.

    python -m job rerun RUN_DIR [NEW_RUN_DIR]        # make rerun RUN_DIR=runs/a [NEW=runs/a-again]

At every start (a first run and each resume) process 0 appends one attempt to
RUN_DIR/provenance.json: the exact command line, the working directory, the
code's git commit and a hash of its uncommitted diff (the diff itself goes to
RUN_DIR/code-ATTEMPT.diff), the lock file's sha256, the Python and library
versions, the JAX_* / XLA_* / NCCL_* / TPU_* environment and the topology.
`rerun` replays the newest attempt's command into a new run dir, on this host,
as the same number of processes and devices, and first says how this checkout
differs from the recorded one (commit, diff, lock, versions).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from etils import epath

from job.core import flags, storage
from job.core.errors import ConfigError
from job.runtime import preflight
from job.runtime.cluster.local import COORDINATOR, NUM_PROCESSES, PROCESS_ID

RECORD = "provenance.json"
ROOT = Path(__file__).resolve().parents[2]  # the checkout (or image folder) the job package sits in
LOCKS = ("requirements.lock", "docker/requirements-cuda.lock", "docker/requirements-tpu.lock")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "tensorstore")
ENV_PREFIXES = ("JAX_", "XLA_", "NCCL_", "TPU_", "LIBTPU_", "CUDA_VISIBLE_DEVICES", "TF_CPP_")
# Set per process by whoever starts it (the launcher, srun, the TPU runtime): never replayed.
PER_PROCESS = frozenset({COORDINATOR, NUM_PROCESSES, PROCESS_ID, "JAX_COORDINATOR_ADDRESS",
                         "JAX_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS",
                         "TPU_WORKER_ID", "CUDA_VISIBLE_DEVICES"})
GIT_TIMEOUT_S = 10
UNTRACKED_FILES, UNTRACKED_BYTES = 100, 1 << 20  # new files up to this many and this size go into the diff


def _git(*args: str, ok: tuple[int, ...] = (0,)) -> str | None:
    """`git -C ROOT ARGS` output, or None outside a checkout (an image, a copied folder) or without git."""
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode in ok else None


def code_state() -> tuple[dict[str, Any], str]:
    """({"commit", "diff_sha256", "untracked"} or {} outside git, the uncommitted diff against that commit,
    new files not yet added to git included)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {}, ""
    diff = _git("diff", "HEAD", "--binary") or ""
    untracked = (_git("ls-files", "--others", "--exclude-standard") or "").split()
    for name in untracked[:UNTRACKED_FILES]:
        if (ROOT / name).is_file() and (ROOT / name).stat().st_size <= UNTRACKED_BYTES:
            diff += _git("diff", "--no-index", "--binary", "/dev/null", name, ok=(0, 1)) or ""
    return {"commit": commit.strip(), "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16],
            "untracked": untracked}, diff


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that change what jax, XLA and the collectives do."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)}


def software() -> dict[str, Any]:
    """What the code runs on: Python, the libraries, the locks."""
    return {"python": platform.python_version(), "executable": sys.executable,
            "packages": {p: preflight.version(p) for p in PACKAGES},  # as preflight compares them
            "locks": {name: _sha256(ROOT / name) for name in LOCKS if (ROOT / name).exists()}}


def attempt(argv: Sequence[str] | None, topology: Mapping[str, Any], env: Mapping[str, str] | None = None) -> tuple[
        dict[str, Any], str]:
    """One attempt's record, and the uncommitted diff (written beside it)."""
    code, diff = code_state()
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": None if argv is None else list(argv),  # python -m job ARGV; None: another entry point
        "command": shlex.join(sys.orig_argv),  # exactly as this process was started
        "cwd": os.getcwd(),
        "code": code,
        **software(),
        "env": environment(os.environ if env is None else env),
        "topology": dict(topology),
    }, diff


def record(run_dir: epath.Path, argv: Sequence[str] | None, topology: Mapping[str, Any]) -> dict[str, Any]:
    """Append this attempt to RUN_DIR/provenance.json (process 0 calls it); returns the attempt."""
    entry, diff = attempt(argv, topology)
    path = run_dir / RECORD
    try:
        attempts = json.loads(path.read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        attempts = []
    storage.make_dirs(run_dir)
    if diff:
        entry["code"]["diff_file"] = f"code-{len(attempts)}.diff"
        (run_dir / entry["code"]["diff_file"]).write_text(diff)
    attempts.append(entry)
    path.write_text(json.dumps({"attempts": attempts}, indent=2) + "\n")
    return entry


def differences(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """How this checkout and environment differ from a recorded attempt, one line each."""
    lines = []
    old, new = recorded.get("code") or {}, now.get("code") or {}
    if old.get("commit") != new.get("commit"):
        lines.append(f"commit: recorded {old.get('commit') or 'none (not a git checkout)'}, "
                     f"here {new.get('commit') or 'none (not a git checkout)'}")
    elif old.get("diff_sha256") != new.get("diff_sha256"):
        lines.append(f"uncommitted changes differ (recorded diff {old.get('diff_sha256')}, here "
                     f"{new.get('diff_sha256')}; the recorded one is {old.get('diff_file') or 'empty'})")
    for name in sorted(set(recorded.get("locks", {})) | set(now.get("locks", {}))):
        if recorded.get("locks", {}).get(name) != now.get("locks", {}).get(name):
            lines.append(f"{name}: recorded sha256 {recorded.get('locks', {}).get(name)}, "
                         f"here {now.get('locks', {}).get(name)}")
    if recorded.get("python") != now.get("python"):
        lines.append(f"python: recorded {recorded.get('python')}, here {now.get('python')}")
    for package, version in sorted((recorded.get("packages") or {}).items()):
        if (now.get("packages") or {}).get(package) != version:
            lines.append(f"{package}: recorded {version}, here {(now.get('packages') or {}).get(package)}")
    return lines


def with_run_dir(argv: Sequence[str], run_dir: str) -> list[str]:
    """`argv` with its --run-dir (any spelling, every time given) replaced by `run_dir` once, or added after
    the command."""
    return flags.with_value(argv, "--run-dir", run_dir)


def replay_command(entry: Mapping[str, Any], new_run_dir: str, python: str = sys.executable) -> list[str]:
    """The launcher command that repeats `entry` on this host, as its processes x devices."""
    topology = entry.get("topology") or {}
    processes, devices = int(topology.get("processes", 1)), int(topology.get("local_devices", 1))
    job = [python, "-m", "job", *with_run_dir(entry["argv"], new_run_dir)]
    return [python, "-m", "job.launch", "-n", str(processes), "--devices-per-process", str(devices), "--", *job]


def replay_environment(entry: Mapping[str, Any], base: Mapping[str, str]) -> dict[str, str]:
    """This environment with the recorded JAX/XLA/NCCL variables put back (not the per-process ones)."""
    env = dict(base)
    env.update({k: v for k, v in (entry.get("env") or {}).items() if k not in PER_PROCESS})
    return env


def _refuse(what: str, expected: str, found: object, fix: str) -> int:
    print(f"error: {ConfigError(what, expected=expected, found=found, fix=fix)}", file=sys.stderr)
    return 2


def rerun_command(argv: list[str]) -> int:
    """`python -m job rerun RUN_DIR [NEW_RUN_DIR]`: replay RUN_DIR's newest attempt into a new run dir."""
    if not 1 <= len(argv) <= 2 or any(arg.startswith("-") for arg in argv):
        return _refuse("python -m job rerun", expected="RUN_DIR [NEW_RUN_DIR]", found=shlex.join(argv),
                       fix="python -m job rerun runs/example runs/example-again (or make rerun RUN_DIR=... NEW=...)")
    source = storage.run_path(argv[0])
    try:
        entry = json.loads((source / RECORD).read_text())["attempts"][-1]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return _refuse(str(source / RECORD), expected="the record every training run writes",
                       found=f"{type(exc).__name__}: {exc}", fix="pass the run dir of a python -m job train run")
    if entry.get("argv") is None:
        return _refuse(str(source / RECORD), expected="a run started by python -m job train",
                       found=f"a run started by another program: {entry.get('command')}",
                       fix="run that program again with a new run dir")
    target = argv[1] if len(argv) == 2 else f"{str(source).rstrip('/')}-rerun-{int(time.time())}"
    if not storage.is_remote(target):
        target = os.path.abspath(target)  # the replay runs in the recorded working directory
    if storage.run_path(target).exists() and any(storage.run_path(target).iterdir()):
        return _refuse("NEW_RUN_DIR", expected="a new or empty folder", found=target,
                       fix="pass another NEW_RUN_DIR, or leave it out for RUN_DIR-rerun-TIME")
    differ = differences(entry, {"code": code_state()[0], **software()})
    if differ:
        print(f"rerun: this checkout differs from the one that ran {source}:\n  " + "\n  ".join(differ),
              file=sys.stderr, flush=True)
    else:
        print(f"rerun: same commit, uncommitted changes, locks and versions as {source}", file=sys.stderr, flush=True)
    command = replay_command(entry, target)
    cwd = entry.get("cwd") if entry.get("cwd") and Path(entry["cwd"]).is_dir() else None
    print(f"rerun: {shlex.join(command)}", file=sys.stderr, flush=True)
    return subprocess.run(command, env=replay_environment(entry, os.environ), cwd=cwd, check=False).returncode
