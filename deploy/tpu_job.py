"""The job on a READY slice: ship the code, set up every worker, run, collect logs, stop.

    run_job(cfg, runner)    # -> the job's exit status (worker 0's output streams meanwhile)
    fetch_logs(cfg, runner) # -> LOCAL_DIR/NAME/logs/worker-I.log, one per worker
    stop_job(cfg, runner)   # SIGTERM (the job saves, exits 75), SIGKILL after the grace period
"""

from __future__ import annotations

import fnmatch
import logging
import shlex
import tarfile
from pathlib import Path

from deploy import tpu_gcloud as gcloud
from deploy import tpu_remote as remote
from deploy.runner import Runner
from deploy.tpu_config import TpuConfig
from deploy.tpu_slice import TpuError

log = logging.getLogger("deploy.tpu")

ARCHIVE = "code.tar.gz"
STOP_MARKER = "stop-requested"  # written by stop_job: a stopped job is not restarted
_SKIP_DIRS = frozenset({"__pycache__", ".git", ".venv", ".pytest_cache"})
# Never shipped, not even from inside a shipped folder: names that usually hold a secret (as .dockerignore).
SECRET_NAMES = (".env", ".env.*", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.kdbx", "id_rsa*",
                "id_dsa*", "id_ecdsa*", "id_ed25519*", ".ssh", ".gnupg", ".aws", ".azure", ".docker", ".kube",
                ".netrc", ".git-credentials", ".pypirc", ".npmrc", "*credentials*.json", "*service-account*.json")


def _keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = Path(info.name).parts
    if any(p in _SKIP_DIRS or p.endswith(".egg-info") for p in parts) or info.name.endswith(".pyc"):
        return None
    if any(fnmatch.fnmatchcase(part, pattern) for part in parts for pattern in SECRET_NAMES):
        log.warning("not shipping %s: its name says it may hold a secret (keys, tokens, credentials)", info.name)
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_archive(cfg: TpuConfig) -> Path:
    """LOCAL_DIR/NAME/code.tar.gz with cfg.ship (paths under cfg.source_dir)."""
    path = cfg.slice_dir / ARCHIVE
    if cfg.dry_run:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = Path(cfg.source_dir)
    with tarfile.open(path, "w:gz") as tar:
        for entry in cfg.ship:
            tar.add(source / entry, arcname=entry, filter=_keep)
    return path


def prepare_workers(cfg: TpuConfig, runner: Runner) -> None:
    """Ship the code (or pull the image) and set up the environment on every worker."""
    if cfg.image:
        log.info("pulling %s on %d workers", cfg.image, cfg.workers)
    else:
        archive = build_archive(cfg)
        log.info("shipping %s (%s) to %d workers", ", ".join(cfg.ship), archive, cfg.workers)
        runner.run(gcloud.upload(cfg, str(archive), f"{cfg.remote_dir}.tar.gz"))
        log.info("setting up the environment on %d workers", cfg.workers)
    proc = runner.run(gcloud.ssh_all(cfg, remote.setup_script(cfg)), check=False)
    if proc.returncode != 0:
        raise TpuError(f"setting up the workers failed (exit code {proc.returncode}); the output above says "
                       "which worker and why. Fix it, or pass --setup to change what runs")


def run_job(cfg: TpuConfig, runner: Runner) -> int:
    """Prepare the workers, run `python -m job ARGS` on all of them; the job's exit status."""
    prepare_workers(cfg, runner)
    log.info("running `python -m job %s` on %d worker(s); streaming worker 0 (every log: %s)",
             shlex.join(cfg.job_args), cfg.workers, cfg.slice_dir / "logs")
    code = runner.run(gcloud.ssh_all(cfg, remote.run_script(cfg)), check=False).returncode
    if not cfg.dry_run:
        log.info("the job ended with exit code %d", code)
    return code


def fetch_logs(cfg: TpuConfig, runner: Runner) -> list[Path]:
    """Copy every worker's log to LOCAL_DIR/NAME/logs/worker-I.log; those that could be fetched."""
    folder = cfg.slice_dir / "logs"
    if not cfg.dry_run:
        folder.mkdir(parents=True, exist_ok=True)
    fetched = []
    for worker in range(cfg.workers):
        local = folder / f"worker-{worker}.log"
        proc = runner.run(gcloud.download(cfg, worker, f"{cfg.remote_dir}/{remote.LOG}", str(local)),
                          check=False, capture=True)
        if proc.returncode == 0:
            fetched.append(local)
        else:
            why = (proc.stderr or "").strip().splitlines()
            log.warning("could not fetch worker %d's log (exit code %d)%s", worker, proc.returncode,
                        f": {why[-1]}" if why else "")
    return fetched


def stop_requested(cfg: TpuConfig) -> bool:
    return (cfg.slice_dir / STOP_MARKER).exists()


def clear_stop(cfg: TpuConfig) -> None:
    if not cfg.dry_run:
        (cfg.slice_dir / STOP_MARKER).unlink(missing_ok=True)


def stop_job(cfg: TpuConfig, runner: Runner) -> int:
    """SIGTERM the job on every worker (it saves and exits 75); SIGKILL after cfg.stop_grace_s."""
    if not cfg.dry_run:
        cfg.slice_dir.mkdir(parents=True, exist_ok=True)
        (cfg.slice_dir / STOP_MARKER).write_text("a `tpu-stop` asked the job to stop; `tpu-pod` will not restart it\n")
    log.info("stopping the job on %d workers (SIGTERM, then SIGKILL after %d s)", cfg.workers, cfg.stop_grace_s)
    return runner.run(gcloud.ssh_all(cfg, remote.stop_script(cfg)), check=False).returncode
