"""`python -m deploy.tpu doctor`: what would fail on Cloud TPU, found before anything is created.

    python -m deploy.tpu doctor --name my-pod --zone us-central2-b --accelerator v4-32 --bucket gs://my-bucket/run1
    make tpu-doctor TPU_NAME=my-pod ZONE=us-central2-b ACCELERATOR=v4-32 BUCKET=gs://my-bucket/run1

takes the flags of `tpu-pod`, prints one line per check (deploy.checks) and exits 1 when any failed:

    ok    request: v4-32: 4 workers; run dir gs://my-bucket/run1
    ok    run: task lm: global batch 32 splits over 16 devices (v4-32: 16 chips)
    ok    code: ships job, deploy, pyproject.toml, requirements.lock, README.md to every worker
    ok    gcloud: /usr/bin/gcloud
    ok    account: me@example.com
    ok    project: my-project (gcloud's configured project)
    ok    accelerator type: v4-32 is offered in us-central2-b
    ok    runtime version: tpu-ubuntu2204-base (the v4 default) is offered in us-central2-b
    ok    slice: my-pod does not exist yet in us-central2-b: make tpu-pod creates it
    ok    run dir: this machine can write gs://my-bucket/run1 (...)

The run's check (`deploy.checks.run_check`) needs no network either: ARGS, or every run of SWEEP, parses,
its task imports, its config validates and its global batch splits over the slice's JAX devices (one per
chip; on v2 and v3 one per TensorCore), times SLICES; `--check-run 0` (make doctor without ARGS or SWEEP)
leaves it out, its line saying so. The quick part (QUICK: gcloud, account, project, accelerator type,
runtime version) asks gcloud read-only questions and needs no VM: `make tpu-pod` and `make tpu-create`
run it first (`preflight`), and its first problem is one error (exit 2) before anything is created. The
zone's checks need an account and a project, so they are left out until those pass. The rest is the
doctor's alone: the slice's own state, and writing (then deleting) an object in a gs:// run dir with this
machine's credentials.

Each question to a service has a bound (deploy/reach.py): one this machine cannot reach (offline, DNS, a
firewall) is one FAIL line naming the service, where it was looked for and the fix, within about reach.FIRST_S,
and nothing more is asked of that service; the fit compiles alongside, so the whole takes seconds:

    FAIL  accelerator type: gcloud (the Cloud TPU API): expected an answer within 4 s, found 'none: cannot reach
          tpu.googleapis.com:443: Temporary failure in name resolution'; not asked: runtime version, slice. Fix: ...
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence

from deploy import reach
from deploy.checks import Check, Devices, failed, report, run_check, run_skipped
from deploy.runner import Runner
from deploy.tpu import gcloud, ship, wheels
from deploy.tpu import fit
from deploy.tpu.config import TpuConfig, run_dir_of, validate_job
from deploy.tpu.slice import Slice, TpuError
from job.core import storage
from job.errors import ConfigError

log = logging.getLogger("deploy.tpu")

REGIONS_PAGE = "https://cloud.google.com/tpu/docs/regions-zones"
RUNTIMES_PAGE = "https://cloud.google.com/tpu/docs/runtimes"
SHOWN = 8  # an error lists at most this many of the runtime versions a zone offers
# generations whose SIZE counts TensorCores two to a chip that JAX sees as one device (megacore); v2 and v3
# count TensorCores too, each a device of its own
MEGACORE = ("v4", "v5p")
API_OVERRIDE = "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU"  # gcloud's api_endpoint_overrides/tpu, from the environment


# a check's answer, at most: every question to a service has its own bound (deploy/reach.py), within this one
BOUND_S = reach.FIRST_S + reach.REACH_S + reach.PATIENT_S + 1
# the storage clients' loggers, which print a traceback per retry when the network is refused: quiet while checking
QUIET = ("gcsfs", "fsspec", "aiohttp", "google", "urllib3", "google_auth_httplib2")
NETWORK_FIX = "then run make tpu-doctor again"


def tpu_api() -> reach.Service:
    """The Cloud TPU API as gcloud reaches it: its endpoint (or the override gcloud reads from the environment),
    through the environment's proxy."""
    return reach.Service("gcloud (the Cloud TPU API)", os.environ.get(API_OVERRIDE) or "https://tpu.googleapis.com/",
                         proxied=True, fix="connect this machine to a network that reaches it (DNS, firewall; gcloud "
                         "takes a proxy from HTTPS_PROXY or gcloud config set proxy/address), " + NETWORK_FIX)


def cloud_storage() -> reach.Service:
    """Cloud Storage as this machine's storage client (gcsfs) reaches it: directly, never through a proxy."""
    return reach.Service("Cloud Storage", storage.endpoint(), proxied=False,
                         fix="connect this machine to a network that reaches it (DNS, firewall: its client takes no "
                         "proxy), " + NETWORK_FIX)


class Started:
    """One check running in a daemon thread from now on (a check that never ends keeps nothing alive); its line
    when asked for. When it failed because a service did not answer, `down` names the service."""

    def __init__(self, name: str, make: Callable[[], Check]) -> None:
        self.name = name
        self.down: reach.Service | None = None
        self._began = time.monotonic()
        self._running = reach.Background(lambda: self._check(make), name=f"doctor-{name}")

    def _check(self, make: Callable[[], Check]) -> Check:
        try:
            return make()
        except reach.Unreachable as e:
            self.down = e.service
            return failed(self.name, e)
        except ConfigError as e:
            return failed(self.name, e)
        except TpuError as e:
            return Check(self.name, False, str(e))
        except Exception as e:  # noqa: BLE001 - a client's own error is still one line, never a traceback
            return Check(self.name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                         fix="run make tpu-doctor again; if it persists, check this machine's network")

    def result(self, bound_s: float | None = BOUND_S) -> Check:
        """Its line, within `bound_s` of its start (None: however long it takes)."""
        if self._running.wait(None if bound_s is None else max(0.0, self._began + bound_s - time.monotonic())):
            return self._running.result()  # _check returns a line for every exception
        return Check(self.name, False, f"expected an answer within {bound_s:.0f} s, found none",
                     fix="check this machine's network (proxy, DNS, firewall), then run make tpu-doctor again")


@dataclasses.dataclass(frozen=True)
class Probe:
    """One check: `ask` returns what it found when all is well, raises ConfigError (or TpuError) when not; a
    question to a service that does not answer raises reach.Unreachable, within that question's bound."""

    name: str  # on the check's line
    ask: Callable[[TpuConfig, Runner], str]

    def start(self, cfg: TpuConfig, runner: Runner) -> Started:
        return Started(self.name, lambda: Check(self.name, True, self.ask(cfg, runner)))

    def check(self, cfg: TpuConfig, runner: Runner) -> Check:
        return self.start(cfg, runner).result()


def _ask(runner: Runner, argv: Sequence[str], *, api: bool = True) -> subprocess.CompletedProcess[str]:
    """A read-only gcloud question: asked even in a dry run. One that calls the Cloud TPU API (`api`) has
    reach.FIRST_S to answer; then gcloud is stopped and, when the API is unreachable from here, the question is
    reach.Unreachable at once (gcloud itself would retry for about 30 s); when it is reachable, the question is
    asked again with reach.PATIENT_S. One that gcloud answers from its own configuration has both."""
    bound = reach.FIRST_S if api else reach.FIRST_S + reach.PATIENT_S
    try:
        return runner.run(argv, check=False, capture=True, mutating=False, timeout=bound)
    except subprocess.TimeoutExpired:
        if not api:
            raise ConfigError("gcloud", expected=f"an answer within {bound:g} s (from its own configuration)",
                              found=f"none: {' '.join(argv[:3])} did not end",
                              fix=f"run {shlex.join(argv)} here to see what it waits for") from None
        found = tpu_api().problem()
        if found is not None:
            raise reach.Unreachable(tpu_api(), reach.FIRST_S, found) from None
    try:
        return runner.run(argv, check=False, capture=True, mutating=False, timeout=reach.PATIENT_S)
    except subprocess.TimeoutExpired:
        raise reach.Unreachable(tpu_api(), reach.PATIENT_S, reach.silent(tpu_api())) from None


def _said(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed gcloud call said: the first line of its error (the rest is advice), or its exit code."""
    lines = [line.strip() for line in (proc.stderr or "").splitlines() if line.strip()]
    return f"exit code {proc.returncode}: {lines[0]}" if lines else f"exit code {proc.returncode}"


# ---------------------------------------------------------------------- the quick part
def require_gcloud(cfg: TpuConfig, runner: Runner) -> str:
    path = runner.which(gcloud.GCLOUD)
    if path is None:
        raise ConfigError("gcloud", expected="the Google Cloud CLI on PATH", found="no `gcloud` on PATH",
                          fix=gcloud.INSTALL_HINT)
    return path


def active_account(cfg: TpuConfig, runner: Runner) -> str:
    proc = _ask(runner, gcloud.active_account(), api=False)
    found = (proc.stdout or "").split()
    if proc.returncode == 0 and found:
        return found[0]
    raise ConfigError(
        "gcloud account", expected="an active account with credentials (`gcloud auth list` marks it ACTIVE)",
        found="none: gcloud is not logged in" if proc.returncode == 0 else _said(proc),
        fix="gcloud auth login (without a browser: gcloud auth login --no-browser; a service account: "
            "gcloud auth activate-service-account --key-file=KEY.json)")


def project(cfg: TpuConfig, runner: Runner) -> str:
    if cfg.project:
        return f"{cfg.project} (PROJECT)"
    proc = _ask(runner, gcloud.configured_project(), api=False)
    found = (proc.stdout or "").strip()
    if proc.returncode == 0 and found:
        return f"{found} (gcloud's configured project; PROJECT overrides it)"
    raise ConfigError(
        "PROJECT (--project)", expected="a Google Cloud project: PROJECT, or gcloud's configured project",
        found=("PROJECT empty and no project configured (`gcloud config get-value project`: (unset))"
               if proc.returncode == 0 else _said(proc)),
        fix="PROJECT=my-project, or once for every command: gcloud config set project my-project")


def _offered(cfg: TpuConfig, runner: Runner, argv: list[str], what: str) -> list[str]:
    """One item a line of a `list --format=value(...)`; ConfigError when gcloud cannot say, or lists nothing."""
    proc = _ask(runner, argv)
    if proc.returncode != 0:
        raise ConfigError(
            "ZONE (--zone)", expected=f"the {what} Cloud TPU offers in {cfg.zone}",
            found=f"`{' '.join(argv[:6])} ...` failed with {_said(proc)}",
            fix="check ZONE, that the project has the Cloud TPU API (gcloud services enable tpu.googleapis.com) "
                "and that your account may use it there (roles/tpu.viewer at least)")
    offered = [line.strip() for line in (proc.stdout or "").splitlines() if line.strip()]
    if not offered:
        raise ConfigError("ZONE (--zone)", expected="a zone with Cloud TPUs", found=f"{cfg.zone}: no {what} there",
                          fix=f"pick a zone from {REGIONS_PAGE} (v4: us-central2-b; v5e: us-west4-a, ...)")
    return offered


def _types(offered: list[str]) -> str:
    """'v2-8 .. v2-512 (7 sizes), v5litepod-1 .. v5litepod-256 (8 sizes)': each generation's range."""
    groups: dict[str, list[str]] = {}
    for name in offered:
        groups.setdefault(name.rsplit("-", 1)[0], []).append(name)
    return ", ".join(g[0] if len(g) == 1 else f"{g[0]} .. {g[-1]} ({len(g)} sizes)" for g in groups.values())


def accelerator_type(cfg: TpuConfig, runner: Runner) -> str:
    offered = _offered(cfg, runner, gcloud.accelerator_types(cfg), "accelerator types")
    if cfg.accelerator in offered:
        return f"{cfg.accelerator} is offered in {cfg.zone}"
    generation = cfg.accel.generation.name
    sizes = [name for name in offered if name.rsplit("-", 1)[0] == generation]
    listing = f"gcloud compute tpus tpu-vm accelerator-types list --zone={cfg.zone} lists them all"
    raise ConfigError(
        "ACCELERATOR (--accelerator)", expected=f"an accelerator type offered in {cfg.zone} ({_types(offered)})",
        found=cfg.accelerator,
        fix=(f"pick a {generation} size offered there ({listing}), or another ZONE" if sizes else
             f"a ZONE that offers {generation} ({REGIONS_PAGE}), or an ACCELERATOR offered in {cfg.zone}"))


def runtime_version(cfg: TpuConfig, runner: Runner) -> str:
    offered = _offered(cfg, runner, gcloud.runtime_versions(cfg), "runtime versions")
    generation = cfg.accel.generation.name
    version = cfg.runtime_version + ("" if cfg.runtime else f" (the {generation} default)")
    if cfg.runtime_version in offered:
        return f"{version} is offered in {cfg.zone}"
    shown = ", ".join(offered[:SHOWN]) + (f", ... ({len(offered)} in all)" if len(offered) > SHOWN else "")
    raise ConfigError(
        "RUNTIME (--runtime)", expected=f"a TPU software version offered in {cfg.zone} ({shown})", found=version,
        fix=(f"RUNTIME=one of those that suits {generation} ({RUNTIMES_PAGE}; gcloud compute tpus tpu-vm versions "
             f"list --zone={cfg.zone} lists them all)"
             + (f", or leave RUNTIME empty for the {generation} default" if cfg.runtime else "")))


QUICK = (Probe("gcloud", require_gcloud), Probe("account", active_account), Probe("project", project),
         Probe("accelerator type", accelerator_type), Probe("runtime version", runtime_version))


def preflight(cfg: TpuConfig, runner: Runner, known: Sequence[str] = ()) -> None:
    """The quick part, before anything is created: the first problem is raised (ConfigError, exit 2). `known`: the
    answers of its first probes, asked already (a dry run asks gcloud, account and project first:
    deploy/tpu/preview.py)."""
    found = [*known, *(probe.ask(cfg, runner) for probe in QUICK[len(known):])]
    log.info("checked before creating anything: %s", "; ".join(
        f"{probe.name} {text}" for probe, text in zip(QUICK[1:], found[1:], strict=True)))  # not gcloud's path


# ---------------------------------------------------------------------- the doctor's alone
def request(cfg: TpuConfig, runner: Runner) -> str:
    """What `tpu-pod` checks before any gcloud call: the job's arguments and the run dir (every run of a sweep:
    the run's check)."""
    validate_job(cfg)
    slices = f" x {cfg.slices} slices" if cfg.slices > 1 else ""
    return (f"{cfg.accelerator}{slices}: {cfg.workers * cfg.slices} worker(s); "
            f"run dir {run_dir_of(cfg.job_args) or 'none'}")


def devices(cfg: TpuConfig) -> Devices:
    """The JAX devices of the slices: the accelerator type's chips (v2 and v3: its TensorCores), times SLICES."""
    accel = cfg.accel
    megacore = accel.generation.name in MEGACORE
    each = accel.size // 2 if megacore else accel.size
    unit = "TensorCores" if accel.generation.counts == "cores" and not megacore else "chips"
    return Devices(each * cfg.slices, f"{cfg.accelerator}: {each} {unit}"
                   + (f" x {cfg.slices} slices" if cfg.slices > 1 else ""))


def run(cfg: TpuConfig, check_run: bool = True) -> Check:
    """ARGS (every run of SWEEP with it) on the slice's devices; its line says it was skipped without `check_run`."""
    if not check_run:
        return run_skipped(devices(cfg))
    return run_check(cfg.job_args, cfg.sweep, devices(cfg))


def slice_state(cfg: TpuConfig, runner: Runner) -> str:
    slice_ = Slice(cfg, runner)
    status = slice_.status()
    if status.absent:
        return f"{cfg.name} does not exist yet in {cfg.zone}: make tpu-pod creates it"
    slice_.check_type(status)
    then = ("reuses it" if status.ready else "deletes it and creates it again" if status.broken
            else "waits until it is READY")
    return f"{cfg.name} is {status.describe()}: make tpu-pod {then}"


def _bucket_url(cfg: TpuConfig) -> str | None:
    url = run_dir_of(cfg.job_args)
    return url if url is not None and url.startswith("gs://") else None


def bucket_access(cfg: TpuConfig, runner: Runner) -> str:
    """Write and delete one object in the gs:// run dir (storage.probe) with this machine's credentials, within the
    bounds of a question to Cloud Storage (reach.bounded)."""
    url = _bucket_url(cfg) or ""
    problem = storage.url_problem(url)
    reason = problem or reach.bounded(
        lambda: storage.probe(storage.run_path(url), f".job-doctor-{socket.gethostname()}-{os.getpid()}"),
        cloud_storage())
    if reason is None:
        return (f"this machine can write {url} (the workers' service account is checked by make tpu-pod on every "
                "worker before the job starts)")
    fix = storage.explain(url, reason).partition(". Fix: ")[2]
    raise ConfigError("run dir (BUCKET or ARGS --run-dir)",
                      expected="a bucket folder this machine's credentials (Application Default Credentials) can "
                      "write", found=f"{url}: {reason}",
                      fix=f"{fix}; on this machine: gcloud auth application-default login")


def checks(cfg: TpuConfig, runner: Runner, check_run: bool = True) -> Iterator[Check]:
    """Every check, in this order, each as soon as it is made. The fit (compiling the train step takes longest:
    deploy/tpu/fit.py) and the run dir's start once the checks made on this machine are done, and run alongside
    gcloud's. Without gcloud nothing else is asked of it; the zone and the slice only with an account and a project,
    and not after the Cloud TPU API did not answer one of them."""
    yield Probe("request", request).check(cfg, runner)
    yield run(cfg, check_run)  # in this thread: it imports the task (and with it numpy, jax, ...)
    yield Probe("code", ship.describe).check(cfg, runner)  # what reaches the workers: every task's package too
    if cfg.wheelhouse is not None:
        yield Probe("wheelhouse", lambda c, _: wheels.describe(c)).check(cfg, runner)
    tool = QUICK[0].check(cfg, runner)
    yield tool
    fitting = Started(fit.NAME, fit.prepare(cfg, check_run))  # from here on, the rest waits for services
    bucket = _bucket_url(cfg)
    if bucket is not None:
        for name in QUIET:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        storage.load_client(bucket)
    writing = Probe("run dir", bucket_access).start(cfg, runner) if bucket is not None else None
    if tool.ok:
        account = QUICK[1].check(cfg, runner)
        yield account
        where = QUICK[2].check(cfg, runner)
        yield where
        if account.ok and where.ok:
            yield from _zone(cfg, runner)
    if writing is not None:
        yield writing.result()
    yield fitting.result(None)


def _zone(cfg: TpuConfig, runner: Runner) -> Iterator[Check]:
    """The zone's checks and the slice's, until one finds the Cloud TPU API unreachable: its line names the others."""
    probes = (*QUICK[3:], Probe("slice", slice_state))
    for index, probe in enumerate(probes):
        started = probe.start(cfg, runner)
        found = started.result()
        if started.down is not None:
            rest = [later.name for later in probes[index + 1:]]
            yield dataclasses.replace(found, detail=found.detail + (f"; not asked: {', '.join(rest)}" if rest else ""))
            return
        yield found


def doctor(cfg: TpuConfig, runner: Runner, check_run: bool = True) -> int:
    """`python -m deploy.tpu doctor`: every check's line; 0 when all passed, else 1."""
    return report(checks(cfg, runner, check_run))
