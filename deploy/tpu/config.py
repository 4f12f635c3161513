"""What `make tpu-pod` needs to know, checked before any gcloud call.

    cfg = TpuConfig(name="my-pod", zone="us-central2-b", accelerator="v4-32",
                    job_args=("train", "--run-dir", "/mnt/my-bucket/run1"))

Every bad value is a `job.errors.ConfigError` naming the make variable (and
the `python -m deploy.tpu` flag), what was expected, and the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from pathlib import Path

from deploy.tpu.accelerators import Accelerator, parse_accelerator
from deploy.tpu.capacity import DEFAULT_BACKOFF_S, DEFAULT_DEADLINE_S
from job.core import flags, storage
from job.errors import ConfigError, require

log = logging.getLogger("deploy.tpu")

# The template's paths copied to every worker (under source_dir); SHIP adds more, and each task's package is added
# by itself (deploy/tpu/ship.py).
DEFAULT_SHIP = ("job", "deploy", "pyproject.toml", "requirements.lock", "README.md")

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # GCE resource names
_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")  # us-central2-b, europe-west4-a
_PROJECT = re.compile(r"^([a-z][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")  # my-proj, example.com:my-proj
_TOKEN = re.compile(r"^[^\s'\"`$;|&<>\\]+$")  # runtime versions, image references: one plain word
_DIR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # one path component
MOUNT_EXAMPLE = "/mnt/my-bucket"  # where the docs mount a bucket (gcsfuse) on every worker
BUCKET_EXAMPLE = "gs://my-bucket/run1"
# The capacity, network and multislice options (make tpu-create ... RESERVED=1 NETWORK=my-vpc TAGS=tpu,train SLICES=2)
_GCE_NAME = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"  # GCE names: networks, subnetworks, tags
_NETWORK = re.compile(rf"^(projects/[a-z][-a-z0-9.:]*/global/networks/)?{_GCE_NAME}$")
_SUBNETWORK = re.compile(rf"^(projects/[a-z][-a-z0-9.:]*/regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?{_GCE_NAME}$")
_TAG = re.compile(rf"^{_GCE_NAME}$")
_EMAIL = re.compile(r"^[a-z0-9][-a-z0-9._+]*@[a-z0-9][-a-z0-9]*(\.[a-z0-9][-a-z0-9]*)+$")
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?)([smhd]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_TAGS = 64  # Compute Engine's limit per VM
MAX_NAME = 63


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    name: str  # the slice (TPU node) name; also the queued resource's id
    zone: str  # where the slice lives, e.g. us-central2-b
    accelerator: str = "v4-8"  # accelerator type: v4-32 = 32 TensorCores = 4 worker hosts
    runtime: str | None = None  # TPU software version; None = the generation's default
    project: str | None = None  # GCP project; None = gcloud's configured project
    spot: bool = False  # Spot capacity: cheaper, preemptible at any time (then recreated)
    queued: bool = False  # create through `queued-resources create` (waits for capacity)
    image: str | None = None  # container image to run on every worker; None ships the code instead
    job_args: tuple[str, ...] = ()  # arguments of `python -m job` on every worker, verbatim
    retries: int = 3  # how many times a preempted run is recreated and resumed
    dry_run: bool = False  # print gcloud commands that change something instead of running them
    remote_dir: str = "jax-cluster-job"  # code and logs on each worker, under its home directory
    local_dir: str = "runs/tpu"  # worker logs and the code archive land in LOCAL_DIR/NAME
    source_dir: str = "."  # the checkout whose `ship` paths are copied to the workers
    ship: tuple[str, ...] = DEFAULT_SHIP  # paths under source_dir copied to every worker
    also_ship: tuple[str, ...] = ()  # SHIP (--also-ship): more paths under source_dir (a data folder, a config)
    wheelhouse: str | None = None  # WHEELHOUSE: `make wheelhouse`'s folder; the workers install from it, no index
    setup: str | None = None  # shell lines run on every worker before the job; None = install deps
    poll_s: float = 10.0  # seconds between state queries while waiting for the slice
    ready_timeout_s: float = 3600.0  # how long to wait for READY (queued capacity can take long)
    stop_grace_s: int = 60  # tpu-stop: seconds between SIGTERM (the job saves) and SIGKILL
    reserved: bool = False  # use the project's reserved capacity (--reserved); exclusive with spot
    internal_ip: bool = False  # workers without external IPs: create with --internal-ips, ssh/scp --internal-ip
    sweep: str | None = None  # SWEEP (pod): grid words or a sweep file; its runs one after another on the slice
    network: str | None = None  # VPC network of the workers; None = the project's default
    subnetwork: str | None = None  # subnetwork of the workers; None = the network's one in the region
    service_account: str | None = None  # the workers' service account (an email); None = the default one
    tags: tuple[str, ...] = ()  # network tags of the workers (firewall rules select them)
    slices: int = 1  # slices created by one queued resource (multislice): NAME-0 .. NAME-(N-1)
    create_deadline_s: float = DEFAULT_DEADLINE_S  # how long stock-outs are retried before giving up
    stockout_backoff_s: float = DEFAULT_BACKOFF_S  # first wait after a stock-out; doubles up to 10 min

    def __post_init__(self) -> None:
        validate(self)

    @property
    def accel(self) -> Accelerator:
        return parse_accelerator(self.accelerator)

    @property
    def workers(self) -> int:
        return self.accel.hosts

    @property
    def runtime_version(self) -> str:
        return self.runtime or self.accel.default_runtime

    @property
    def slice_names(self) -> tuple[str, ...]:
        """Every slice's node name: (NAME,) for one slice, NAME-0 .. NAME-(N-1) for SLICES=N."""
        return slice_names(self.name, self.slices)

    @property
    def slice_dir(self) -> Path:
        """Local folder of this slice: worker logs, the code archive, the stop marker."""
        return Path(self.local_dir) / self.name


def run_dir_of(job_args: tuple[str, ...]) -> str | None:
    """The job's --run-dir (last one wins, as in the job's own parser), or None."""
    return flags.value(job_args, "--run-dir")


def validate(cfg: TpuConfig) -> None:
    """Every check that needs no network; raises ConfigError on the first bad value."""
    require(bool(_NAME.fullmatch(cfg.name or "")), "TPU_NAME (--name)",
            "a slice name: lowercase letters, digits and hyphens, starting with a letter, at most 63",
            cfg.name, "make tpu-pod TPU_NAME=my-pod ZONE=us-central2-b ...")
    require(bool(_ZONE.fullmatch(cfg.zone or "")), "ZONE (--zone)", "a Cloud TPU zone such as us-central2-b",
            cfg.zone, "make tpu-pod ZONE=us-central2-b ... (see `gcloud compute tpus locations list`)")
    accel = parse_accelerator(cfg.accelerator)
    if cfg.runtime is not None:
        require(bool(_TOKEN.fullmatch(cfg.runtime)), "RUNTIME (--runtime)",
                "a TPU software version such as tpu-ubuntu2204-base", cfg.runtime,
                f"leave RUNTIME empty for the {accel.generation.name} default ({accel.default_runtime})")
    if cfg.project is not None:
        require(bool(_PROJECT.fullmatch(cfg.project)), "PROJECT (--project)", "a GCP project id such as my-project",
                cfg.project, "leave PROJECT empty to use gcloud's configured project")
    if cfg.image is not None:
        require(bool(_TOKEN.fullmatch(cfg.image)), "IMAGE (--image)",
                "a container image reference such as us-docker.pkg.dev/my-proj/repo/job:tag", cfg.image,
                "leave IMAGE empty to ship the code instead")
    require(cfg.retries >= 0, "RETRIES (--retries)", "an integer >= 0", cfg.retries, "RETRIES=3")
    require(bool(_DIR.fullmatch(cfg.remote_dir)), "--remote-dir", "one folder name under the workers' home",
            cfg.remote_dir, "use a plain name such as jax-cluster-job")
    require(0 < cfg.poll_s < math.inf, "--poll-seconds", "a finite number of seconds > 0", cfg.poll_s,
            "pass --poll-seconds 10")
    require(0 < cfg.ready_timeout_s < math.inf, "--ready-timeout", "a finite number of seconds > 0",
            cfg.ready_timeout_s, "pass --ready-timeout 3600")
    require(cfg.stop_grace_s >= 0, "--stop-grace", "a whole number of seconds >= 0", cfg.stop_grace_s,
            "pass --stop-grace 60")
    _validate_capacity(cfg)


def validate_job(cfg: TpuConfig) -> None:
    """The extra checks of the commands that run the job (pod, run)."""
    if cfg.image is None:
        # Each path is also removed on the workers before unpacking (`rm -rf -- PATH` in REMOTE_DIR).
        for what, paths in (("--ship", cfg.ship), ("SHIP (--also-ship)", cfg.also_ship)):
            outside = [p for p in paths if not Path(p).parts or Path(p).is_absolute() or ".." in Path(p).parts]
            require(not outside, what, f"paths inside {cfg.source_dir} (relative, without '..')", outside,
                    "list the checkout's own files and folders, such as job deploy pyproject.toml")
            missing = [p for p in paths if not (Path(cfg.source_dir) / p).exists()]
            require((bool(paths) or what != "--ship") and not missing, what, f"paths that exist under {cfg.source_dir}",
                    missing or "nothing", f"run from the checkout's root, or pass existing paths to {what}")
    flags.require_command(cfg.job_args)
    trains = not cfg.job_args or cfg.job_args[0] == "train"
    if trains:  # `python -m job demo`, `tokenize`, ...: no run dir
        _check_run_dir(cfg, cfg.accel)


def _check_run_dir(cfg: TpuConfig, accel: Accelerator) -> None:
    """The training job's checkpoints must outlive a worker: in a bucket (gs://, which every worker reaches)
    or, on a multi-host slice, on a mount every worker shares."""
    run_dir = run_dir_of(cfg.job_args)
    problem = storage.url_problem(run_dir) if run_dir is not None and "://" in run_dir else None
    if problem:
        raise ConfigError(
            "ARGS --run-dir", expected=f"a path, or a Cloud Storage URL gs://BUCKET/FOLDER ({problem})", found=run_dir,
            fix=f"make tpu-pod BUCKET={BUCKET_EXAMPLE} (or --run-dir {MOUNT_EXAMPLE}/run1 on a mounted bucket)",
        )
    in_bucket = run_dir is not None and run_dir.startswith("gs://")
    shared = in_bucket or (run_dir is not None and run_dir.startswith("/"))
    hosts = accel.hosts * cfg.slices
    if hosts > 1 and not shared:
        raise ConfigError(
            "ARGS --run-dir", expected=f"a folder every one of the {hosts} workers of "
            f"{cfg.accelerator}{f' x {cfg.slices} slices' if cfg.slices > 1 else ''} shares (a bucket, or an absolute path on a shared mount: gcsfuse, Filestore)",
            found=run_dir if run_dir is not None else "none (the job's default runs/example on each worker's disk)",
            fix=f"make tpu-pod BUCKET={BUCKET_EXAMPLE} (or ARGS='train --run-dir {MOUNT_EXAMPLE}/run1 ...' on a "
            "mount every worker has)",
        )
    if hosts > 1 and shared and not in_bucket:
        log.info("the run dir %s must be the same shared mount (gcsfuse, Filestore) on all %d workers; "
                 "BUCKET=%s needs no mount", run_dir, hosts, BUCKET_EXAMPLE)
    if (cfg.spot or cfg.queued) and not shared:
        log.warning("the run dir %s is on the workers' disks: a recreated slice starts from scratch; "
                    "use BUCKET=%s (or --run-dir on a shared mount) to resume after preemption",
                    run_dir or "runs/example", BUCKET_EXAMPLE)


def with_bucket(job_args: tuple[str, ...], bucket: str | None) -> tuple[str, ...]:
    """The job's arguments with BUCKET as its --run-dir (appended unless ARGS names the same one)."""
    if not bucket:
        return job_args
    problem = storage.url_problem(bucket) if storage.is_remote(bucket) else "a gs:// URL"
    require(problem is None, "BUCKET (--bucket)", f"a Cloud Storage URL gs://BUCKET/FOLDER ({problem})", bucket,
            f"BUCKET={BUCKET_EXAMPLE}")
    given = run_dir_of(job_args)
    if given is None:
        return (*job_args, "--run-dir", bucket)
    if given.rstrip("/") != bucket.rstrip("/"):
        raise ConfigError("BUCKET (--bucket)", expected="one run dir: BUCKET or ARGS' --run-dir, or both the same",
                          found=(bucket, given), fix="drop --run-dir from ARGS, or leave BUCKET empty")
    return job_args


def slice_names(name: str, slices: int) -> tuple[str, ...]:
    """The node of each slice: NAME alone, or NAME-0 .. NAME-(N-1) (gcloud's --node-prefix naming)."""
    return (name,) if slices == 1 else tuple(f"{name}-{i}" for i in range(slices))


def _validate_capacity(cfg: TpuConfig) -> None:
    """The capacity, network and multislice options; ConfigError on the first bad value."""
    if cfg.spot and cfg.reserved:
        raise ConfigError("SPOT (--spot) and RESERVED (--reserved)",
                          expected="one kind of capacity: gcloud takes --spot or --reserved, not both",
                          found="SPOT=1 RESERVED=1", fix="keep RESERVED=1 to use your reservation, or SPOT=1")
    if cfg.network is not None:
        require(bool(_NETWORK.fullmatch(cfg.network)), "NETWORK (--network)",
                "a VPC network name such as my-vpc (or projects/P/global/networks/my-vpc)", cfg.network,
                "leave NETWORK empty for the project's default network")
    if cfg.subnetwork is not None:
        require(bool(_SUBNETWORK.fullmatch(cfg.subnetwork)), "SUBNETWORK (--subnetwork)",
                "a subnetwork name such as my-subnet (or projects/P/regions/R/subnetworks/my-subnet)",
                cfg.subnetwork, "leave SUBNETWORK empty for the network's subnetwork in the zone's region")
    if cfg.service_account is not None:
        require(bool(_EMAIL.fullmatch(cfg.service_account)), "SERVICE_ACCOUNT (--service-account)",
                "a service account's email such as job@my-proj.iam.gserviceaccount.com", cfg.service_account,
                "leave SERVICE_ACCOUNT empty for the Compute Engine default service account")
    bad_tags = [t for t in cfg.tags if not _TAG.fullmatch(t)]
    require(not bad_tags and len(cfg.tags) <= MAX_TAGS, "TAGS (--tags)",
            f"at most {MAX_TAGS} comma-separated network tags, each lowercase letters, digits and hyphens "
            "starting with a letter (RFC 1035)", bad_tags or f"{len(cfg.tags)} tags", "TAGS=tpu,train")
    require(cfg.slices >= 1, "SLICES (--slices)", "a whole number of slices >= 1", cfg.slices, "SLICES=2")
    if cfg.slices > 1:
        require(cfg.queued, "SLICES (--slices)",
                "QUEUED=1 with SLICES > 1 (gcloud creates several slices only through one queued resource)",
                f"SLICES={cfg.slices} QUEUED=0", f"make tpu-create QUEUED=1 SLICES={cfg.slices} ...")
        last = slice_names(cfg.name, cfg.slices)[-1]
        require(len(last) <= MAX_NAME, "TPU_NAME (--name)",
                f"a name short enough for its slices' names (NAME-0 .. NAME-{cfg.slices - 1}, at most {MAX_NAME})",
                last, "use a shorter TPU_NAME")
    require(0 < cfg.create_deadline_s < math.inf, "CREATE_DEADLINE (--create-deadline)",
            "a duration > 0 such as 2h", cfg.create_deadline_s, "CREATE_DEADLINE=2h")
    require(0 < cfg.stockout_backoff_s < math.inf, "--stockout-backoff", "a finite number of seconds > 0",
            cfg.stockout_backoff_s, "pass --stockout-backoff 60")
