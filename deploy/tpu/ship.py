"""What `make tpu-pod` copies to every worker: the template, SHIP, and the package of every task the run names.

    cfg = resolved(cfg)    # cfg.ship: ('job', 'deploy', ..., 'README.md', 'data', 'mypkg'): SHIP, then each task's
    describe(cfg)          # 'job, deploy, ... and mypkg (--task mypkg.tasks:TASK)': the doctor's `code` line

The workers run `python -m job` in the unpacked folder, the only folder of theirs on the import path besides the
installed dependencies. So a task MODULE:ATTR (ARGS', and with SWEEP every run's) reaches them when MODULE's
top-level package (or module) is a file or folder of the source folder: it is shipped with the template. A task
NAME lives in job/tasks/ and ships with job/. A task whose top-level package is anywhere else (another folder on
PYTHONPATH, site-packages), or whose module file would be left out of the archive (`skipped`: caches, bytecode,
names that say they hold a secret), is a ConfigError naming it and the fix before anything is created; one
installed from requirements.lock is installed on every worker by the set-up, so it needs nothing. With IMAGE
nothing is shipped: the image must hold the package (`image_check` where this machine has the image; every worker
checks it after its pull, deploy/tpu/remote.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.machinery
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from deploy.runner import Runner
from deploy.tpu.config import TpuConfig
from job.core import flags
from job.core.errors import ConfigError
from job.runs import sweep as sweeps

TEMPLATE = "job"  # the template's own package: a task NAME (job/tasks/NAME) ships with it
DOCS = "docs/tpu.md#your-own-package"
# Never shipped, not even from inside a shipped folder: caches, and names that usually hold a secret (as
# .dockerignore).
SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".venv", ".pytest_cache"})
SECRET_NAMES = (".env", ".env.*", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.kdbx", "id_rsa*",
                "id_dsa*", "id_ecdsa*", "id_ed25519*", ".ssh", ".gnupg", ".aws", ".azure", ".docker", ".kube",
                ".netrc", ".git-credentials", ".pypirc", ".npmrc", "*credentials*.json", "*service-account*.json")
# Run in the image (`python -c CODE MODULE...`): prints the modules it lacks, exits 3 when any.
FIND_IN_IMAGE = ("import importlib.util as u, sys; missing = [m for m in sys.argv[1:] if u.find_spec(m) is None]; "
                 "print(' '.join(missing)); sys.exit(3 if missing else 0)")
MISSING_IN_IMAGE = 3
IMAGE_FIX = ("copy each into the image beside job/ (docker/Dockerfile: COPY mypkg /opt/job/mypkg, on the image's "
             "PYTHONPATH) and push it again, or leave IMAGE empty to ship the code")
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def secret_like(parts: Sequence[str]) -> bool:
    """Whether a path's name (or a folder's on the way to it) says it may hold a secret."""
    return any(fnmatch.fnmatchcase(part, pattern) for part in parts for pattern in SECRET_NAMES)


def left_out(parts: Sequence[str]) -> str | None:
    """Why a path (its parts under the source folder) is left out of the archive, or None when it is shipped."""
    if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts):
        return "a cache or tool folder, never shipped"
    if parts and parts[-1].endswith(".pyc"):
        return "compiled bytecode (.pyc), never shipped: the .py source is"
    if secret_like(parts):
        return "its name says it may hold a secret (keys, tokens, credentials), never shipped"
    return None


def task_specs(cfg: TpuConfig) -> tuple[str, ...]:
    """Every --task MODULE:ATTR the run names: ARGS', and with SWEEP each run's. A SWEEP that does not parse adds
    none (the doctor's run line, and tpu-pod's check of every run, say why)."""
    runs = [cfg.job_args]
    if cfg.sweep is not None:
        try:
            runs += [run.flags for run in sweeps.plan(cfg.sweep, cfg.job_args).runs]
        except ConfigError:
            pass
    specs = (flags.value(args, "--task") for args in runs)
    return tuple(dict.fromkeys(spec for spec in specs if spec and ":" in spec))


def image_modules(cfg: TpuConfig) -> tuple[str, ...]:
    """The top-level packages the image must hold besides job: one per task MODULE:ATTR outside the template."""
    tops = (spec.partition(":")[0].split(".")[0] for spec in task_specs(cfg))
    return tuple(dict.fromkeys(top for top in tops if top and top != TEMPLATE))


def _find(module: str, where: Sequence[str]) -> Path | None:
    """The file of `module` (a namespace package: its folder) on the import path `where`, found as an import would
    find it, without importing anything; None when it is not there."""
    parts, path, found = module.split("."), list(where), None
    for depth in range(1, len(parts) + 1):
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), path)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
        found = Path(spec.origin) if spec.has_location and spec.origin else Path(path[0]) if path else None
    return found


def _locked(top: str, source: Path) -> str | None:
    """The distribution of requirements.lock that installs the top-level package `top` here, or None."""
    try:
        lock = (source / "requirements.lock").read_text()
    except OSError:
        return None
    pinned = {m.group(1).lower().replace("_", "-") for m in map(_REQUIREMENT.match, lock.splitlines()) if m}
    dists = importlib.metadata.packages_distributions().get(top, [])
    return next((d for d in dists if d.lower().replace("_", "-") in pinned), None)


def _task_path(cfg: TpuConfig, spec: str) -> str | None:
    """The top-level entry of the source folder that holds the task's module (ships it), or None when the task
    needs nothing shipped (in job/, or installed from the lock); ConfigError when it would not reach the workers."""
    module = spec.partition(":")[0]
    top = module.split(".")[0]
    source = Path(cfg.source_dir)
    what, here = f"ARGS --task {spec}", source.resolve()
    if top == TEMPLATE:
        return None
    if _find(top, [str(source)]) is None:
        where = _find(top, sys.path)
        if where is not None and _locked(top, source) is not None:
            return None
        shown = where.parent if where is not None and where.name == "__init__.py" else where
        raise ConfigError(
            what, expected=f"its top-level package {top} at the top of the source folder {here} ({top}/ or {top}.py "
            "there: what make tpu-pod ships beside job/; the workers import from that folder only)",
            found=f"{top} at {shown}" if shown is not None else f"{top} neither in {here} nor on the import path "
            "here", fix=f"move (or copy) {top} to {here / top}: it is then shipped with the template; or pin "
            f"it in requirements.lock, or run an IMAGE that holds it ({DOCS})")
    found = _find(module, [str(source)])
    relative = Path(os.path.relpath(found, source)).parts if found is not None else (top,)
    why = ("a symbolic link: it would be shipped as the link, without its files" if (source / relative[0]).is_symlink()
           else f"no file of {module} in it" if found is None else left_out(relative))
    if why is not None:
        raise ConfigError(what, expected=f"the module {module} in a file that make tpu-pod ships",
                          found=f"{'/'.join(relative)}: {why}",
                          fix=f"keep the module's .py file in {top} under a name that ships (not a link, cache or "
                              f"secret-like name; {DOCS})")
    return relative[0]


def resolved(cfg: TpuConfig) -> TpuConfig:
    """cfg with `ship` holding everything the workers get: the template, SHIP, then the package of each task the run
    names (once); with IMAGE, cfg as it is (nothing is shipped). ConfigError as `_task_path` says."""
    if cfg.image:
        return cfg
    extra = (_task_path(cfg, spec) for spec in task_specs(cfg))
    paths = tuple(dict.fromkeys((*cfg.ship, *cfg.also_ship, *(p for p in extra if p is not None))))
    return dataclasses.replace(cfg, ship=paths, also_ship=())


def describe(cfg: TpuConfig, runner: Runner) -> str:
    """The doctor's `code` line: what is shipped, each task's package named; with IMAGE, `image_check`."""
    if cfg.image:
        return image_check(cfg, runner)
    shipped = resolved(cfg)
    tasks = {_task_path(cfg, spec): spec for spec in task_specs(cfg)}
    names = [f"{p} (--task {tasks[p]})" if p in tasks else f"{p} (SHIP)" if p in cfg.also_ship else p
             for p in shipped.ship]
    return f"ships {', '.join(names)} to every worker"


def image_check(cfg: TpuConfig, runner: Runner) -> str:
    """With IMAGE: the image holds every task's top-level package, checked in the image when this machine has it
    (docker or podman); otherwise what the workers check after their pull."""
    modules = image_modules(cfg)
    if not modules:
        return f"IMAGE {cfg.image}: the tasks are the template's own (job/ is in the image); nothing is shipped"
    later = f"every worker checks that it holds {', '.join(modules)} after its pull"
    engine = runner.which("docker") or runner.which("podman")
    if engine is None:
        return f"IMAGE {cfg.image}: not checked here (no docker or podman on this machine); {later}"
    image = cfg.image or ""
    if runner.run([engine, "image", "inspect", image], check=False, capture=True, mutating=False,
                  timeout=60).returncode != 0:
        return f"IMAGE {cfg.image}: not checked here (not on this machine: `docker pull` it to check here); {later}"
    proc = runner.run([engine, "run", "--rm", "--network=none", "--entrypoint", "python", image, "-c", FIND_IN_IMAGE,
                       *modules], check=False, capture=True, mutating=False, timeout=300)
    if proc.returncode == MISSING_IN_IMAGE:
        raise ConfigError("IMAGE (--image)", expected=f"an image holding the tasks' packages {', '.join(modules)} "
                          "(with IMAGE nothing is shipped: the job imports them in the container)",
                          found=f"{cfg.image} has no {(proc.stdout or '').strip()}", fix=IMAGE_FIX)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout or "").strip().splitlines()
        return (f"IMAGE {cfg.image}: not checked here ({Path(engine).name} run exited {proc.returncode}"
                f"{': ' + said[-1] if said else ''}); {later}")
    return f"IMAGE {cfg.image} holds {', '.join(modules)} (looked up in the image on this machine)"
