"""What a run dir records so that the run can be repeated, and the command that repeats it.

    python -m job rerun RUN_DIR [NEW_RUN_DIR]        # make rerun RUN_DIR=runs/a [NEW=runs/a-again]

At every start (a first run and each resume) process 0 appends one attempt to
RUN_DIR/provenance.json: the exact command line, the working directory, the
code's git commit and a hash of its uncommitted diff (the diff itself goes to
RUN_DIR/code-ATTEMPT.diff), the task's own code (its module file, a hash of its
package's *.py files, that package's git commit and whether it has uncommitted
changes when it lives in a repository of its own, and PYTHONPATH), the lock
file's sha256, the Python and library versions, the JAX_* / XLA_* / NCCL_* /
TPU_* environment and the topology.
`rerun` replays the newest attempt's command into a new run dir, on this host,
as the same number of processes and devices, and first says how this checkout
differs from the recorded one (commit, diff, task package, PYTHONPATH, lock, versions).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.machinery
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from etils import epath

from job.core import flags, rundir, storage
from job.core.errors import ConfigError
from job.runtime import preflight
from job.runtime import cluster

RECORD = rundir.PROVENANCE
ROOT = Path(__file__).resolve().parents[2]  # the checkout (or image folder) the job package sits in
LOCKS = ("requirements.lock", "docker/requirements-cuda.lock", "docker/requirements-tpu.lock")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "tensorstore")
ENV_PREFIXES = ("JAX_", "XLA_", "NCCL_", "TPU_", "LIBTPU_", "CUDA_VISIBLE_DEVICES", "TF_CPP_")
# Set per process by whoever starts it (the launcher, srun, the TPU runtime): never replayed.
PER_PROCESS = cluster.PER_PROCESS | {"JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_PORT",
                                     "JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES"}
GIT_TIMEOUT_S = 10
UNTRACKED_FILES, UNTRACKED_BYTES = 100, 1 << 20  # new files up to this many and this size go into the diff
# A task package's walk stops at whichever comes first, so a huge folder (data, a checkout) beside the code
# cannot stall the start: folder entries looked at, *.py files hashed, their bytes. Past one: "complete": false.
TASK_ENTRIES, TASK_FILES, TASK_BYTES = 20_000, 2_000, 64 << 20
SKIPPED = "__pycache__"  # and every name starting with "." (.git, .venv, .ipynb_checkpoints)


def _git(*args: str, ok: tuple[int, ...] = (0,), at: Path = ROOT) -> str | None:
    """`git -C AT ARGS` output, or None outside a checkout (an image, a copied folder) or without git."""
    try:
        proc = subprocess.run(["git", "-C", str(at), *args], capture_output=True, text=True,
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


def jax_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that change what jax, XLA and the collectives do."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)}


def software() -> dict[str, Any]:
    """What the code runs on: Python, the libraries, the locks."""
    return {"python": platform.python_version(), "executable": sys.executable,
            "packages": {p: preflight.version(p) for p in PACKAGES},  # as preflight compares them
            "locks": {name: _sha256(ROOT / name) for name in LOCKS if (ROOT / name).exists()}}


def task_state(spec: str | None, env: Mapping[str, str], search: Sequence[str],
               loaded: Mapping[str, ModuleType]) -> dict[str, Any]:
    """The task's own code, for --task SPEC (None: the run named none): its module's file, its package with
    a hash of its *.py files (`complete`: false when the walk stopped at its bound), the package's git facts,
    and PYTHONPATH. The module is the one in `loaded` (what this process imported), else where an import
    from `search` would find it (nothing is imported)."""
    state: dict[str, Any] = {"spec": spec, "pythonpath": env.get("PYTHONPATH") or None}
    if spec is None:
        return state
    module = spec.partition(":")[0] if ":" in spec else f"job.tasks.{spec}.task"
    file, package, roots = _package(module, search, loaded)
    files, complete = _python_files(roots)
    folder = None if not roots else roots[0] if roots[0].is_dir() else roots[0].parent
    state.update(module=module, file=file, package=package, paths=[str(r) for r in roots], files=len(files),
                 sha256=_digest(files) if roots else None, complete=complete,
                 git=None if folder is None else _package_git(folder))
    return state


def _package(module: str, search: Sequence[str], loaded: Mapping[str, ModuleType]) -> tuple[
        str | None, str, list[Path]]:
    """(the module's file, its package's name, that package's folders or file): the top-level package, but
    for a task of the template's own job/tasks/ its folder there (the rest of job/ is no part of it)."""
    file, roots = _origin(module, search, loaded)
    parts = module.split(".")
    if parts[:2] != ["job", "tasks"] or len(parts) < 3:
        return file, parts[0], roots
    folders = [p for r in roots for p in (r / "tasks" / parts[2], r / "tasks" / f"{parts[2]}.py") if p.exists()]
    return file, ".".join(parts[:3]), folders


def _origin(module: str, search: Sequence[str], loaded: Mapping[str, ModuleType]) -> tuple[str | None, list[Path]]:
    """(the module's file, the folders of its top-level package, or its file for a single module)."""
    top = loaded.get(module.split(".")[0])
    if module in loaded and top is not None:
        places = list(getattr(top, "__path__", None) or [getattr(top, "__file__", None)])
        return getattr(loaded[module], "__file__", None), [Path(p) for p in places if p]
    parts, path, spec = module.split("."), list(search), None
    roots: list[Path] = []
    for depth in range(1, len(parts) + 1):
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), path)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None, roots
        if depth == 1:
            roots = [Path(p) for p in spec.submodule_search_locations or ([spec.origin] if spec.origin else [])]
        path = list(spec.submodule_search_locations or [])
    return spec.origin if spec is not None else None, roots


def _python_files(roots: Sequence[Path]) -> tuple[list[tuple[str, Path]], bool]:
    """(name under its root, path) of every *.py file under `roots`, depth first in name order, and whether
    the walk saw them all (it stops at TASK_ENTRIES, TASK_FILES or TASK_BYTES; see SKIPPED)."""
    found: list[tuple[str, Path]] = []
    looked = size = 0
    for root in sorted(roots):
        if not root.is_dir():
            found.append((root.name, root))
            continue
        stack = [root]
        while stack:
            folder = stack.pop()
            try:
                with os.scandir(folder) as listing:  # read no further than the budget left
                    entries = sorted(itertools.islice(listing, TASK_ENTRIES - looked + 1), key=lambda e: e.name)
            except OSError:
                continue
            looked += len(entries)
            if looked > TASK_ENTRIES:
                return found, False
            entries = [e for e in entries if e.name != SKIPPED and not e.name.startswith(".")]
            for entry in entries:
                if entry.name.endswith(".py") and entry.is_file():
                    size += entry.stat().st_size
                    if len(found) >= TASK_FILES or size > TASK_BYTES:
                        return found, False
                    found.append((Path(entry.path).relative_to(root).as_posix(), Path(entry.path)))
            stack.extend(Path(e.path) for e in reversed(entries) if e.is_dir(follow_symlinks=False))
    return found, True


def _digest(files: Sequence[tuple[str, Path]]) -> str:
    """One hash of the files' names and contents, in the order given."""
    digest = hashlib.sha256()
    for name, path in files:
        try:
            content = path.read_bytes()
        except OSError:
            content = b"unreadable"
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()[:16]


def _package_git(folder: Path) -> dict[str, Any] | str | None:
    """None outside a git repository; "template" in the template's own (its "code" entry covers it); else
    {"root", "commit" (None before the first), "dirty" (uncommitted changes; None if git could not say)}."""
    top = _git("rev-parse", "--show-toplevel", at=folder)
    if top is None:
        return None
    if top.strip() == (_git("rev-parse", "--show-toplevel") or "").strip():
        return "template"
    commit, status = _git("rev-parse", "HEAD", at=folder), _git("status", "--porcelain", at=folder)
    return {"root": top.strip(), "commit": commit.strip() if commit else None,
            "dirty": None if status is None else bool(status.strip())}


def replay_search(cwd: str, env: Mapping[str, str]) -> list[str]:
    """Where a replay run in `cwd` with `env` imports from: `python -m` puts its working directory first,
    then PYTHONPATH (relative entries from that directory), then this interpreter's own paths."""
    entries = [os.path.join(cwd, p) for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
    return [cwd, *entries, *sys.path[1:]]


def attempt(argv: Sequence[str] | None, topology: Mapping[str, Any], env: Mapping[str, str] | None = None,
            task: str | None = None) -> tuple[dict[str, Any], str]:
    """One attempt's record, and the uncommitted diff (written beside it). `task`: the --task the run trains
    (NAME or MODULE:ATTR); None: the one `argv` gives, if any."""
    code, diff = code_state()
    env = os.environ if env is None else env
    spec = task if task is not None or argv is None else flags.value(argv, "--task")
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": None if argv is None else list(argv),  # python -m job ARGV; None: another entry point
        "command": shlex.join(sys.orig_argv),  # exactly as this process was started
        "cwd": os.getcwd(),
        "code": code,
        "task": task_state(spec, env, sys.path, sys.modules),  # its module is imported: that one is hashed
        **software(),
        "env": jax_variables(env),
        "topology": dict(topology),
    }, diff


def record(run_dir: epath.Path, argv: Sequence[str] | None, topology: Mapping[str, Any],
           task: str | None = None) -> dict[str, Any]:
    """Append this attempt to RUN_DIR/provenance.json (process 0 calls it); returns the attempt."""
    entry, diff = attempt(argv, topology, task=task)
    path = rundir.provenance(run_dir)
    try:
        attempts = json.loads(path.read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        attempts = []
    storage.make_dirs(run_dir)
    if diff:
        entry["code"]["diff_file"] = rundir.code_diff(len(attempts))
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
    lines += task_differences(recorded.get("task"), now.get("task"))
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


def task_differences(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[str]:
    """The task package's and PYTHONPATH's lines of `differences` (none for a run recorded before they were)."""
    if not old:
        return []
    new, lines, changed = new or {}, [], []
    if old.get("paths") and not new.get("paths"):
        changed.append(f"not found here (recorded at {', '.join(old['paths'])}; the replay imports it from the "
                       "recorded working directory, then PYTHONPATH)")
    elif old.get("spec"):
        if old.get("file") != new.get("file"):
            changed.append(f"its module is {new.get('file')} here (recorded {old.get('file')})")
        if old.get("sha256") != new.get("sha256"):
            changed.append(f"its files changed since the run (hash {old.get('sha256') or 'none'} -> "
                           f"{new.get('sha256') or 'none'})")
        changed += _git_differences(old.get("git"), new.get("git"))
    if changed:
        lines.append(f"task package {old.get('package') or old['spec']}: " + "; ".join(changed))
    if old.get("pythonpath") != new.get("pythonpath"):
        lines.append(f"PYTHONPATH: recorded {old.get('pythonpath') or 'unset'}, "
                     f"here {new.get('pythonpath') or 'unset'}")
    return lines


def _fact(git: object, key: str) -> Any:
    """A git fact of a task package: only a package in a repository of its own has them."""
    return git.get(key) if isinstance(git, Mapping) else None


def _git_differences(old: object, new: object) -> list[str]:
    """A task package's commit and uncommitted changes, where either record has them (its own repository)."""
    changed = []
    if _fact(old, "commit") != _fact(new, "commit"):
        changed.append(f"its commit {(_fact(old, 'commit') or 'none')[:12]} -> "
                       f"{(_fact(new, 'commit') or 'none')[:12]}")
    if None not in (_fact(old, "dirty"), _fact(new, "dirty")) and _fact(old, "dirty") != _fact(new, "dirty"):
        said = {True: "some", False: "none"}
        changed.append(f"uncommitted changes in its repository: {said[_fact(old, 'dirty')]} at the run, "
                       f"{said[_fact(new, 'dirty')]} here")
    return changed


def changes(entry: Mapping[str, Any], cwd: str, env: Mapping[str, str]) -> list[str]:
    """How this checkout differs from the one that ran `entry`, the task's package as a replay in `cwd` with
    `env` would import it."""
    spec = (entry.get("task") or {}).get("spec")
    now = {"code": code_state()[0], **software(), "task": task_state(spec, env, replay_search(cwd, env), {})}
    return differences(entry, now)


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
    cwd = entry.get("cwd") if entry.get("cwd") and Path(entry["cwd"]).is_dir() else None
    env = replay_environment(entry, os.environ)
    differ = changes(entry, cwd or os.getcwd(), env)
    if differ:
        print(f"rerun: this checkout differs from the one that ran {source}:\n  " + "\n  ".join(differ),
              file=sys.stderr, flush=True)
    else:
        print(f"rerun: same commit, uncommitted changes, task package, PYTHONPATH, locks and versions as {source}",
              file=sys.stderr, flush=True)
    command = replay_command(entry, target)
    print(f"rerun: {shlex.join(command)}", file=sys.stderr, flush=True)
    return subprocess.run(command, env=env, cwd=cwd, check=False).returncode
