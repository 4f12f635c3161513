"""A sweep on Slurm: one job array, each element one run, a whole multi-node job (`make submit-slurm SWEEP=...`).

    make submit-slurm NODES=2 SWEEP='optim.lr=1e-3,3e-3 seed=0,1' SWEEP_PARALLEL=2 WAIT=1 \
        ARGS='train --steps 40 --run-dir runs/sweep1'

Every run is checked on this machine first (with GPUs, its batch against NODES x GPUS_PER_NODE
devices); one bad value is one error naming the run and nothing is submitted. Then
SWEEP_DIR/sweep.json is written and one array of the runs not yet completed is submitted,
`SWEEP_PARALLEL` of them at once (the array's `%N`):

- through submitit (the default): `map_array`, each element unpickling its own run's flags
  (submitit numbers the elements 0..K-1 over the runs submitted, in the sweep's order);
- through slurm/train.sbatch (`VIA=sbatch`, or IMAGE): `sbatch --array=1,3%2`, the array's indices
  the runs' places in the sweep, each element running `python -m job sweep-run SWEEP_DIR`, which
  reads its run from sweep.json at `$SLURM_ARRAY_TASK_ID`.

An element is requeued as a single job is (slurm/requeue.sh): its SLURM_JOB_ID is its own, so
`scontrol requeue` requeues that element alone. With WAIT=1 this waits for every element and
exits 1 when any did not complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deploy import sweeps
from deploy.runner import Runner
from deploy.slurm.options import SlurmConfig
from deploy.slurm.submit import (
    SBATCH_SCRIPT,
    SubmitError,
    make_log_dir,
    parse,
    run_sbatch,
    said,
    sbatch_argv,
    slurm_refused,
    srun_line,
    submitit_parameters,
    validate,
)
from deploy.slurm.submit import main as submit_main
from job.core import internals
from job.errors import ConfigError
from job.observe.status import State, state_of

log = logging.getLogger("deploy.slurm")

SWEEP_RUN = "sweep-run"  # `python -m job sweep-run SWEEP_DIR [INDEX]`: the sbatch route's element


def devices(cfg: SlurmConfig) -> int | None:
    """The job's device count where it is known before it starts: its GPUs (a CPU task's count is its own)."""
    return cfg.nodes * cfg.gpus_per_node if cfg.gpus_per_node else None


def array_spec(indices: Sequence[int], parallel: int | None) -> str:
    """sbatch's --array value: '0-3%2', '1,3', '0-2,5-6%4' (runs of consecutive indices as ranges)."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts) + (f"%{parallel}" if parallel else "")


def element_config(cfg: SlurmConfig, todo: sweeps.Todo) -> SlurmConfig:
    """The sbatch route's element: `python -m job sweep-run SWEEP_DIR`, its run found at its array index."""
    return dataclasses.replace(cfg, args=(SWEEP_RUN, todo.sweep.folder))


def array_sbatch_argv(cfg: SlurmConfig, todo: sweeps.Todo) -> list[str]:
    argv = sbatch_argv(element_config(cfg, todo))
    at = argv.index(str(SBATCH_SCRIPT))
    return [*argv[:at], f"--array={array_spec(todo.indices, cfg.sweep_parallel)}", *argv[at:]]


def array_parameters(cfg: SlurmConfig, todo: sweeps.Todo) -> dict[str, object]:
    """submitit's parameters for the array: the job's, with the element count and the %N limit."""
    params = submitit_parameters(cfg)
    params["array_parallelism"] = cfg.sweep_parallel or len(todo.indices)
    return params


@dataclasses.dataclass(frozen=True)
class Array:
    job_id: str  # the array's job id (SLURM_ARRAY_JOB_ID)
    runs: dict[str, str]  # element id 'JOBID_TASK' -> its run's name


def submit(cfg: SlurmConfig, todo: sweeps.Todo, runner: Runner) -> Array:
    """One array of `todo`'s runs; a single run goes through submitit as a plain job (its id without '_N')."""
    sweeps_runs = todo.runs
    make_log_dir(cfg)
    if cfg.via == "sbatch" or cfg.image:
        job_id = run_sbatch(cfg, array_sbatch_argv(cfg, todo), runner)
        return Array(job_id, {f"{job_id}_{i}": run.name for i, run in zip(todo.indices, sweeps_runs, strict=True)})
    import submitit
    from submitit.core.utils import FailedJobError

    from deploy.slurm.task import JobTask

    executor = submitit.SlurmExecutor(folder=cfg.log_dir, python=shlex.quote(cfg.task_python))
    executor.update_parameters(**array_parameters(cfg, todo))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            jobs = executor.map_array(JobTask(), [list(run.flags) for run in sweeps_runs])
    except FailedJobError as exc:
        raise slurm_refused("sbatch", str(exc), 1) from None
    sys.stderr.write(said.getvalue())
    job_id = jobs[0].job_id.split("_")[0]
    return Array(job_id, {job.job_id: run.name for job, run in zip(jobs, sweeps_runs, strict=True)})


def queued(array: Array, runner: Runner) -> dict[str, tuple[str, str]]:
    """The elements still in the queue: element id -> (state, its own job id: SLURM_JOB_ID once it started)."""
    out = runner.run(["squeue", "-h", "-r", "-j", array.job_id, "-o", "%i|%A|%T"], capture=True, check=False,
                     mutating=False)
    found = {}
    for line in out.stdout.splitlines():
        element, own, state = (line.strip().split("|") + ["", ""])[:3]
        if element in array.runs:
            found[element] = (state, own)
    return found


def finished(own_id: str | None, runner: Runner) -> tuple[str, int | None]:
    """A finished element's (state, exit code) from sacct by its own job id; ('FAILED', None) when not found."""
    if own_id:
        done = runner.run(["sacct", "-n", "-P", "-X", "-j", own_id, "-o", "JobID,State,ExitCode"],
                          capture=True, check=False, mutating=False)
        for line in reversed(done.stdout.splitlines()):
            job, _, rest = line.strip().partition("|")
            state, _, code = rest.partition("|")
            if job == own_id and state:
                return state.split()[0], int(code.split(":")[0]) if code else None
    return "FAILED", None


def wait(array: Array, todo: sweeps.Todo, runner: Runner, poll_s: float = 2.0) -> int:
    """Until every element has left the queue, saying each change of state; 0 when every run completed, else 1.
    A run completed when its own files say so (`job.observe.status`); sacct gives the others' state and code."""
    seen: dict[str, str] = {}
    own: dict[str, str] = {}
    dirs = {run.name: run.run_dir for run in todo.runs}
    outcome: dict[str, tuple[str, int | None]] = {}
    while len(outcome) < len(array.runs):
        now = queued(array, runner)
        for element, (state, job) in now.items():
            if state != "PENDING" and job:  # a pending element not yet split off shows the array's id
                own[element] = job
        for element in array.runs:
            if element in outcome:
                continue
            if element in now:
                state = now[element][0]
            elif state_of(dirs[array.runs[element]]).state is State.COMPLETED:
                state, outcome[element] = "COMPLETED", ("COMPLETED", 0)
            else:
                outcome[element] = finished(own.get(element), runner)
                state = outcome[element][0]
            if seen.get(element) != state:
                code = outcome.get(element, (None, None))[1]
                log.info("%s (%s): %s%s", element, array.runs[element], state,
                         f", exit code {code}" if code is not None and state != "COMPLETED" else "")
                seen[element] = state
        if len(outcome) < len(array.runs):
            time.sleep(poll_s)
    failed = {e: s for e, (s, _) in outcome.items() if s != "COMPLETED"}
    if failed:
        log.error("%d of %d element(s) did not complete: %s. Fix: read their logs, then submit the same command "
                  "again (completed runs are skipped, the others resume)", len(failed), len(outcome),
                  ", ".join(f"{array.runs[e]} ({s})" for e, s in sorted(failed.items())))
        return 1
    log.info("array %s: all %d run(s) completed", array.job_id, len(outcome))
    return 0


def dry_run(cfg: SlurmConfig, todo: sweeps.Todo, runner: Runner) -> str:
    """The sweep's listing, then the array submission: submitit's batch script, or sbatch and the srun line."""
    if cfg.via == "submitit" and not cfg.image:
        folder = Path(cfg.log_dir).expanduser().absolute()
        command = f"{shlex.quote(cfg.task_python)} -u -m {internals.SUBMITIT_TASK_MODULE} {shlex.quote(str(folder))}"
        script = internals.submitit_sbatch_script(command, folder, map_count=len(todo.indices),
                                                  **array_parameters(cfg, todo))
        return f"{script.rstrip()}\n# each element: python -m job FLAGS of its run (submitit's map_array)\n"
    return (f"# sbatch command\n{shlex.join(array_sbatch_argv(cfg, todo))}\n"
            f"# the srun line slurm/train.sbatch runs in each element\n"
            f"{srun_line(element_config(cfg, todo), runner)}\n")


def main(argv: list[str] | None = None, runner: Runner | None = None) -> int:
    """`python -m deploy.slurm`: a sweep (SWEEP) as one job array, anything else as one job (`submit.main`)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse(argv)
    except ConfigError:
        cfg = None  # submit.main says what is wrong
    if cfg is None or cfg.sweep is None:
        return submit_main(argv, runner)
    logging.basicConfig(level=logging.INFO, format="[submit] %(message)s")
    runner = runner or Runner()
    try:
        validate(cfg, runner)
    except ConfigError as exc:
        return said(exc)
    return submit_sweep(cfg, runner)


def submit_sweep(cfg: SlurmConfig, runner: Runner) -> int:
    """Check, plan, submit the array (or print it); the exit code of `make submit-slurm SWEEP=...`."""
    assert cfg.sweep is not None
    try:
        todo = sweeps.runs_to_start(cfg.sweep, cfg.args, devices(cfg), save=not cfg.dry_run)
    except ConfigError as exc:
        code = said(exc)
        print("nothing was submitted", file=sys.stderr)
        return code
    if cfg.dry_run:
        print(sweeps.listing(todo.sweep))
        if todo.indices:
            print(dry_run(cfg, todo, runner), end="")
        print(f"# DRY_RUN=1: {todo.summary('submit')}; nothing submitted", file=sys.stderr)
        return 0
    print(f"sweep {todo.sweep.folder}: {todo.summary('submit')}")
    if not todo.indices:
        return 0
    try:
        array = submit(cfg, todo, runner)
    except (ConfigError, SubmitError) as exc:
        return said(exc)
    limit = f", {cfg.sweep_parallel} at once" if cfg.sweep_parallel else ""
    print(f"submitted Slurm job array {array.job_id}: {len(array.runs)} run(s){limit}, each {cfg.nodes} node(s) x "
          f"{cfg.ntasks_per_node} task(s)")
    for element, name in array.runs.items():
        print(f"  {element}: {todo.sweep.folder}/{name}")
    print(f"  logs: {cfg.log_dir}   check: squeue -r -j {array.job_id}; python -m job runs {todo.sweep.folder}   "
          f"cancel: scancel {array.job_id}")
    return wait(array, todo, runner) if cfg.wait else 0


__all__ = ["SWEEP_RUN", "Array", "array_parameters", "array_sbatch_argv", "array_spec", "devices", "dry_run", "main",
           "finished", "queued", "submit", "submit_sweep", "wait"]
