"""Submit the job to Slurm: through submitit (default) or the plain sbatch script.

    python -m deploy.slurm --nodes 4 [--partition P] [--time 01:00:00] [--gpus-per-node 8]
                           [--cpus-per-task N] [--account A] [--qos Q] [--image IMG]
                           [--via submitit|sbatch] [--wait] -- train --steps 500

One task per node, or one per GPU with --gpus-per-node. Every check runs
before anything is submitted. With --wait it streams process 0's log and
exits with the job's status.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import re
import sys
import time
from pathlib import Path

from deploy.runner import Runner, shell_words
from job.errors import ConfigError, refuse_dash_values

log = logging.getLogger("deploy.slurm")

ROOT = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = ROOT / "slurm" / "train.sbatch"
LOCAL_CLUSTER_ENV = "/var/tmp/jax-job-slurm/env.sh"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}
_TIME = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # Slurm account and QOS names: one word (submitit writes `#SBATCH` lines)


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    nodes: int = 1  # nodes of the allocation
    partition: str | None = None  # None: the cluster's default partition
    time: str = "01:00:00"  # time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
    gpus_per_node: int = 0  # 0: one task per node (CPU); N: N tasks per node, one GPU each
    cpus_per_task: int | None = None  # CPUs per task; None: Slurm's default
    account: str | None = None  # --account
    qos: str | None = None  # --qos
    image: str | None = None  # container image: runs through slurm/train.sbatch (pyxis or apptainer)
    via: str = "submitit"  # submitit or sbatch
    wait: bool = False  # wait for the end, streaming process 0's log; exit with the job's status
    job_name: str = "jax-job"  # Slurm job name
    log_dir: str = "runs/slurm-logs"  # per-task logs (and submitit's files)
    signal_delay_s: int = 120  # USR2 this long before the time limit: save and requeue
    args: tuple[str, ...] = ("train", "--run-dir", "runs/slurm")  # what `python -m job` runs

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node or 1


def time_minutes(text: str) -> int:
    """Slurm's time formats -> whole minutes (rounded up)."""
    m = _TIME.fullmatch(text)
    if not m:
        raise ConfigError("TIME", expected="MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS", found=text,
                          fix="e.g. TIME=04:00:00 or TIME=1-00:00:00")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:  # MM
        seconds = a * 60
    if seconds <= 0:
        raise ConfigError("TIME", expected="a positive duration", found=text, fix="e.g. TIME=01:00:00")
    return -(-seconds // 60)


def _count(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text) if re.fullmatch(r"[0-9]+", text) else minimum - 1
    except ValueError:  # more digits than int() takes
        value = minimum - 1
    if value < minimum:
        raise ConfigError(name, expected=f"a whole number >= {minimum}", found=text, fix=f"e.g. {name}=4")
    return value


def validate(cfg: SlurmConfig, runner: Runner) -> None:
    """Everything that can be checked before submitting."""
    time_minutes(cfg.time)
    if cfg.via not in ("submitit", "sbatch"):
        raise ConfigError("VIA", expected="submitit or sbatch", found=cfg.via, fix="VIA=sbatch or leave it unset")
    for what, value in (("ACCOUNT", cfg.account), ("QOS", cfg.qos)):
        if value is not None and not _NAME.fullmatch(value):
            raise ConfigError(what, expected="one Slurm name: letters, digits, '_', '.', '+' or '-'", found=value,
                              fix=f"use the name `sacctmgr show assoc user=$USER` lists, or leave {what} unset")
    # Both travel in --export=ALL,IMAGE=...,JOB_LOG_DIR=...: a comma would start another variable.
    if cfg.image is not None and (not cfg.image.isprintable() or any(c.isspace() or c == "," for c in cfg.image)):
        raise ConfigError("IMAGE", expected="one image reference without spaces, commas or control characters",
                          found=cfg.image, fix="e.g. IMAGE=docker://ghcr.io/you/jax-cluster-job:cuda")
    if not cfg.log_dir.isprintable() or "," in cfg.log_dir:
        raise ConfigError("--log-dir", expected="a folder path without commas or control characters",
                          found=cfg.log_dir, fix="pass --log-dir runs/slurm-logs")
    if any("\0" in arg for arg in cfg.args):
        raise ConfigError("ARGS", expected="arguments without NUL bytes", found=cfg.args, fix="remove the NUL bytes")
    if runner.which("sbatch") is None:
        raise ConfigError(
            "sbatch", expected="Slurm's sbatch on PATH", found="no sbatch",
            fix="run this on a Slurm login node, or start the local cluster: `make slurm-up NODES=4` "
                f"(then `source {LOCAL_CLUSTER_ENV}`, which make submit-slurm does for you)",
        )
    if cfg.partition is not None:
        listed = runner.run(["sinfo", "-h", "-o", "%P"], capture=True, mutating=False).stdout.split()
        partitions = sorted({p.rstrip("*") for p in listed})
        if cfg.partition not in partitions:
            raise ConfigError("PARTITION", expected=f"one of {', '.join(partitions)}", found=cfg.partition,
                              fix="pick a listed partition (sinfo shows them) or leave PARTITION unset")


def submitit_parameters(cfg: SlurmConfig) -> dict[str, object]:
    """The SlurmExecutor parameters (also what the golden files pin)."""
    params: dict[str, object] = {
        "job_name": cfg.job_name,
        "nodes": cfg.nodes,
        "ntasks_per_node": cfg.tasks_per_node,
        "time": time_minutes(cfg.time),
        "signal_delay_s": cfg.signal_delay_s,
        "srun_args": ["--kill-on-bad-exit=1"],
        "stderr_to_stdout": True,
    }
    optional = {"partition": cfg.partition, "cpus_per_task": cfg.cpus_per_task, "account": cfg.account,
                "qos": cfg.qos, "gpus_per_node": cfg.gpus_per_node or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def sbatch_argv(cfg: SlurmConfig) -> list[str]:
    argv = ["sbatch", "--parsable", f"--job-name={cfg.job_name}", f"--nodes={cfg.nodes}",
            f"--ntasks-per-node={cfg.tasks_per_node}", f"--time={cfg.time}",
            f"--signal=USR2@{cfg.signal_delay_s}", f"--output={cfg.log_dir}/%j-batch.log"]
    for flag, value in (("partition", cfg.partition), ("account", cfg.account), ("qos", cfg.qos),
                        ("cpus-per-task", cfg.cpus_per_task)):
        if value is not None:
            argv.append(f"--{flag}={value}")
    if cfg.gpus_per_node:
        argv.append(f"--gpus-per-node={cfg.gpus_per_node}")
    export = [f"JOB_PYTHON={sys.executable}", f"JOB_LOG_DIR={cfg.log_dir}"] + ([f"IMAGE={cfg.image}"] if cfg.image else [])
    argv.append("--export=ALL," + ",".join(export))
    return [*argv, str(SBATCH_SCRIPT), *cfg.args]


@dataclasses.dataclass(frozen=True)
class Submission:
    job_id: str
    log: Path  # process 0's stdout
    logs: str  # where every task's files are (glob)


def submit(cfg: SlurmConfig, runner: Runner) -> Submission:
    try:
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--log-dir", expected="a folder this user can create and write", found=cfg.log_dir,
                          fix=f"pass another --log-dir ({exc.strerror})") from exc
    if cfg.via == "sbatch" or cfg.image:
        job_id = runner.run(sbatch_argv(cfg), capture=True).stdout.strip().split(";")[0]
        return Submission(job_id, Path(cfg.log_dir) / f"{job_id}-0.log", f"{cfg.log_dir}/{job_id}-*")
    import submitit

    from deploy.slurm_task import JobTask

    executor = submitit.SlurmExecutor(folder=cfg.log_dir)
    executor.update_parameters(**submitit_parameters(cfg))
    job = executor.submit(JobTask(), list(cfg.args))
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


def parse(argv: list[str]) -> SlurmConfig:
    parser = argparse.ArgumentParser(prog="python -m deploy.slurm", description="Submit the job to Slurm.")
    parser.add_argument("--nodes", default="1")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default=SlurmConfig.time)
    parser.add_argument("--gpus-per-node", default="0")
    parser.add_argument("--cpus-per-task", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--qos", default=None)
    parser.add_argument("--image", default=None)
    parser.add_argument("--via", default="submitit")
    parser.add_argument("--wait", action="store_true")
    parser.add_argument("--log-dir", default=SlurmConfig.log_dir)
    parser.add_argument("--args", type=shell_words, default=None,
                        help="the job's arguments as one shell-style string (what make passes); or give them after --")
    cut = argv.index("--") if "--" in argv else len(argv)
    refuse_dash_values(parser, argv[:cut])
    args = parser.parse_args(argv[:cut])
    job_args = tuple(argv[cut + 1:]) or args.args or SlurmConfig.args
    blank = lambda v: v or None  # noqa: E731  (make passes empty strings for unset variables)
    return SlurmConfig(
        nodes=_count("NODES", args.nodes, 1),
        partition=blank(args.partition),
        time=args.time or SlurmConfig.time,
        gpus_per_node=_count("GPUS_PER_NODE", args.gpus_per_node or "0", 0),
        cpus_per_task=_count("CPUS_PER_TASK", args.cpus_per_task, 1) if args.cpus_per_task else None,
        account=blank(args.account), qos=blank(args.qos), image=blank(args.image),
        via=args.via or "submitit", wait=args.wait, log_dir=args.log_dir, args=job_args,
    )


def main(argv: list[str] | None = None, runner: Runner | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[submit] %(message)s")
    runner = runner or Runner()
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
        validate(cfg, runner)
        sub = submit(cfg, runner)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"submitted Slurm job {sub.job_id}: {cfg.nodes} node(s) x {cfg.tasks_per_node} task(s), "
          f"python -m job {' '.join(cfg.args)}")
    print(f"  process 0 log: {sub.log}\n  all task logs: {sub.logs}")
    print(f"  follow: tail -f {sub.log}   cancel: scancel {sub.job_id}   check: squeue -j {sub.job_id}; "
          f"sacct -j {sub.job_id}")
    return wait(sub, runner) if cfg.wait else 0


if __name__ == "__main__":
    sys.exit(main())
