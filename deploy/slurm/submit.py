"""Submit the job to Slurm: through submitit (default) or the plain sbatch script.

    python -m deploy.slurm --nodes 4 [--partition P] [--time 01:00:00]
                           [--gpus-per-node 8 [--tasks-per-node 8] [--gpu-type a100] [--gres]]
                           [--cpus-per-task N] [--mem 64G] [--exclusive] [--constraint F] [--account A] [--qos Q]
                           [--image IMG [--container-runtime auto|pyxis|apptainer|podman]] [--python PY]
                           [--sbatch-args '--begin=now+1hour'] [--via submitit|sbatch] [--wait] [--dry-run]
                           -- train --steps 500

`make submit-slurm` passes the make variables of the same names (NODES, GPUS_PER_NODE, ...).
One task per node, or one per GPU (the GPU layouts: deploy/slurm/options.py). The job
asks for --requeue, and srun gets --cpus-per-task. With GPUs and no IMAGE the tasks
run .venv-cuda's interpreter (`make venv FLAVOR=cuda`), which is checked for jax's
CUDA plugin first (JOB_SKIP_GPU_CHECK=1 skips that, for stand-in GPUs), and jax's
recommended XLA GPU flags join XLA_FLAGS unless it sets them already. Every check
runs before anything is submitted. --dry-run prints what would be submitted (the
batch script, or the sbatch command and the srun line of slurm/train.sbatch). With
--wait it streams process 0's log and exits with the job's status.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import io
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from deploy.runner import Runner, shell_words
from deploy.slurm import partitions
from deploy.slurm.options import (
    GPU_PROBE,
    ROOT,
    SlurmConfig,
    check,
    count,
    extra_options,
    gpu_request,
    resource_options,
    spare_options,
    switch,
    task_environment,
    time_minutes,
)
from job.core import internals
from job.errors import BAD_INPUT_EXIT_CODE, ConfigError, JobError, refuse_dash_values
from job.runtime.cluster.base import SKIP_GPU_CHECK, skips_gpu_check

log = logging.getLogger("deploy.slurm")

SBATCH_SCRIPT = ROOT / "slurm" / "train.sbatch"
REQUEUE_SCRIPT = ROOT / "slurm" / "requeue.sh"  # how both batch scripts hand their srun to the supervisor
LOCAL_CLUSTER_ENV = "/var/tmp/jax-job-slurm/env.sh"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


class SubmitError(JobError):
    """Slurm refused the job (sbatch's own words in the message)."""


def slurm_refused(program: str, output: str, code: int) -> JobError:
    """One line for a failed Slurm command: the fix when no controller answers, else its own stderr."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if any(sign in line for sign in partitions.NO_CONTROLLER):
            return ConfigError("Slurm", expected=f"a Slurm controller that {program} can reach", found=line,
                               fix="run this on the cluster's login node, or start the local cluster: "
                                   "`make slurm-up NODES=4`")
    return SubmitError(f"{program} failed (exit {code}): {' | '.join(lines) or 'no message'}")


def validate(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str] = os.environ) -> None:
    """Everything that can be checked before submitting."""
    check(cfg)
    if runner.which("sbatch") is None:
        if not cfg.dry_run:
            raise ConfigError(
                "sbatch", expected="Slurm's sbatch on PATH", found="no sbatch",
                fix="run this on a Slurm login node, or start the local cluster: `make slurm-up NODES=4` "
                    f"(then `source {LOCAL_CLUSTER_ENV}`, which make submit-slurm does for you)",
            )
        if cfg.partition is not None:
            log.warning("no sbatch on PATH: PARTITION=%s is not checked against sinfo", cfg.partition)
    else:  # make doctor's quick part: the partition, its state and limits against the request
        try:
            partitions.require(cfg, runner)
        except ConfigError as exc:
            if not (cfg.dry_run and exc.what == "Slurm"):
                raise
            log.warning("no Slurm controller answers (%s): the partition and its limits are not checked", exc.found)
    check_gpu_python(cfg, runner, environ)


def check_gpu_python(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str]) -> None:
    """With GPUs and no IMAGE, the tasks' interpreter must have jax's CUDA plugin, or jax trains on the CPU."""
    if not cfg.gpus_per_node or cfg.image or skips_gpu_check(environ):
        return
    python = cfg.task_python
    try:
        proc = runner.run([python, "-c", GPU_PROBE], check=False, capture=True, timeout=120, mutating=False)
        code = proc.returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        code = None
        found = f"{python}, which does not run ({getattr(exc, 'strerror', None) or exc})"
    if code == 0:
        return
    if code is not None:
        found = f"{python} without jax-cuda12-plugin" if code == 3 else f"{python}, which failed (exit {code})"
    raise ConfigError(
        "PYTHON", expected=f"an interpreter with jax's CUDA plugin (jax-cuda12-plugin) for GPUS_PER_NODE="
        f"{cfg.gpus_per_node}", found=found,
        fix="`make venv FLAVOR=cuda` (builds .venv-cuda from docker/requirements-cuda.lock), or run the CUDA image "
            f"(IMAGE=...:cuda), or PYTHON=...; for stand-in GPUs set {SKIP_GPU_CHECK}=1")


def submitit_parameters(cfg: SlurmConfig, environ: Mapping[str, str] = os.environ) -> dict[str, object]:
    """The SlurmExecutor parameters (also what the golden files pin)."""
    srun_args = ["--kill-on-bad-exit=1"]
    if cfg.cpus_per_task:  # Slurm 22.05-23.02: srun does not inherit it from the job
        srun_args.append(f"--cpus-per-task={cfg.cpus_per_task}")
    params: dict[str, object] = {
        "job_name": cfg.job_name,
        "nodes": cfg.allocated_nodes,
        "ntasks_per_node": cfg.ntasks_per_node,
        "time": time_minutes(cfg.time),
        "signal_delay_s": cfg.signal_delay_s,
        "srun_args": srun_args,
        "stderr_to_stdout": True,
        # --requeue: `scontrol requeue` is refused without it where JobRequeue=0; --export=ALL: NCCL_* and the rest
        "additional_parameters": {"export": "ALL", "requeue": True, **dict(spare_options(cfg)),
                                  **dict(extra_options(cfg.sbatch_args))},
    }
    params.update((name.replace("-", "_"), value) for name, value in resource_options(cfg))
    # the script's srun line runs through the supervisor (slurm/requeue.sh), as slurm/train.sbatch's does
    params["setup"] = ["# shellcheck source=slurm/requeue.sh", f"source {shlex.quote(str(REQUEUE_SCRIPT))} || exit 2",
                       *(f"export {name}={shlex.quote(value)}" for name, value in task_environment(cfg, environ).items()),
                       *(f"export {name}={shlex.quote(value)}" for name, value in supervisor_environment(cfg).items())]
    return params


def submitit_script(cfg: SlurmConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The batch script submitit writes for `cfg` (SlurmExecutor's own command line and folder)."""
    folder = Path(cfg.log_dir).expanduser().absolute()
    command = f"{shlex.quote(cfg.task_python)} -u -m {internals.SUBMITIT_TASK_MODULE} {shlex.quote(str(folder))}"
    return internals.submitit_sbatch_script(command, folder, **submitit_parameters(cfg, environ))


def supervisor_environment(cfg: SlurmConfig) -> dict[str, str]:
    """What the job's supervisor reads in the batch script (deploy/slurm/supervise.py): the nodes a step uses (the
    rest are spares), the retry budget, where attempts are recorded, and the interpreter it runs in (this one: the
    tasks' may be a wrapper or live only in their image)."""
    return {"JOB_LOG_DIR": cfg.log_dir, "JOB_RETRIES": str(cfg.retries), "JOB_NODES": str(cfg.nodes),
            "JOB_SUPERVISOR_PYTHON": sys.executable}


def exports(cfg: SlurmConfig) -> list[str]:
    """NAME=value pairs the sbatch path adds to the exported environment (read by slurm/train.sbatch)."""
    ours = [f"{name}={value}" for name, value in supervisor_environment(cfg).items()]
    if cfg.image:
        return [*ours, f"IMAGE={cfg.image}", f"CONTAINER_RUNTIME={cfg.container_runtime}"]
    return [f"JOB_PYTHON={cfg.task_python}", *ours]


def sbatch_argv(cfg: SlurmConfig) -> list[str]:
    argv = ["sbatch", "--parsable", f"--job-name={cfg.job_name}", f"--nodes={cfg.allocated_nodes}",
            f"--ntasks-per-node={cfg.ntasks_per_node}", f"--time={cfg.time}",
            f"--signal=USR2@{cfg.signal_delay_s}", "--requeue", f"--output={cfg.log_dir}/%j-batch.log"]
    for name, value in [*resource_options(cfg), *spare_options(cfg), *extra_options(cfg.sbatch_args)]:
        argv.append(f"--{name}" if value is True else f"--{name}={value}")
    argv.append("--export=" + ",".join(["ALL", *exports(cfg)]))
    return [*argv, str(SBATCH_SCRIPT), *cfg.args]


def batch_environment(cfg: SlurmConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What slurm/train.sbatch would see in the batch step of `sbatch_argv(cfg)`, for JOB_DRY_RUN=1."""
    ours = {"IMAGE", "CONTAINER_RUNTIME", "JOB_PYTHON", "JOB_LOG_DIR", "JOB_DRY_RUN", "JOB_RETRIES", "JOB_NODES",
            "JOB_SUPERVISOR_PYTHON"}
    env = {k: v for k, v in environ.items() if k not in ours and not k.startswith("SLURM_")}
    env.update((name, value) for name, _, value in (pair.partition("=") for pair in exports(cfg)))
    env.update(task_environment(cfg, environ), JOB_DRY_RUN="1", SLURM_JOB_NUM_NODES=str(cfg.allocated_nodes),
               SLURM_NTASKS_PER_NODE=str(cfg.ntasks_per_node))
    if cfg.cpus_per_task:
        env["SLURM_CPUS_PER_TASK"] = str(cfg.cpus_per_task)
    request = gpu_request(cfg)
    if request is not None:
        name, value = request
        if name == "gres":
            env["SLURM_JOB_GPUS"] = ",".join(map(str, range(cfg.gpus_per_node)))
        else:
            env[f"SLURM_{name.upper().replace('-', '_')}"] = value
    return env


def srun_line(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str] = os.environ) -> str:
    """The srun command line slurm/train.sbatch would run for `cfg` (the script itself, in JOB_DRY_RUN mode)."""
    proc = runner.run(["bash", str(SBATCH_SCRIPT), *cfg.args], env=batch_environment(cfg, environ), capture=True,
                      check=False, mutating=False)
    if proc.returncode != 0:
        raise SubmitError(f"slurm/train.sbatch (JOB_DRY_RUN=1) failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def dry_run(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str] = os.environ) -> str:
    """What would be submitted: submitit's batch script, or the sbatch command and train.sbatch's srun line."""
    if cfg.via == "submitit" and not cfg.image:
        return submitit_script(cfg, environ)
    extra = task_environment(cfg, environ)
    command = ["env", *(f"{k}={v}" for k, v in extra.items())] if extra else []
    return (f"# sbatch command\n{shlex.join([*command, *sbatch_argv(cfg)])}\n"
            f"# the srun line slurm/train.sbatch runs\n{srun_line(cfg, runner, environ)}\n")


@dataclasses.dataclass(frozen=True)
class Submission:
    job_id: str
    log: Path  # process 0's stdout
    logs: str  # where every task's files are (glob)


def make_log_dir(cfg: SlurmConfig) -> None:
    """The folder of the jobs' logs, or one ConfigError saying it cannot be made."""
    try:
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--log-dir", expected="a folder this user can create and write", found=cfg.log_dir,
                          fix=f"pass another --log-dir ({exc.strerror})") from exc


def run_sbatch(cfg: SlurmConfig, argv: list[str], runner: Runner) -> str:
    """Submit `argv` (an sbatch command line) with the tasks' environment; the job id sbatch prints."""
    extra = task_environment(cfg, os.environ)
    try:
        out = runner.run(argv, capture=True, env={**os.environ, **extra} if extra else None).stdout
    except subprocess.CalledProcessError as exc:
        raise slurm_refused("sbatch", f"{exc.stderr or ''}\n{exc.output or ''}", exc.returncode) from None
    return out.strip().split(";")[0]


def submit(cfg: SlurmConfig, runner: Runner) -> Submission:
    make_log_dir(cfg)
    if cfg.via == "sbatch" or cfg.image:
        job_id = run_sbatch(cfg, sbatch_argv(cfg), runner)
        return Submission(job_id, Path(cfg.log_dir) / f"{job_id}-0.log", f"{cfg.log_dir}/{job_id}-*")
    import submitit
    from submitit.core.utils import FailedJobError

    from deploy.slurm.task import JobTask

    executor = submitit.SlurmExecutor(folder=cfg.log_dir, python=shlex.quote(cfg.task_python))
    executor.update_parameters(**submitit_parameters(cfg))
    said = io.StringIO()  # submitit prints sbatch's stderr itself; we say it in one line instead
    try:
        with contextlib.redirect_stderr(said):
            job = executor.submit(JobTask(), list(cfg.args))
    except FailedJobError as exc:
        raise slurm_refused("sbatch", str(exc), 1) from None
    sys.stderr.write(said.getvalue())
    return Submission(job.job_id, Path(str(job.paths.stdout).replace("%t", "0")), f"{cfg.log_dir}/{job.job_id}_*")


def job_state(job_id: str, runner: Runner) -> tuple[str, int | None]:
    """(state, exit code when finished). squeue while queued or running, sacct after."""
    queued = runner.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture=True, check=False, mutating=False)
    state = queued.stdout.strip()
    if queued.returncode == 0 and state:
        return state, None
    done = runner.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode"],
                      capture=True, check=False, mutating=False)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        return "UNKNOWN", None
    state, _, code = lines[-1].partition("|")
    state = state.split()[0]
    return state, int(code.split(":")[0]) if state in FINISHED else None


def wait(sub: Submission, runner: Runner, poll_s: float = 1.0) -> int:
    """Stream process 0's log until the job ends; return its exit code (1 if it failed without one)."""
    offset, state, code = 0, "PENDING", None
    while True:
        state, code = job_state(sub.job_id, runner)
        if sub.log.exists():
            with sub.log.open("rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset += len(chunk)
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
        if state in FINISHED:
            break
        time.sleep(poll_s)
    if state != "COMPLETED":
        _show_failures(sub)
        log.error("job %s ended %s with exit code %s", sub.job_id, state, code)
        return code or 1
    log.info("job %s completed", sub.job_id)
    return 0


def _show_failures(sub: Submission) -> None:
    for path in sorted(map(Path, glob.glob(sub.logs))):
        text = path.read_text(errors="replace")
        if any(word in text for word in ("Traceback", "Error", "error:", "Killed")):
            tail = "\n".join(text.splitlines()[-15:])
            print(f"--- {path} (last lines) ---\n{tail}", file=sys.stderr)


def said(exc: ConfigError | SubmitError) -> int:
    """`exc` on one line of stderr; the exit code it means: 2 for bad input, 1 for a refusal by Slurm."""
    print(f"error: {exc}", file=sys.stderr)
    return BAD_INPUT_EXIT_CODE if isinstance(exc, ConfigError) else 1


def parse(argv: list[str]) -> SlurmConfig:
    parser = argparse.ArgumentParser(prog="python -m deploy.slurm", description="Submit the job to Slurm.")
    parser.add_argument("--nodes", default="1")
    for flag in ("--partition", "--time", "--gpus-per-node", "--tasks-per-node", "--gpu-type",
                 "--cpus-per-task", "--mem", "--constraint", "--account", "--qos", "--image", "--container-runtime",
                 "--python", "--via"):
        parser.add_argument(flag, default="")
    for flag in ("--gres", "--exclusive", "--dry-run", "--wait"):  # bare (= 1) or with make's value: an on/off word
        parser.add_argument(flag, nargs="?", const="1", default="")
    parser.add_argument("--sweep", default="", help="grid words or a sweep file: one job array of the sweep's runs")
    parser.add_argument("--sweep-parallel", default="", help="the job array's %%N limit: elements running at once")
    parser.add_argument("--retries", default="", help="RETRIES: restarts after a failure, each away from the node "
                        "that failed (default 3; 0: none); preemptions requeue without spending them")
    parser.add_argument("--spares", default="", help="SPARES: nodes asked beyond NODES, for a failed node's "
                        "replacement inside the allocation (default 0)")
    parser.add_argument("--log-dir", default=SlurmConfig.log_dir)
    parser.add_argument("--sbatch-args", type=shell_words, default=(),
                        help="more sbatch options as one shell-style string, each word --flag or --flag=value")
    parser.add_argument("--args", type=shell_words, default=None,
                        help="the job's arguments as one shell-style string (what make passes); or give them after --")
    cut = argv.index("--") if "--" in argv else len(argv)
    refuse_dash_values(parser, argv[:cut])
    a = parser.parse_args(argv[:cut])
    blank = lambda v: v or None  # noqa: E731  (make passes empty strings for unset variables)
    return SlurmConfig(
        nodes=count("NODES", a.nodes, 1), partition=blank(a.partition), time=a.time or SlurmConfig.time,
        gpus_per_node=count("GPUS_PER_NODE", a.gpus_per_node or "0", 0),
        tasks_per_node=count("TASKS_PER_NODE", a.tasks_per_node, 1) if a.tasks_per_node else None,
        gpu_type=blank(a.gpu_type), gres=switch("GRES", a.gres),
        cpus_per_task=count("CPUS_PER_TASK", a.cpus_per_task, 1) if a.cpus_per_task else None,
        mem=blank(a.mem), exclusive=switch("EXCLUSIVE", a.exclusive), constraint=blank(a.constraint),
        account=blank(a.account), qos=blank(a.qos), image=blank(a.image),
        container_runtime=a.container_runtime or "auto", sbatch_args=a.sbatch_args, python=blank(a.python),
        via=a.via or "submitit", wait=switch("WAIT", a.wait), dry_run=switch("DRY_RUN", a.dry_run), log_dir=a.log_dir,
        args=tuple(argv[cut + 1:]) or a.args or SlurmConfig.args, sweep=blank(a.sweep.strip()),
        sweep_parallel=count("SWEEP_PARALLEL", a.sweep_parallel, 1) if a.sweep_parallel else None,
        retries=count("RETRIES", a.retries, 0) if a.retries else SlurmConfig.retries,
        spares=count("SPARES", a.spares, 0) if a.spares else 0,
    )


def main(argv: list[str] | None = None, runner: Runner | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[submit] %(message)s")
    runner = runner or Runner()
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
        validate(cfg, runner)
        if cfg.sweep is not None:
            raise ConfigError("SWEEP", expected="python -m deploy.slurm (deploy/slurm/array.py) to submit a sweep",
                              found=cfg.sweep, fix="run make submit-slurm SWEEP=... or python -m deploy.slurm")
        if cfg.sweep_parallel is not None:
            raise ConfigError("SWEEP_PARALLEL", expected="SWEEP with it (the job array's limit)",
                              found=f"SWEEP_PARALLEL={cfg.sweep_parallel} without SWEEP",
                              fix="add SWEEP='optim.lr=1e-3,3e-3', or leave SWEEP_PARALLEL unset")
        if cfg.dry_run:
            print(dry_run(cfg, runner), end="")
            print("# DRY_RUN=1: nothing submitted", file=sys.stderr)
            return 0
        sub = submit(cfg, runner)
    except (ConfigError, SubmitError) as exc:
        return said(exc)
    spares = f" (+{cfg.spares} spare)" if cfg.spares else ""
    print(f"submitted Slurm job {sub.job_id}: {cfg.nodes} node(s){spares} x {cfg.ntasks_per_node} task(s), "
          f"python -m job {' '.join(cfg.args)}")
    print(f"  process 0 log: {sub.log}\n  all task logs: {sub.logs}")
    print(f"  follow: tail -f {sub.log}   cancel: scancel {sub.job_id}   check: squeue -j {sub.job_id}; "
          f"sacct -j {sub.job_id}")
    return wait(sub, runner) if cfg.wait else 0

