"""The training loop, for any task: resume, train, evaluate, checkpoint, stop cleanly on preemption.

    python -m job.launch -n 4 --devices-per-process 2 -- python -m job train --steps 200
    python -m job train --task classify --run-dir runs/classify

The task (job/tasks/NAME/, see job/train/task.py) gives the model, its loss and the
rows of each batch; this loop, the checkpoints and the preemption protocol
are the same for every task. What a run builds before its first step (its mesh, the
state's plan, the jitted steps, the remat policy) is job/train/plan.py's.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from job.core import rundir, storage
from job.kernels.rematerialize import choosing
from job.observe import process_log
from job.observe.goodput import Goodput, describe
from job.observe.profile import StepProfiler
from job.observe.report import Reporter
from job.observe.stragglers import StragglerWatch
from job.parallel import sharding
from job.parallel.fingerprint import fingerprint
from job.parallel.multihost import on_process_zero
from job.runs import attempts, provenance, resume
from job.runs.tiers import Checkpoints, Origin
from job.runtime import compile_cache, preflight
from job.runtime.cluster import ClusterInfo, node_name
from job.runtime.compile_cache import CacheEvents
from job.runtime.distributed import initialize
from job.runtime.preemption import NOTICES, PreemptionGuard
from job.runtime.rollcall import Progress
from job.runtime.watchdog import Watchdog
from job.train import aside, memory, plan
from job.train.batches import Prefetch, global_batch
from job.train.config import TrainConfig, to_dict, to_json
from job.train.evaluation import summary_fields
from job.train.hang import Hang
from job.train.plan import Built
from job.train.steps import leaked_tracer_note
from job.train.task import Task

log = logging.getLogger("job.train")


def run(cfg: TrainConfig, task: Task, argv: list[str] | None = None) -> int:
    """Train `task` to cfg.steps (resuming if possible). Returns 0, or REQUEUE_EXIT_CODE when preempted.

    `argv` is the command line that made `cfg` (`python -m job ARGV`), recorded for `python -m job rerun`.
    `cfg` has passed `config.validate(cfg, task)`: `entry.train` runs it before anything starts."""
    timer = Goodput()
    # a preemption signal is heard in every phase: joining, start-up, the first compilation, evaluation and
    # saves end with the last finished step saved and REQUEUE_EXIT_CODE. USR1 and USR2 from here; SIGTERM
    # once the processes have joined (until then it ends a process, as the launcher's stop must)
    with PreemptionGuard(NOTICES) as guard:
        info = initialize()
        guard.joined()
        with process_log.teed(cfg.run_dir, info.process_id):  # RUN_DIR/logs/process-N.log, beside the console
            return Training(cfg, task, argv, timer, info, guard).run()


class Training:
    """One run of the loop, in the phases a reader finds by name:

    build (mesh, data, the planned state, the jitted steps: `plan.build_run`) -> compile the train step (for the
    state's abstract shapes, remat auto chosen: `plan.compile_step`; the state's init and the eval step compile
    on threads meanwhile, job/train/aside.py) -> restore (the newest checkpoint, else a fresh state created as its
    shards) -> compile the eval step (`plan.compile_ahead`; then every process meets) -> step (one optimizer step,
    then logging, evaluate and save as due) -> finish (the last save, the summary). `run` strings them together."""

    # made by the phases, in this order: restore (checkpoints, origin), then open_records (report, profiler)
    checkpoints: Checkpoints  # both tiers: the loop asks it, and decides nothing about tiers
    origin: Origin  # where the state came from: the step, the tier and the source
    report: Reporter
    profiler: StepProfiler

    def __init__(self, cfg: TrainConfig, task: Task, argv: list[str] | None, timer: Goodput,
                 info: ClusterInfo, guard: PreemptionGuard) -> None:
        self.cfg, self.task, self.argv, self.timer, self.info, self.guard = cfg, task, argv, timer, info, guard
        self.metrics: dict[str, jax.Array] = {}  # the last train step's
        self.evaluated: dict[str, dict[str, float]] = {}  # the last evaluation's, by split
        self.cache_events = CacheEvents()  # this process's cache hits and misses, every program of the run
        self.watch = StragglerWatch(cfg.straggler_ratio)
        self.began = time.perf_counter()  # the loop's own start (open_records), for summary.json's seconds
        # set by restore, read by open_records
        self.changed: list[resume.Change] = []  # the config fields changed since the saved run
        self.attempt = 1  # this attempt's number in the run dir's attempt record (process 0's: note_start)
        self.compile_s = 0.0  # this process's own time compiling the steps ahead (the barrier's wait excluded)
        self.remat = "none"  # what remat auto stands for in this run: chosen by compiling (plan.choose_remat)
        self.progress = Progress()  # where the loop is: the hang watchdog's roll call reads it
        self.hang = Hang(info, self.progress, cfg.watchdog_s)  # what this process does when the watchdog fires

    def run(self) -> int:
        """build, restore, compile, then step to cfg.steps (or a preemption), then finish: the exit code."""
        with self.cache_events:
            return self.phases()

    def phases(self) -> int:
        """`run`'s phases in order, counted by `self.cache_events`."""
        built = plan.build_run(self.cfg, self.task, self.info)
        expected = plan.expected_start(self.cfg, built.run_dir)  # the restore decides; made for it meanwhile:
        init = aside.init_aside(built.planned.init, expected)  # a fresh state's init and (compile_step) the eval
        evals: aside.EvalAside | aside.NoEvalAside = aside.NoEvalAside()  # step compile on threads meanwhile
        try:
            if expected < self.cfg.steps:
                made, evals = self.compile_step(built, expected)
            else:
                made = {}
            start, state = self.restore(built, init)
            if start >= self.cfg.steps:
                evals.settle()
                on_process_zero(log.info, "already complete at step %d; use a new --run-dir or raise --steps", start)
                self.checkpoints.close(completed=False)
                return 0
            if start not in made:  # restored elsewhere than expected: that step's batch (the compiled step takes
                if made:           # it), or, where nothing was compiled (expected complete), the compile now
                    made = {start: plan.first_batch(built.source, built.batch_sharding, step=start,
                                                    size=self.cfg.data.global_batch)}
                else:
                    made, evals = self.compile_step(built, start)
            self.open_records(built, start)
            self.compile(built, state, evals)
        except BaseException:
            init.settle()  # stopped before its programs were used: no compile left running at the exit
            evals.settle()
            raise
        if self.guard.should_stop():  # a signal during start-up (build, restore, compile): no step since the last save
            why = "stopped (Ctrl-C)" if self.guard.interrupted else "preempted"
            self.report.message("%s before the first step: nothing new to save; exiting with %d", why,
                                self.guard.exit_code)
            self.report.flush()
            self.timer.flush()
            self.checkpoints.close(completed=False)
            return self.guard.exit_code
        code, state = self.train(built, start, state, made)
        self.finish(built, state, code)
        return code

    def restore(self, built: Built, init: Callable[[], nnx.State]) -> tuple[int, nnx.State]:
        """(the step to start from, the state): the newest readable checkpoint's, else a fresh state (`init()`).
        A checkpoint of another state stops the run here (exit 2), with nothing touched."""
        cfg, run_dir = self.cfg, built.run_dir
        # --no-resume moves the earlier checkpoints aside here (checkpoints.moved)
        self.checkpoints = checkpoints = Checkpoints(run_dir, cfg.ckpt, built.planned.abstract, node_name(),
                                                     resume=cfg.resume, end=cfg.steps,
                                                     stopping=lambda: self.guard.stopping)
        self.changed = []
        newest = checkpoints.newest_specs()  # None with --no-resume
        if newest is not None:
            with preflight.raised_together("state_mismatch"):  # each process prints it before any exits
                self.changed = resume.check(run_dir, to_dict(cfg), *newest, built.planned.abstract)
        on_process_zero(_save_config, run_dir, cfg)
        on_process_zero(provenance.record, run_dir, self.argv, _topology(self.info, built.mesh), task=self.cfg.task)
        self.attempt = on_process_zero(attempts.note_start, run_dir) or self.attempt  # on record, numbered there
        restored = checkpoints.restore(init)
        self.origin = restored.origin
        return restored.origin.step, restored.state

    def open_records(self, built: Built, start: int) -> None:
        """The metrics writers, goodput, profiler and straggler watch, and the run's opening lines."""
        cfg, task, run_dir = self.cfg, self.task, built.run_dir
        self.report = report = Reporter(
            run_dir, start_step=start, total_steps=cfg.steps, shown=task.shown, unit=task.unit,
            items_per_step=cfg.data.global_batch * task.items_per_row(cfg.model), wandb=cfg.wandb, config=to_dict(cfg))
        on_process_zero(self.timer.resume, run_dir, start, self.attempt)
        self.profiler = StepProfiler(cfg.profile.steps, cfg.steps, run_dir, self.info.process_id)
        for line in plan.opening_lines(cfg, task, self.info, built, start, self.origin, self.changed,
                                       self.checkpoints.moved):
            report.message("%s", line)
        self.began = time.perf_counter()
        self.timer.started()

    def compile_step(self, built: Built, step: int) -> tuple[dict[int, dict[str, jax.Array]],
                                                               aside.EvalAside | aside.NoEvalAside]:
        """Before the restore: the batch of `step` and the train step compiled for it (`plan.compile_step`), the
        eval step compiling on a thread meanwhile, every process met at the barrier "step compiled": ({step: its
        batch}, which the first step uses, made once; the eval step compiling aside)."""
        with self.timer.part("compile"):
            batch, self.remat, seconds, evals = plan.compile_step(self.cfg, self.task, built, step)
        self.compile_s += seconds
        return {step: batch}, evals

    def compile(self, built: Built, state: nnx.State, evals: aside.EvalAside | aside.NoEvalAside) -> None:
        """The eval step compiled ahead (aside, while the train step compiled, where it is the chosen policy's
        program), every process met at the barrier "compiled" (`plan.compile_ahead`)."""
        with self.timer.part("compile"):
            self.compile_s += plan.compile_ahead(self.cfg, self.task, built, state, self.remat, evals)

    def train(self, built: Built, start: int, state: nnx.State,
              made: dict[int, dict[str, jax.Array]]) -> tuple[int, nnx.State]:
        """Steps start..cfg.steps-1, each followed by what is due; (exit code, the state at the end). `made`:
        batches already made, by step (the compiled-for first one), each handed on once and let go."""
        cfg, timer = self.cfg, self.timer

        def batch(step: int) -> dict[str, jax.Array]:
            if step in made:
                return made.pop(step)
            return global_batch(built.source, built.batch_sharding, split="train", step=step,
                                size=cfg.data.global_batch)

        with (contextlib.ExitStack() as stack, sharding.mesh_context(built.mesh, plan.run_rules(cfg, self.task)),
              choosing(self.remat), leaked_tracer_note()):
            stack.callback(self.profiler.stop)
            # however the loop ends (an error, too), the records so far are written; a full disk there is
            # a warning, not an error over the one that ended the loop (a failed save's CheckpointError)
            stack.callback(_written, self.report.flush, "metrics")
            stack.callback(_written, timer.flush, "goodput record")
            # the next 2 batches (rows and transfer) are made on a thread while this step runs; it stops with the loop
            upcoming = stack.enter_context(Prefetch(batch, range(start, cfg.steps)))
            watchdog = None
            for step in range(start, cfg.steps):
                state, stop = self.step(built, state, step, upcoming, first=step == start)
                if step == start:  # the first step after a restart (a failed attempt on record): the gap it cost
                    on_process_zero(attempts.note_resumed, built.run_dir, step + 1, start, self.origin.tier.value)
                if stop:  # the step is saved (`step` asked the checkpoints, which save a stop); finish says so
                    if step + 1 == cfg.steps:  # agreed at the last step: saved, the run is complete (0)
                        break
                    return self.guard.exit_code, state
                if watchdog is not None:
                    watchdog.kick()
                elif cfg.watchdog_s > 0:  # armed after the first step: compilation may take long
                    watchdog = stack.enter_context(Watchdog(cfg.watchdog_s, roll_call=self.hang.roll_call,
                                                                 before_exit=self.hang.leave))
        return 0, state

    def step(self, built: Built, state: nnx.State, step: int, upcoming: Prefetch[dict[str, jax.Array]], *,
             first: bool) -> tuple[nnx.State, bool]:
        """One optimizer step, then its logging, evaluation and save when due: (state, stop now)."""
        cfg, timer, report = self.cfg, self.timer, self.report
        done = step + 1
        logs = done % cfg.log_every == 0 or done == cfg.steps
        evaluates = bool(built.evaluator.plan) and (done % cfg.eval_every == 0 or done == cfg.steps)
        step_began = time.perf_counter()
        at = self.progress.at
        at(done, "input")
        with timer.part("input_wait"):
            next_batch = upcoming.get(step)
        at(done, "step")
        # the first step allocates what compiling it planned: an out-of-memory there (or at a later step) is one
        # error too, once a save under way has finished
        fits = memory.one_error(cfg, self.task, built.mesh, "its first step" if first else f"step {done}",
                                before=self.checkpoints.wait)
        beside = self.checkpoints.writing()  # a step slowed by the write beside it is the save's cost (goodput)
        with fits, self.profiler.step(done) as outputs, timer.step(beside_write=beside):  # a trace's start: not a step
            previous = self.metrics
            state, self.metrics = built.train_step(state, next_batch)
            at(done, "wait")
            host_s = time.perf_counter() - step_began  # this host's own part: its batch and the dispatch
            outputs.append(self.metrics)
            if first or logs or evaluates:  # what follows waits for it: time it here
                jax.block_until_ready(self.metrics)
            else:  # one step queued behind the running one, no more: a stop is agreed one step after its signal
                jax.block_until_ready(previous)
        if logs:
            at(done, "log")
            with timer.part("logging"):
                values = {k: float(v) for k, v in jax.device_get(self.metrics).items()}
                report.train(done, values, float(built.schedule(step)))
                report.hosts(done, self.watch.share())  # one all-gather of one number, on log steps only
                on_process_zero(timer.progress, built.run_dir, done)
        interrupted = False  # by a preemption signal during the evaluation: save this step and stop
        if evaluates:
            at(done, "eval")
            interrupted = not self.evaluate(built, state, done)
        at(done, "sync")
        with timer.part("steps"):  # the sync point (TPU, GPU) or a collective (CPU): part of a step's cost
            stop = interrupted or self.guard.should_stop(done)
        # after the step's last collective: every process has finished the step; the checkpoints say, once, whether
        # it is saved and in which tier (their cadences, the last step, the stop just agreed)
        tier = self.checkpoints.due(done)
        if tier is not None:
            with timer.part("steps"):  # the step itself, not the save's copy to the host
                jax.block_until_ready(self.metrics)
            at(done, "save")
            saving = time.perf_counter()
            with timer.part("checkpoint"):
                self.checkpoints.save(done, state, tier)
            report.checkpoint(done, time.perf_counter() - saving)
        if not first and not (evaluates or tier is not None):  # a step's time: no compilation, evaluation or save
            self.watch.add(host_s, time.perf_counter() - step_began)
        return state, stop

    def stopped_line(self, code: int) -> str:
        """What a stopped run says once its save is written: the step, the exit code, and the time since the signal."""
        step, since = self.checkpoints.last_saved, self.guard.since_signal()
        timing = "" if since is None else f"; written {since:.1f} s after this process's signal"
        if self.guard.interrupted:
            return f"stopped (Ctrl-C): saved step {step}; exiting with {code}. The same command resumes from it{timing}"
        return f"preempted: saved step {step}; exiting with {code} (requeue){timing}"

    def evaluate(self, built: Built, state: nnx.State, done: int) -> bool:
        """Every eval split, each reported under its name; False when a preemption signal cut it short."""
        with self.timer.part("eval"):
            results = built.evaluator.run(state, self.guard.should_stop)
        if results is None:
            return False
        self.evaluated = results
        for split, metrics in results.items():
            self.report.eval(done, metrics, split=split)
        return True

    def finish(self, built: Built, state: nnx.State, code: int) -> None:
        """The saves written, the goodput split, and summary.json."""
        cfg, task, timer = self.cfg, self.task, self.timer
        with timer.part("checkpoint"):
            self.checkpoints.wait()
            self.checkpoints.close(completed=code == 0 and self.checkpoints.last_saved == cfg.steps)
        if code:  # written: the process leaves within seconds (nothing after this reads the state)
            self.report.message("%s", self.stopped_line(code))
        timer.seconds["profile"] = self.profiler.seconds
        mine = np.array([self.cache_events.hits, self.cache_events.misses, self.compile_s], np.float32)
        counts = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)  # one small all-gather
        split = {**timer.finish(), "compile_cache": compile_cache.summary_entry(built.cache_dir, counts.tolist())}
        on_process_zero(timer.progress, built.run_dir, self.checkpoints.last_saved, "end")
        self.report.message("%s", describe(split))
        final = jax.device_get(self.metrics)
        trained = None if code else nnx.state(nnx.merge(built.planned.graphdef, state)["model"], nnx.Param)
        self.report.close({
            "final_step": self.checkpoints.last_saved,
            "completed": code == 0,
            "exit_code": code,  # 75: preempted (requeue me), 130: stopped with Ctrl-C (job/core/exits.py)
            "task": task.name,
            "parameters": built.planned.params,
            "train_loss": float(final["loss"]) if final else None,
            **summary_fields(task.eval_splits, self.evaluated, task.shown, bool(cfg.ema.decay)),
            "seconds": round(time.perf_counter() - self.began, 3),
            # jitted: an eager norm of sharded leaves is a chain of cross-process additions that can
            # interleave differently on each process and hang (seen under fsdp on 2 processes)
            # a stopped run's are left out: seconds of device work and transfer for a large model, while a
            # preempted VM has about 30 s after its notice; the run that completes gives them
            "params_norm": None if trained is None else float(jax.jit(optax.tree.norm)(trained)),
            "params_sha256": None if trained is None else fingerprint(trained),
            "slowest_hosts": self.watch.slowest(),  # the processes named as stragglers, each at its slowest
            "goodput": split,
        })


def _written(flush: Callable[[], None], what: str) -> None:
    try:
        flush()
    except OSError as exc:
        log.warning("could not write the %s at the end of the run: %s", what, exc)


def _topology(info: ClusterInfo, mesh: jax.sharding.Mesh) -> dict[str, object]:
    """Where the run ran, for its provenance record."""
    devices = jax.devices()
    return {"kind": info.kind, "processes": info.num_processes, "local_devices": jax.local_device_count(),
            "devices": len(devices), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "mesh": dict(mesh.shape), "hosts": len({d.process_index for d in devices})}


def _save_config(run_dir: epath.Path, cfg: TrainConfig) -> None:
    storage.make_dirs(run_dir)
    rundir.config(run_dir).write_text(to_json(cfg) + "\n")


# the step's plan, once defined here, now in job/train/plan.py
_MOVED = ("RunPlan", "first_batch", "plan_run", "run_mesh", "run_rules", "train_step_of")


def __getattr__(name: str) -> Any:
    """The plan's old names here (`job.train.loop.plan_run`, ...) still answer, with a DeprecationWarning."""
    if name in _MOVED:
        warnings.warn(f"job.train.loop.{name} is now job.train.plan.{name}", DeprecationWarning, stacklevel=2)
        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
