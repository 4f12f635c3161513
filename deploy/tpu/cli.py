"""Cloud TPU pods through gcloud: create or reuse a slice, run the job on every worker, resume after preemption.

    python -m deploy.tpu pod --name my-pod --zone us-central2-b --accelerator v4-32 \\
        --args 'train --run-dir /mnt/my-bucket/run1 --steps 1000'

Commands (`make tpu-<command>` runs each):

    pod     create or reuse the slice, wait until READY, ship the code (the template, every task's
            package, --also-ship: deploy/tpu/ship.py) or pull --image, set up every worker (from
            --wheelhouse without an index: deploy/tpu/wheels.py), free the TPU, run `python -m job ARGS` on all workers, stream worker 0,
            keep every worker's log, and exit with the job's status. A preempted slice (or a job
            that exits 75) is recreated and the job resumed, always; a job that fails (any other
            exit but 2) is rerun from its newest checkpoint up to --retries times (the policy is
            deploy/policy.py's). Each attempt's end is one line of RUN_DIR/attempts.jsonl.
    create  create or reuse the slice and wait until it is READY
    doctor  check the request, the run (ARGS' task, config and global batch on the slice's devices),
            gcloud's account and project, the accelerator type and runtime version in the zone, the
            slice, and a gs:// run dir: one line each (deploy/tpu/doctor.py)
    run     ship, set up and run the job on a READY slice (no retries)
    logs    copy every worker's log to LOCAL_DIR/NAME/logs/ and print worker 0's end
    stop    stop the job: SIGTERM (it saves a checkpoint), SIGKILL after --stop-grace seconds
    delete  delete the slice (and its queued resource)
    status  print the slice's state

Before `pod` and `create` create anything they ask gcloud the doctor's quick questions (account,
project, accelerator type and runtime version in the zone): the first problem is one error, exit 2.
Every gcloud call goes through `deploy.runner.Runner` as an argv list;
`--dry-run 1` prints the ones that change something instead of running them (without gcloud, an
account or a project: every one, asking gcloud nothing; deploy/tpu/preview.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deploy import sweeps
from deploy.policy import Decision, Situation, decide
from deploy.runner import Runner, shell_words
from deploy.tpu import capacity, doctor, preview, ship, wheels
from deploy.tpu import job as tpu_job
from deploy.tpu.failures import Failure, RetryBudget, find_failure
from deploy.tpu.config import DEFAULT_SHIP, TpuConfig, run_dir_of, validate_job, with_bucket
from deploy.tpu.slice import Slice, TpuError
from job.core import exits, values
from job.errors import ConfigError, refuse_dash_values
from job.runs import attempts as attempt_records
from job.runs.attempts import Action, Outcome
from job.runs.sweep import save_plan

log = logging.getLogger("deploy.tpu")

TAIL_LINES = 40  # `logs` prints this many lines of worker 0's log
SSH_LOST = tpu_job.SSH_LOST
STOP_COMMAND = "`tpu-stop`"  # the stop a person runs (make tpu-stop): an input of the attempt policy


_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?)([smhd]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float:
    """CREATE_DEADLINE (--create-deadline): `2h`, `30m`, `90s`, `1d` or plain seconds; > 0."""
    found = _DURATION.fullmatch(text.strip())
    value = float(found.group(1)) * _UNIT_S[found.group(3)] if found else math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a duration > 0 such as 2h, 30m or 900 (seconds), found {text!r}")
    return value


def tag_list(text: str) -> tuple[str, ...]:
    """TAGS (--tags): a comma-separated list (empty: none)."""
    return tuple(word.strip() for word in text.split(",")) if text.strip() else ()


def path_list(text: str) -> tuple[str, ...]:
    """SHIP (--also-ship): paths separated by spaces or commas (empty: none)."""
    return tuple(word for word in re.split(r"[\s,]+", text) if word)


def pod(cfg: TpuConfig, runner: Runner) -> int:
    """Create or reuse, run; after each attempt apply the attempt policy (deploy/policy.py) and record the
    attempt in RUN_DIR/attempts.jsonl: after a preemption recreate (when the slice is gone) and resume, always;
    after a failure rerun from the newest checkpoint on the same slice while RETRIES lasts. The job's final status."""
    slice_ = Slice(cfg, runner)
    tpu_job.clear_stop(cfg)
    budget = RetryBudget(cfg.retries)
    preemptions = 0
    log.info("retry budget: %s after a failure (RETRIES); a preemption never spends it",
             f"{cfg.retries} rerun(s)" if cfg.retries else "no reruns")
    while True:
        slice_.ensure_ready()
        began = time.time()
        code = tpu_job.run_job(cfg, runner)
        span = (began, time.time())
        if _ended_as_meant(cfg, runner, span, code, budget):
            return code
        status = slice_.status()
        if status.ready:
            tpu_job.fetch_logs(cfg, runner)
        preempted = status.broken or status.absent or code == exits.REQUEUE
        if code == SSH_LOST and not preempted:
            log.error("the connection to %s was lost (exit code %d) and could not be opened again, but the "
                      "slice is %s: the job may still be running; `make tpu-pod` again attaches to it, "
                      "`make tpu-logs` shows it, `make tpu-stop` stops it", cfg.name, code, status.describe())
            return code
        failure = None if preempted else find_failure(cfg, runner, code)
        decision = decide(Situation(code if failure is None else failure.code, budget.used, cfg.retries,
                                    node=None if failure is None else failure.where(), same_allocation=True,
                                    preempted=preempted))
        _record_attempt(cfg, span, code if failure is None else failure.code, decision, failure)
        logs = cfg.slice_dir / "logs"
        if failure is None:
            preemptions += 1
            log.warning("preempted (slice %s, job exit code %d): %s and resuming from the newest checkpoint; "
                        "preemption %d, which does not spend the retry budget (%s)", status.describe(), code,
                        "recreating the slice" if status.broken or status.absent else "rerunning on the slice",
                        preemptions, budget.describe())
        elif _not_rerun(failure, decision, budget, logs):
            return failure.code
        else:
            budget = budget.spend()
            log.warning("retry %d of %d after %s: rerunning from the newest checkpoint on the same slice (%s; "
                        "worker logs: %s)", decision.retry, decision.retries, failure.describe(), status.describe(),
                        logs)


def _ended_as_meant(cfg: TpuConfig, runner: Runner, span: tuple[float, float], code: int,
                    budget: RetryBudget) -> bool:
    """Whether the attempt that ended with `code` ends `pod` without asking the slice: a dry run, a job that
    completed, one stopped by STOP_COMMAND (its logs fetched, its attempt recorded where it is one)."""
    if cfg.dry_run:
        tpu_job.fetch_logs(cfg, runner)
        return True
    if code == exits.COMPLETED:
        tpu_job.fetch_logs(cfg, runner)
        _record_attempt(cfg, span, code, decide(Situation(code, budget.used, cfg.retries, same_allocation=True)))
        return True
    if code != SSH_LOST and tpu_job.stop_requested(cfg, runner):
        log.info("the job was stopped by %s (exit code %d): not restarting it", STOP_COMMAND, code)
        # the policy's decision (stopped, never rerun: Situation.stopped_by), recorded as every other
        _record_attempt(cfg, span, code, decide(Situation(code, budget.used, cfg.retries, same_allocation=True,
                                                          stopped_by=STOP_COMMAND)))
        return True
    return False


def _not_rerun(failure: Failure, decision: Decision, budget: RetryBudget, logs: Path) -> bool:
    """Whether the policy's `decision` on a failed attempt ends `pod` (a configuration error, a stop by Ctrl-C, a
    spent retry budget), logging why; `logs`: where the workers' logs were kept."""
    if decision.outcome is Outcome.CONFIGURATION_ERROR:
        log.error("the job failed with %s: never retried (every rerun would fail the same way); fix it and "
                  "run again (worker logs: %s)", failure.describe(), logs)
        return True
    if decision.outcome is Outcome.STOPPED:
        log.warning("the job was stopped with Ctrl-C after saving (exit %d): not rerun; `make tpu-pod` again "
                    "resumes it", failure.code)
        return True
    if decision.action is Action.STOP:
        log.error("the job failed with %s; the retry budget is spent (%s): giving up. `make tpu-pod` again "
                  "resumes from the newest checkpoint with a new budget; worker logs: %s",
                  failure.describe(), budget.describe(), logs)
        return True
    return False


def _record_attempt(cfg: TpuConfig, span: tuple[float, float], code: int, decision: Decision,
                    failure: Failure | None = None) -> None:
    """One `ended` record in RUN_DIR/attempts.jsonl (job.runs.attempts), as the Slurm supervisor writes it: the
    slice's name as the job, `span` the attempt's (start, end) as this loop saw them, the failed worker as the
    node, the policy's decision (its outcome, action and words). Nothing for a run dir on the workers' own disks."""
    run_dir = run_dir_of(cfg.job_args)
    if run_dir is None or not ("://" in run_dir or run_dir.startswith("/")):
        return  # each worker's own disk: no reader here (the configuration check said so before the start)
    cause = failure.cause if failure is not None else None
    attempt_records.append(run_dir, attempt_records.Ended(
        job=cfg.name, began=span[0], ended=span[1], code=code, outcome=decision.outcome, action=decision.action,
        says=decision.describe(),
        node=(failure.where() if failure is not None else None) or "-",
        process=str(cause.process) if cause is not None else "-", cause=cause.last_line if cause else "",
        nodes=",".join(cfg.slice_names)))


def sweep_pod(cfg: TpuConfig, runner: Runner, known: list[str] | None = None) -> int:
    """SWEEP: every run checked here first, then each run not yet completed as `pod` runs one job, in turn, on
    the same slice, each in its own run dir (resumed from its checkpoints), each shipping what cfg ships (every run's
    task package); the first failure stops the sweep. `known`: as `dispatch` has it (None: gcloud not asked)."""
    assert cfg.sweep is not None
    try:
        todo = sweeps.runs_to_start(cfg.sweep, cfg.job_args, save=False)
    except ConfigError as exc:
        raise ConfigError(exc.what, expected=exc.expected, found=exc.found, fix=f"{exc.fix}; nothing was run"
                          ) from None
    if known is not None:
        doctor.preflight(cfg, runner, known)
    if not cfg.dry_run:
        save_plan(todo.sweep)
    log.info("sweep %s: %s", todo.sweep.folder, todo.summary())
    if cfg.dry_run:
        print(sweeps.listing(todo.sweep))
    return sweeps.in_turn(todo, lambda run: pod(dataclasses.replace(cfg, job_args=run.flags, sweep=None), runner),
                          again="`make tpu-pod SWEEP=...`")


def _as_found(cfg: TpuConfig, runner: Runner) -> TpuConfig:
    """cfg with the existing slice's accelerator type (so every worker counts even without ACCELERATOR)."""
    found = Slice(cfg, runner).status().accelerator
    if not found or found == cfg.accelerator:
        return cfg
    try:
        return dataclasses.replace(cfg, accelerator=found)
    except ConfigError:  # a type this launcher does not know: keep the requested one
        return cfg


def status(cfg: TpuConfig, runner: Runner) -> int:
    st = Slice(cfg, runner).status()
    where = f"in {cfg.zone}" + (f" (project {cfg.project})" if cfg.project else "")
    accel = st.accelerator or cfg.accelerator
    workers = cfg.workers if accel == cfg.accelerator else "?"
    print(f"{cfg.name}: {st.describe()}, {accel}, {workers} workers, {where}", flush=True)
    return 0


def logs(cfg: TpuConfig, runner: Runner) -> int:
    cfg = _as_found(cfg, runner)
    fetched = tpu_job.fetch_logs(cfg, runner)
    for path in fetched:
        print(f"{path}", flush=True)
    first = cfg.slice_dir / "logs" / "worker-0.log"
    if first in fetched and first.exists():
        lines = first.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        print(f"--- last {len(lines)} lines of worker 0 ---", *lines, sep="\n", flush=True)
    try:
        state = tpu_job.probe(cfg, runner, tries=1)
    except TpuError as err:  # the logs above are what there is; whether the job runs is unknown
        log.warning("%s", err)
        state = tpu_job.JobState(False, None, False)
    if state.running or state.exit_code is not None:
        print("the job is still running" if state.running else f"the job ended with exit code {state.exit_code}"
              + (" (stopped by `tpu-stop`)" if state.stopped else ""), flush=True)
    return 0 if len(fetched) == cfg.workers * len(cfg.slice_names) or cfg.dry_run else 1


def run(cfg: TpuConfig, runner: Runner) -> int:
    """`tpu-run`: the job, once, on a READY slice of the requested type."""
    slice_ = Slice(cfg, runner)
    st = slice_.status()
    if not st.ready:
        if not cfg.dry_run:
            raise TpuError(f"slice {cfg.name} is {st.describe()}, not READY; fix: `make tpu-create` "
                           "(or `make tpu-pod`) first")
        log.warning("dry run: slice %s is %s; a real run would stop here", cfg.name, st.describe())
    else:
        slice_.check_type(st)
    code = tpu_job.run_job(cfg, runner)
    tpu_job.fetch_logs(cfg, runner)
    return code


def create(cfg: TpuConfig, runner: Runner) -> int:
    Slice(cfg, runner).ensure_ready()
    return 0


def stop(cfg: TpuConfig, runner: Runner) -> int:
    return tpu_job.stop_job(_as_found(cfg, runner), runner)


def delete(cfg: TpuConfig, runner: Runner) -> int:
    Slice(cfg, runner).delete()
    return 0


HANDLERS = {"pod": pod, "create": create, "run": run, "logs": logs, "stop": stop, "delete": delete,
            "status": status, "doctor": doctor.doctor}
COMMANDS = tuple(HANDLERS)
CREATING = ("pod", "create")  # the commands that may create a slice: the doctor's quick part runs first


def dispatch(command: str, cfg: TpuConfig, runner: Runner, *, check_run: bool = True) -> int:
    """Check everything that needs no network (and, before creating anything, the doctor's quick part), then
    run one command; its exit status. `doctor` makes all its checks itself (the run's with `check_run`). A dry run
    that gcloud cannot answer (no gcloud, account or project) previews the commands without asking it anything."""
    if command == "doctor":
        return doctor.doctor(cfg, runner, check_run)
    if command in ("pod", "run"):
        validate_job(cfg)
        cfg = ship.resolved(cfg)  # every task's package with the template, or one error naming the task
        wheels.require(cfg)
    if cfg.sweep is not None and command != "pod":
        raise ConfigError("SWEEP", expected="make tpu-pod with it (a sweep's runs one after another on the slice)",
                          found=f"make tpu-{command} SWEEP={cfg.sweep}", fix="make tpu-pod SWEEP=..., or leave SWEEP unset")
    runner, known = preview.runner_for(cfg, runner)
    if known == []:
        doctor.require_gcloud(cfg, runner)
    if cfg.sweep is not None:
        return sweep_pod(cfg, runner, known)  # checks every run first, then the quick part
    if command in CREATING and known is not None:
        doctor.preflight(cfg, runner, known)
    return HANDLERS[command](cfg, runner)


# ---------------------------------------------------------------------- command line
_on_off = values.for_argparse(values.switch)  # SPOT=1, QUEUED=true, ...: an on/off word
_count = values.for_argparse(values.whole, minimum=0)
_positive_seconds = values.for_argparse(values.positive_seconds)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.tpu", description=__doc__.split("\n")[0],
                                epilog="job arguments go after --args '...' or after `--`",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("--name", default="", help="TPU_NAME: the slice's name")
    p.add_argument("--zone", default="", help="ZONE, e.g. us-central2-b")
    p.add_argument("--accelerator", default="v4-8", help="ACCELERATOR type, e.g. v4-32 (default v4-8)")
    p.add_argument("--runtime", default="", help="RUNTIME: TPU software version (default: per generation)")
    p.add_argument("--project", default="", help="PROJECT (default: gcloud's configured project)")
    p.add_argument("--spot", type=_on_off, nargs="?", const=True, default=False, help="SPOT=1: Spot capacity")
    p.add_argument("--queued", type=_on_off, nargs="?", const=True, default=False,
                   help="QUEUED=1: create through queued resources")
    p.add_argument("--image", default="", help="IMAGE to pull and run instead of shipping the code")
    p.add_argument("--retries", type=_count, default=3,
                   help="RETRIES: reruns of a failed job (not exit 2) from its newest checkpoint (default 3; 0: "
                        "none); a preemption never spends one")
    p.add_argument("--dry-run", type=_on_off, nargs="?", const=True, default=False,
                   help="DRY_RUN=1: print gcloud commands that change something")
    p.add_argument("--bucket", default="", help="BUCKET: gs://BUCKET/PATH, the run dir (--run-dir) of the job")
    p.add_argument("--args", type=shell_words, default=None, help="ARGS of `python -m job`, one shell-style string")
    p.add_argument("--sweep", default="", help="SWEEP (pod): grid words or a sweep file: its runs in turn")
    p.add_argument("--remote-dir", default="jax-cluster-job", help="folder under each worker's home")
    p.add_argument("--local-dir", default="runs/tpu", help="local folder for logs (LOCAL_DIR/NAME)")
    p.add_argument("--source-dir", default=".", help="the checkout to ship (default: .)")
    p.add_argument("--ship", nargs="+", default=list(DEFAULT_SHIP), help="the template's paths to ship")
    p.add_argument("--also-ship", type=path_list, default=(),
                   help="SHIP: more paths under --source-dir to ship (space- or comma-separated); each task's "
                        "package is shipped without it")
    p.add_argument("--wheelhouse", default="",
                   help="WHEELHOUSE: a folder of `make wheelhouse`; the workers install from it, without an index")
    p.add_argument("--setup", default=None, help="shell lines run on every worker before the job")
    p.add_argument("--poll-seconds", type=_positive_seconds, default=10.0, help="between state queries")
    p.add_argument("--ready-timeout", type=_positive_seconds, default=3600.0, help="seconds to wait for READY")
    p.add_argument("--stop-grace", type=_count, default=60, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--reserved", type=_on_off, nargs="?", const=True, default=False,
                   help="RESERVED=1: use the project's reserved capacity")
    p.add_argument("--internal-ip", type=_on_off, nargs="?", const=True, default=False,
                   help="INTERNAL_IP=1: workers without external IPs, reached through internal ones")
    p.add_argument("--network", default="", help="NETWORK: the workers' VPC network")
    p.add_argument("--subnetwork", default="", help="SUBNETWORK: the workers' subnetwork")
    p.add_argument("--service-account", default="", help="SERVICE_ACCOUNT: the workers' service account email")
    p.add_argument("--tags", type=tag_list, default=(), help="TAGS: network tags, comma-separated")
    p.add_argument("--slices", type=_count, default=1, help="SLICES: slices of one queued resource (needs QUEUED=1)")
    p.add_argument("--create-deadline", type=duration_seconds, default=capacity.DEFAULT_DEADLINE_S,
                   help="CREATE_DEADLINE: how long stock-outs are retried, e.g. 2h (default)")
    p.add_argument("--stockout-backoff", type=_positive_seconds, default=capacity.DEFAULT_BACKOFF_S,
                   help="seconds before the first retry after a stock-out (doubles, at most 600)")
    p.add_argument("--check-run", type=_on_off, nargs="?", const=True, default=True,
                   help="doctor: check ARGS' task, config and global batch on the slice's devices (default 1; make "
                        "doctor passes 0 without ARGS or SWEEP)")
    return p


def parse_args(argv: Sequence[str]) -> tuple[str, TpuConfig]:
    command, cfg, _ = parse_command_line(argv)
    return command, cfg


def parse_command_line(argv: Sequence[str]) -> tuple[str, TpuConfig, bool]:
    """The command, its config, and the doctor's --check-run."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    refuse_dash_values(parser, argv[:cut])
    args = parser.parse_args(argv[:cut])
    tail = tuple(argv[cut + 1:])
    if args.args is not None and tail:
        raise ConfigError("job arguments", expected="either --args '...' or words after `--`",
                          found=(" ".join(args.args), " ".join(tail)), fix="give them one way only")
    cfg = TpuConfig(
        name=args.name, zone=args.zone, accelerator=args.accelerator, runtime=args.runtime or None,
        project=args.project or None, spot=args.spot, queued=args.queued, image=args.image or None,
        job_args=with_bucket(args.args if args.args is not None else tail, args.bucket or None),
        retries=args.retries, dry_run=args.dry_run, sweep=args.sweep.strip() or None,
        remote_dir=args.remote_dir, local_dir=args.local_dir, source_dir=args.source_dir, ship=tuple(args.ship),
        also_ship=args.also_ship, wheelhouse=args.wheelhouse or None,
        setup=args.setup, poll_s=args.poll_seconds, ready_timeout_s=args.ready_timeout,
        stop_grace_s=args.stop_grace, reserved=args.reserved, internal_ip=args.internal_ip,
        network=args.network or None, subnetwork=args.subnetwork or None,
        service_account=args.service_account or None, tags=args.tags, slices=args.slices,
        create_deadline_s=args.create_deadline, stockout_backoff_s=args.stockout_backoff,
    )
    return args.command, cfg, args.check_run


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[tpu] %(message)s")
    try:
        command, cfg, check_run = parse_command_line(sys.argv[1:] if argv is None else argv)
        return dispatch(command, cfg, runner or Runner(dry_run=cfg.dry_run), check_run=check_run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except (TpuError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the job may still be running on the workers; `make tpu-stop` stops it",
              file=sys.stderr, flush=True)
        return 130

