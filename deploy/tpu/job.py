"""The job on a READY slice: ship the code, set up every worker, start it detached, follow it, stop it.

    run_job(cfg, runner)    # -> the job's exit status (worker 0's output streams meanwhile)
    fetch_logs(cfg, runner) # -> LOCAL_DIR/NAME/logs/worker-I.log, one per worker
    stop_job(cfg, runner)   # SIGTERM (the job saves, exits 75), SIGKILL after the grace period

The job runs detached on the workers (see `tpu_remote`): the ssh that follows
worker 0's log may drop and be opened again while the job goes on. With
several slices (multislice) they are NAME-0 .. NAME-{N-1}, every worker of
every slice runs the job, and worker I of slice S keeps its log as
worker-{S*W+I}.log (its JAX process index).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from deploy.runner import Runner
from deploy.tpu import gcloud, remote, ship, wheels
from deploy.tpu.config import TpuConfig, run_dir_of
from deploy.tpu.slice import Slice, TpuError

log = logging.getLogger("deploy.tpu")

ARCHIVE = "code.tar.gz"
STOP_MARKER = "stop-requested"  # written by stop_job: a stopped job is not restarted
SSH_LOST = 255  # what gcloud's ssh returns when the connection drops
BACKOFF_FIRST_S = 1.0  # re-attaching after a drop waits 1, 2, 4, ... seconds
BACKOFF_MAX_S = 30.0  # ... at most this; a session that lasted longer resets the backoff
REATTACH_LIMIT = 10  # consecutive quick ssh failures before giving up following (the job keeps running)
PROBE_TRIES = 5  # asking worker 0 whether a job runs: ssh failures before it is an error
REATTACH_LINES = 20  # a re-attached follow starts this many lines back
BUCKET_ROLE = "roles/storage.objectAdmin"  # what the job needs on a gs:// run dir's bucket
MEGASCALE_PORT = "8080"  # multislice: the port of the coordinator on worker 0 of slice 0, as the runtime uses


def _keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = Path(info.name).parts
    if ship.left_out(parts) is not None:
        if ship.secret_like(parts):
            log.warning("not shipping %s: its name says it may hold a secret (keys, tokens, credentials)", info.name)
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def ssh_worker(cfg: TpuConfig, node: str, worker: int, script: str) -> list[str]:
    """`ssh --worker=N`: the same argv as every other ssh of the launcher, on one worker."""
    argv = gcloud.ssh_all(cfg, script, node)
    argv[argv.index("--worker=all")] = f"--worker={worker}"
    return argv


def multislice_env(cfg: TpuConfig, runner: Runner) -> list[dict[str, str]]:
    """The MEGASCALE_* variables of each slice: the coordinator is worker 0 of slice 0."""
    names = cfg.slice_names
    argv = _describe(cfg, names[0], "json")
    proc = runner.run(argv, check=False, capture=True, mutating=False)
    try:
        address = json.loads(proc.stdout)["networkEndpoints"][0]["ipAddress"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        if not cfg.dry_run:
            raise TpuError(f"could not read worker 0's address of {names[0]} (`{shlex.join(argv[:6])} ...` "
                           f"exit code {proc.returncode}: {(proc.stderr or '').strip()})") from e
        address = f"<address of worker 0 of {names[0]}>"  # what gcloud would say: a dry run's placeholder
    return [{"MEGASCALE_COORDINATOR_ADDRESS": f"{address}:{MEGASCALE_PORT}", "MEGASCALE_NUM_SLICES": str(len(names)),
             "MEGASCALE_SLICE_ID": str(slice_id), "MEGASCALE_PORT": MEGASCALE_PORT} for slice_id in range(len(names))]


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
    """Ship the code (or pull the image) and set up the environment on every worker of every slice."""
    if cfg.image:
        log.info("pulling %s on %d workers", cfg.image, cfg.workers * len(cfg.slice_names))
    else:
        archive = build_archive(cfg)
        log.info("shipping %s (%s) to %d workers", ", ".join(cfg.ship), archive,
                 cfg.workers * len(cfg.slice_names))
        wheelhouse = wheels.build_archive(cfg) if cfg.wheelhouse is not None else None
        for name in cfg.slice_names:
            runner.run(gcloud.upload(cfg, str(archive), f"{cfg.remote_dir}.tar.gz", name))
            if wheelhouse is not None:
                wheels.upload(cfg, runner, name, wheelhouse)
        log.info("setting up the environment on every worker%s",
                 f" from the wheelhouse {cfg.wheelhouse} (no package index)" if wheelhouse is not None else "")
    for name in cfg.slice_names:
        proc = runner.run(gcloud.ssh_all(cfg, remote.setup_script(cfg), name), check=False)
        if proc.returncode != 0:
            raise TpuError(f"setting up the workers of {name} failed (exit code {proc.returncode}); the output "
                           "above says which worker and why. Fix it, or pass --setup to change what runs")


def run_job(cfg: TpuConfig, runner: Runner, *, sleep: Callable[[float], None] | None = None) -> int:
    """Start `python -m job ARGS` detached on every worker (or attach to the one still running), follow
    worker 0's log until it ends, re-attaching after a dropped connection; the job's exit status."""
    state = probe(cfg, runner, sleep=sleep)
    if state.running:
        log.info("a job is already running on %s: attaching to it instead of starting another "
                 "(`make tpu-stop` stops it)", cfg.name)
    else:
        prepare_workers(cfg, runner)
        check_bucket_access(cfg, runner)
        start(cfg, runner)
    code = follow(cfg, runner, sleep=sleep)
    if not cfg.dry_run and code != SSH_LOST:
        log.info("the job ended with exit code %d", code)
    return code


def _describe(cfg: TpuConfig, name: str, fmt: str) -> list[str]:
    """`tpu-vm describe NAME --format=FMT`, otherwise as the launcher's own describe."""
    return [a if not a.startswith("--format=") else f"--format={fmt}" for a in gcloud.describe_node(cfg, name)]


def check_bucket_access(cfg: TpuConfig, runner: Runner) -> None:
    """A gs:// run dir: every worker must be able to write there (`python -m job check-run-dir URL`, one
    ssh per slice); otherwise one error naming the slice's service account and the grant that fixes it."""
    url = run_dir_of(cfg.job_args)
    if url is None or not url.startswith("gs://"):
        return
    log.info("checking that every worker can write to %s", url)
    for name in cfg.slice_names:
        proc = runner.run(gcloud.ssh_all(cfg, remote.check_run_dir_script(cfg, url), name), check=False,
                          capture=True)
        if proc.returncode == 0:
            continue
        said = [text for _, text in sorted(_reason(line) for line in (proc.stderr or "").splitlines()
                                           if line.startswith("worker "))]
        account = runner.run(_describe(cfg, name, "value(serviceAccount.email)"), check=False, capture=True,
                             mutating=False)
        email = (account.stdout or "").strip() if account.returncode == 0 else ""
        bucket = "gs://" + url[len("gs://"):].split("/", 1)[0]
        raise TpuError(
            f"the workers of {name} cannot write to {url}: expected the run dir writable by the slice's service "
            f"account {email or '(unknown: `gcloud compute tpus tpu-vm describe` did not say)'}, found "
            f"{said[0] if said else f'exit code {proc.returncode}'}. Fix: gcloud storage buckets "
            f"add-iam-policy-binding {bucket} --member=serviceAccount:{email or 'SERVICE_ACCOUNT'} "
            f"--role={BUCKET_ROLE} (create the bucket first if it does not exist, or pick another BUCKET)")


def _reason(line: str) -> tuple[int, str]:
    """`worker 1: error: --run-dir: expected ..., found URL: why. Fix: ...` -> (1, `worker 1: URL: why`)."""
    worker, _, text = line.partition(": ")
    number = worker.split()[-1]
    return int(number) if number.isdigit() else 0, f"{worker}: {text.split('. Fix:')[0].rsplit('found ', 1)[-1]}"


def start(cfg: TpuConfig, runner: Runner) -> None:
    """Start the job detached on all workers of every slice: one short ssh per slice."""
    names = cfg.slice_names
    log.info("starting `python -m job %s` on %d worker(s), detached (every log: %s)",
             shlex.join(cfg.job_args), cfg.workers * len(names), cfg.slice_dir / "logs")
    envs = multislice_env(cfg, runner) if len(names) > 1 else [None]
    for name, env in zip(names, envs):
        script = remote.start_script(cfg, env)
        proc = runner.run(gcloud.ssh_all(cfg, script, name), check=False)
        if proc.returncode != 0:
            raise TpuError(f"starting the job on {name} failed (exit code {proc.returncode}); the output above "
                           "says which worker and why")


def follow(cfg: TpuConfig, runner: Runner, *, sleep: Callable[[float], None] | None = None,
           clock: Callable[[], float] = time.monotonic) -> int:
    """Worker 0's log until the job ends; its exit status. A dropped connection (255) on a READY slice is
    followed again after a bounded backoff; SSH_LOST when the slice is not READY or ssh keeps failing."""
    first = cfg.slice_names[0]
    lines, quick_failures = "+1", 0
    while True:
        began = clock()
        code = runner.run(ssh_worker(cfg, first, 0, remote.follow_script(cfg, lines)),
                          check=False).returncode
        if code != SSH_LOST or cfg.dry_run:
            return code
        dropped = clock()
        quick_failures = quick_failures + 1 if dropped - began < BACKOFF_MAX_S else 1
        status = Slice(cfg, runner).status()
        if not status.ready:
            return code
        if quick_failures > REATTACH_LIMIT:
            log.error("ssh to worker 0 of %s failed %d times in a row: giving up following the job", first,
                      quick_failures - 1)
            return code
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (quick_failures - 1))
        log.warning("the connection to worker 0 of %s dropped (exit code %d) but the slice is READY and the job "
                    "keeps running there: re-attaching in %.0f s", first, code, delay)
        (sleep or time.sleep)(delay)
        log.info("re-attaching to worker 0's log, %.1f s after the drop (the last %s lines, then new ones)",
                 clock() - dropped, REATTACH_LINES)
        lines = str(REATTACH_LINES)


@dataclasses.dataclass(frozen=True)
class JobState:
    running: bool  # the job still runs on worker 0
    exit_code: int | None  # its exit code when it has ended
    stopped: bool  # `tpu-stop` stopped it

    @classmethod
    def parse(cls, text: str) -> JobState:
        words = text.split()
        code = int(words[1]) if len(words) > 1 and words[0] == "ended" and words[1].isdigit() else None
        return cls(running=words[:1] == ["running"], exit_code=code, stopped="stopped" in words)


def probe(cfg: TpuConfig, runner: Runner, *, sleep: Callable[[float], None] | None = None,
          tries: int = 0) -> JobState:
    """Is a job running on worker 0 (of slice 0)? Nothing is asked in a dry run.

    Only the probe script's own answer counts: a failed ssh is asked again (1, 2, 4, 8 s apart) and
    then is an error, never "no job" (which would start another job over a running one)."""
    if cfg.dry_run:
        return JobState(False, None, False)
    sleep, tries = sleep or time.sleep, tries or PROBE_TRIES
    argv = ssh_worker(cfg, cfg.slice_names[0], 0, remote.probe_script(cfg))
    for attempt in range(tries):
        proc = runner.run(argv, check=False, capture=True, mutating=False)
        if proc.returncode == 0:
            return JobState.parse(proc.stdout or "")
        if attempt + 1 < tries:
            sleep(BACKOFF_FIRST_S * 2 ** attempt)
    why = (proc.stderr or "").strip().splitlines()
    raise TpuError(
        f"tpu: expected worker 0 of {cfg.slice_names[0]} to say whether a job runs there, found ssh exit code "
        f"{proc.returncode} {tries} time(s){f' ({why[-1]})' if why else ''}. Fix: check the connection "
        "(gcloud compute tpus tpu-vm ssh ... --worker=0) and run the same make target again: it attaches to a "
        "running job and starts one only where none runs")


def fetch_logs(cfg: TpuConfig, runner: Runner) -> list[Path]:
    """Copy every worker's log to LOCAL_DIR/NAME/logs/worker-I.log; those that could be fetched."""
    folder = cfg.slice_dir / "logs"
    if not cfg.dry_run:
        folder.mkdir(parents=True, exist_ok=True)
    fetched = []
    for slice_id, name in enumerate(cfg.slice_names):
        for worker in range(cfg.workers):
            local = folder / f"worker-{slice_id * cfg.workers + worker}.log"
            argv = gcloud.download(cfg, worker, f"{cfg.remote_dir}/{remote.LOG}", str(local), name)
            proc = runner.run(argv, check=False, capture=True)
            if proc.returncode == 0:
                fetched.append(local)
            else:
                why = (proc.stderr or "").strip().splitlines()
                log.warning("could not fetch worker %d's log of %s (exit code %d)%s", worker, name, proc.returncode,
                            f": {why[-1]}" if why else "")
    return fetched


def stop_requested(cfg: TpuConfig, runner: Runner | None = None) -> bool:
    """`tpu-stop` stopped the job: from this machine (a local marker) or any other (asked of worker 0)."""
    if (cfg.slice_dir / STOP_MARKER).exists():
        return True
    if runner is None:
        return False
    try:  # asked once: a slice that is gone or unreachable has no marker to read (the local one is checked above)
        return probe(cfg, runner, tries=1).stopped
    except TpuError:
        return False


def clear_stop(cfg: TpuConfig) -> None:
    if not cfg.dry_run:
        (cfg.slice_dir / STOP_MARKER).unlink(missing_ok=True)


def stop_job(cfg: TpuConfig, runner: Runner) -> int:
    """SIGTERM the job on every worker (it saves and exits 75); SIGKILL after cfg.stop_grace_s."""
    if not cfg.dry_run:
        cfg.slice_dir.mkdir(parents=True, exist_ok=True)
        (cfg.slice_dir / STOP_MARKER).write_text("a `tpu-stop` asked the job to stop; `tpu-pod` will not restart it\n")
    names = cfg.slice_names
    log.info("stopping the job on %d workers (SIGTERM, then SIGKILL after %d s)", cfg.workers * len(names),
             cfg.stop_grace_s)
    codes = [runner.run(gcloud.ssh_all(cfg, remote.stop_script(cfg), name), check=False).returncode
             for name in names]
    return next((c for c in codes if c != 0), 0)
