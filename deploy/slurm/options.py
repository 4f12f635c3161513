"""What `make submit-slurm` asks Slurm for: the config, its checks, and the GPU layouts.

GPUS_PER_NODE=G and TASKS_PER_NODE=T (default G, or 1 without GPUs) become one
request, the same on the submitit and the sbatch path:

| layout         | sbatch options                                   | what each task sees                         |
|----------------|--------------------------------------------------|---------------------------------------------|
| G > 0, T = 1   | --gpus-per-node=[type:]G                         | all G GPUs of its node                      |
| G > 0, T > 1   | --ntasks-per-node=T --gpus-per-task=[type:]G/T   | its own G/T GPUs (Slurm binds them)         |
| GRES=1         | --ntasks-per-node=T --gres=gpu[:type]:G          | all G; the job takes its share by SLURM_LOCALID |

Every check here runs before anything is submitted and raises ConfigError
naming the make variable.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from job.core import values
from job.core.flags import require_command
from job.errors import ConfigError, as_config_error

ROOT = Path(__file__).resolve().parents[2]
CUDA_PYTHON = ROOT / ".venv-cuda" / "bin" / "python"  # `make venv FLAVOR=cuda`
RUNTIMES = ("auto", "pyxis", "apptainer", "podman")
# XLA flags for the GPU path, from jax's GPU performance tips (docs.jax.dev/en/latest/gpu_performance_tips.html,
# also baked into NVIDIA's JAX-Toolbox images): overlap collectives with compute. Off by default in XLA.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
# Read-only probe of the tasks' interpreter: exit 0 when it has jax's CUDA plugin.
GPU_PROBE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('jax_cuda12_plugin') else 3)"

_TIME = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # Slurm account and QOS names: one word (submitit writes `#SBATCH` lines)
_GPU_TYPE = re.compile(r"[A-Za-z0-9_.-]+")  # a GRES type (a100, h100_80gb): no ':' or ','
_MEM = re.compile(r"[0-9]+[KMGTkmgt]?")  # Slurm's --mem: a number of MB, or with a K/M/G/T suffix; 0 = all
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.:&|*()\[\]-]+")  # features joined by & | [] () and counts *N
_SBATCH_WORD = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.DOTALL)
# sbatch options this command sets itself: an SBATCH_ARGS word that names one, or abbreviates one (sbatch
# takes unique abbreviations), is refused with the fix.
_SET_BY = "remove it: make submit-slurm sets it"
OURS = {
    "nodes": "use NODES=N", "ntasks": "use NODES and TASKS_PER_NODE", "ntasks-per-node": "use TASKS_PER_NODE",
    "ntasks-per-gpu": "use TASKS_PER_NODE", "time": "use TIME", "partition": "use PARTITION",
    "account": "use ACCOUNT", "qos": "use QOS", "gpus": "use GPUS_PER_NODE",
    "gpus-per-node": "use GPUS_PER_NODE (and GPU_TYPE)", "gpus-per-task": "use GPUS_PER_NODE and TASKS_PER_NODE",
    "gpus-per-socket": "use GPUS_PER_NODE", "gres": "use GRES=1 with GPUS_PER_NODE (and GPU_TYPE)",
    "tres-per-task": "use GPUS_PER_NODE and CPUS_PER_TASK", "cpus-per-task": "use CPUS_PER_TASK",
    "cpus-per-gpu": "use CPUS_PER_TASK", "mem": "use MEM", "mem-per-cpu": "use MEM (per node)",
    "mem-per-gpu": "use MEM (per node)", "exclusive": "use EXCLUSIVE=1", "constraint": "use CONSTRAINT",
    "wrap": "use ARGS", "wait": "use WAIT=1", "output": "use --log-dir", "error": "use --log-dir",
    "export": "export the variable in the shell that runs make: sbatch passes every one on",
    "export-file": "export the variables in the shell that runs make: sbatch passes every one on",
    "job-name": _SET_BY, "signal": _SET_BY, "requeue": _SET_BY + " (always on)", "no-requeue": _SET_BY,
    "open-mode": _SET_BY, "parsable": _SET_BY, "array": _SET_BY + " (one job, not an array)",
    "chdir": "remove it and run make from the folder the job should run in",
}


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    nodes: int = 1  # NODES: nodes of the allocation
    partition: str | None = None  # PARTITION; None: the cluster's default partition
    time: str = "01:00:00"  # TIME: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
    gpus_per_node: int = 0  # GPUS_PER_NODE (G); 0: no GPUs
    tasks_per_node: int | None = None  # TASKS_PER_NODE (T); None: G when G > 0, else 1 (see ntasks_per_node)
    gpu_type: str | None = None  # GPU_TYPE: a GRES type such as a100 (asks for a100:G); None: any GPU
    gres: bool = False  # GRES=1: --gres=gpu[:type]:G per node (sites with select/cons_res), not --gpus-per-*
    cpus_per_task: int | None = None  # CPUS_PER_TASK (given to srun too); None: Slurm's default
    mem: str | None = None  # MEM: memory per node, Slurm's form (64G, 500M; 0: all of it); None: Slurm's default
    exclusive: bool = False  # EXCLUSIVE=1: whole nodes, shared with no other job
    constraint: str | None = None  # CONSTRAINT: node features for --constraint, e.g. 'a100&ib'
    account: str | None = None  # ACCOUNT: --account
    qos: str | None = None  # QOS: --qos
    image: str | None = None  # IMAGE: container image; runs through slurm/train.sbatch
    container_runtime: str = "auto"  # CONTAINER_RUNTIME with IMAGE: auto (pyxis, else apptainer), pyxis, apptainer, podman
    sbatch_args: tuple[str, ...] = ()  # SBATCH_ARGS: more sbatch options, each word --flag or --flag=value
    python: str | None = None  # PYTHON: the tasks' interpreter without IMAGE; None: see task_python
    via: str = "submitit"  # VIA: submitit or sbatch (IMAGE always goes through sbatch)
    wait: bool = False  # WAIT=1: wait for the end, streaming process 0's log; exit with the job's status
    dry_run: bool = False  # DRY_RUN=1: print the batch script (or sbatch argv and srun line), submit nothing
    job_name: str = "jax-job"  # Slurm job name
    log_dir: str = "runs/slurm-logs"  # per-task logs (and submitit's files)
    signal_delay_s: int = 120  # USR2 this long before the time limit: save and requeue
    args: tuple[str, ...] = ("train", "--run-dir", "runs/slurm")  # what `python -m job` runs
    sweep: str | None = None  # SWEEP: grid words or a sweep file; one job array of its runs (deploy/slurm/array.py)
    sweep_parallel: int | None = None  # SWEEP_PARALLEL: the array's %N, elements running at once; None: no limit
    retries: int = 3  # RETRIES: a failed attempt (not 0, 2 or 75) is restarted away from its node this often
    spares: int = 0  # SPARES: nodes asked beyond NODES; a failed node's process restarts on one, in the allocation

    @property
    def allocated_nodes(self) -> int:
        """What the job asks Slurm for: NODES + SPARES."""
        return self.nodes + self.spares

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def task_python(self) -> str:
        """The tasks' interpreter without IMAGE: PYTHON, else .venv-cuda's with GPUs, else this one."""
        return self.python or (str(CUDA_PYTHON) if self.gpus_per_node else sys.executable)


def duration_seconds(text: str) -> int | None:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> seconds; None for anything else."""
    m = _TIME.fullmatch(text)
    if not m:
        return None
    days, a, b, c = (int(g) if g else None for g in m.groups())
    assert a is not None  # the regex's one required group
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # HH:MM:SS
        assert b is not None
        return a * 3600 + b * 60 + c
    if b is not None:  # MM:SS
        return a * 60 + b
    return a * 60  # MM


def time_minutes(text: str) -> int:
    """Slurm's time formats -> whole minutes (rounded up)."""
    seconds = duration_seconds(text)
    if seconds is None:
        raise ConfigError("TIME", expected="MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS", found=text,
                          fix="e.g. TIME=04:00:00 or TIME=1-00:00:00")
    if seconds <= 0:
        raise ConfigError("TIME", expected="a positive duration", found=text, fix="e.g. TIME=01:00:00")
    return -(-seconds // 60)


def count(name: str, text: str, minimum: int) -> int:
    """A make variable's whole number (plain ASCII digits only), at least `minimum`."""
    with as_config_error(name, fix=f"e.g. {name}=4"):
        return values.whole(text, minimum=minimum)


def switch(name: str, text: str) -> bool:
    """A make on/off variable: 1 or 0 (true/false, yes/no, on/off, as the TPU side takes them); empty is off."""
    with as_config_error(name, fix=f"{name}=1, or leave it unset"):
        return values.switch(text)


def check(cfg: SlurmConfig) -> None:
    """Every check that needs no cluster."""
    time_minutes(cfg.time)
    require_command(cfg.args)
    if cfg.via not in ("submitit", "sbatch"):
        raise ConfigError("VIA", expected="submitit or sbatch", found=cfg.via, fix="VIA=sbatch or leave it unset")
    for what, value in (("ACCOUNT", cfg.account), ("QOS", cfg.qos)):
        if value is not None and not _NAME.fullmatch(value):
            raise ConfigError(what, expected="one Slurm name: letters, digits, '_', '.', '+' or '-'", found=value,
                              fix=f"use the name `sacctmgr show assoc user=$USER` lists, or leave {what} unset")
    # IMAGE, PYTHON and --log-dir travel in --export=ALL,JOB_PYTHON=...,IMAGE=...: a comma would start another variable.
    # apptainer and podman read IMAGE where an option could be: a leading '-' would make it one.
    if cfg.image is not None and (not cfg.image.isprintable() or any(c.isspace() or c == "," for c in cfg.image)
                                  or cfg.image.startswith("-")):
        raise ConfigError("IMAGE", expected="one image reference without spaces, commas, control characters or a "
                          "leading '-'",
                          found=cfg.image, fix="e.g. IMAGE=docker://ghcr.io/you/jax-cluster-job:cuda")
    if cfg.python is not None and (not cfg.python.isprintable() or any(c.isspace() or c == "," for c in cfg.python)):
        raise ConfigError("PYTHON", expected="an interpreter path without spaces, commas or control characters",
                          found=cfg.python, fix="e.g. PYTHON=.venv-cuda/bin/python, or leave it unset")
    if not cfg.log_dir.isprintable() or "," in cfg.log_dir:
        raise ConfigError("--log-dir", expected="a folder path without commas or control characters",
                          found=cfg.log_dir, fix="pass --log-dir runs/slurm-logs")
    if any("\0" in arg for arg in cfg.args):
        raise ConfigError("ARGS", expected="arguments without NUL bytes", found=cfg.args, fix="remove the NUL bytes")
    _check_gpus(cfg)
    if cfg.mem is not None and not _MEM.fullmatch(cfg.mem):
        raise ConfigError("MEM", expected="memory per node in Slurm's form: a number with K, M, G or T (0: all)",
                          found=cfg.mem, fix="e.g. MEM=64G or MEM=0")
    if cfg.constraint is not None and not _CONSTRAINT.fullmatch(cfg.constraint):
        raise ConfigError("CONSTRAINT", expected="node features joined by '&', '|', '[]', '()' (letters, digits, "
                          "'_', '.', '-', ':', '*')", found=cfg.constraint, fix="e.g. CONSTRAINT='a100&ib'")
    if cfg.container_runtime not in RUNTIMES:
        raise ConfigError("CONTAINER_RUNTIME", expected=" or ".join(RUNTIMES), found=cfg.container_runtime,
                          fix="CONTAINER_RUNTIME=podman, or leave it unset (auto: pyxis, else apptainer)")
    if cfg.container_runtime != "auto" and not cfg.image:
        raise ConfigError("CONTAINER_RUNTIME", expected="IMAGE with it (it says how to run the image)",
                          found=f"CONTAINER_RUNTIME={cfg.container_runtime} without IMAGE",
                          fix="add IMAGE=..., or leave CONTAINER_RUNTIME unset")
    extra_options(cfg.sbatch_args)


def _check_gpus(cfg: SlurmConfig) -> None:
    g, t = cfg.gpus_per_node, cfg.ntasks_per_node
    if not g and (cfg.gpu_type or cfg.gres):
        what = "GPU_TYPE" if cfg.gpu_type else "GRES"
        raise ConfigError(what, expected="GPUS_PER_NODE > 0 with it", found=f"{what} without GPUS_PER_NODE",
                          fix=f"add GPUS_PER_NODE=N, or leave {what} unset")
    if cfg.gpu_type is not None and not _GPU_TYPE.fullmatch(cfg.gpu_type):
        raise ConfigError("GPU_TYPE", expected="one GRES type name (letters, digits, '_', '.', '-')",
                          found=cfg.gpu_type, fix="e.g. GPU_TYPE=a100 (`sinfo -o %G` lists the types)")
    if g and g % t:
        raise ConfigError("TASKS_PER_NODE", expected=f"a divisor of GPUS_PER_NODE={g} (every task gets as many "
                          "GPUs)", found=t, fix=f"TASKS_PER_NODE={g} (one task per GPU) or TASKS_PER_NODE=1")


def gpu_request(cfg: SlurmConfig) -> tuple[str, str] | None:
    """The one sbatch option (name, value) that asks for the GPUs; None without GPUs."""
    g, t = cfg.gpus_per_node, cfg.ntasks_per_node
    if not g:
        return None
    kind = f"{cfg.gpu_type}:" if cfg.gpu_type else ""
    if cfg.gres:
        return "gres", f"gpu:{kind}{g}"
    if t == 1:
        return "gpus-per-node", f"{kind}{g}"
    return "gpus-per-task", f"{kind}{g // t}"


def resource_options(cfg: SlurmConfig) -> list[tuple[str, str | bool]]:
    """The sbatch options (name, value; True: a bare flag) beyond nodes, tasks and time, in one order for both paths."""
    options: list[tuple[str, str | bool]] = []
    for name, value in (("partition", cfg.partition), ("account", cfg.account), ("qos", cfg.qos),
                        ("cpus-per-task", cfg.cpus_per_task), ("mem", cfg.mem), ("constraint", cfg.constraint)):
        if value is not None:
            options.append((name, str(value)))
    if cfg.exclusive:
        options.append(("exclusive", True))
    request = gpu_request(cfg)
    if request:
        options.append(request)
    return options


def spare_options(cfg: SlurmConfig) -> list[tuple[str, str | bool]]:
    """With SPARES, --no-kill: a node that fails does not end the job, a spare takes its place
    (deploy/slurm/supervise.py)."""
    return [("no-kill", True)] if cfg.spares else []


def extra_options(words: tuple[str, ...]) -> list[tuple[str, str | bool]]:
    """SBATCH_ARGS words -> (name, value; True: a bare flag), or ConfigError naming the word."""
    options: list[tuple[str, str | bool]] = []
    for word in words:
        m = _SBATCH_WORD.fullmatch(word)
        if not m:
            raise ConfigError("SBATCH_ARGS", expected="words of the form --flag or --flag=value (long sbatch "
                              "options)", found=word, fix="use the long form, e.g. SBATCH_ARGS='--begin=now+1hour'")
        name, value = m.groups()
        if value is not None and (not value or not value.isprintable() or "\\" in value):
            raise ConfigError("SBATCH_ARGS", expected=f"a value after --{name}= without control characters or "
                              "backslashes", found=word, fix=f"give --{name} a plain value, or drop '='")
        taken = [ours for ours in OURS if ours.startswith(name)]
        if taken:
            ours = name if name in OURS else taken[0]
            raise ConfigError("SBATCH_ARGS", expected="sbatch options that make submit-slurm does not set itself",
                              found=word, fix=f"--{ours}: {OURS[ours]}")
        options.append((name, True if value is None else value))
    return options


def task_environment(cfg: SlurmConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the tasks get on top of the submitting shell's (which sbatch exports, NCCL_* included)."""
    if not cfg.gpus_per_node:
        return {}
    return {"XLA_FLAGS": with_gpu_xla_flags(environ.get("XLA_FLAGS", ""))}


def with_gpu_xla_flags(flags: str) -> str:
    """`flags` plus each of GPU_XLA_FLAGS that it does not set already (either way: the user's value wins)."""
    def name(flag: str) -> str:
        bare = flag.lstrip("-").split("=", 1)[0]
        return bare[2:] if bare.startswith("noxla_") else bare

    given = {name(flag) for flag in flags.split()}
    added = [flag for flag in GPU_XLA_FLAGS if name(flag) not in given]
    return " ".join(part for part in (flags.strip(), *added) if part)
