"""What every backend does with a sweep before it starts anything: check every run, save the plan, skip
the completed runs.

    todo = sweeps.runs_to_start("optim.lr=1e-3,3e-3 seed=0,1", ["train", "--run-dir", "runs/sweep1"], devices=8)
    todo.runs        # the runs not yet completed, in the sweep's order
    todo.indices     # their places in the sweep (the Slurm array's indices)
    todo.summary()   # '1 of 4 already complete, skipped: lr=1e-3,seed=0'
    sweeps.in_turn(todo, start, again="run the same command")   # start(run) -> its exit code, run by run

Every run is checked (`job.train.sweep_check`) before anything is written: one bad value is one
ConfigError naming the run and the value. Then `SWEEP_DIR/sweep.json` is written (each Slurm array
element and `python -m job runs` read it), and the runs already completed (`job.observe.status`)
are left out: running a sweep again resumes the unfinished runs from their own checkpoints. A backend
that runs one run at a time (this machine, one TPU slice) hands `in_turn` how it starts one.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
from collections.abc import Callable, Sequence

from job.observe.status import State, state_of
from job.runs.sweep import Run, Sweep, listing, save_plan
from job.train import sweep_check

log = logging.getLogger("deploy.sweeps")


@dataclasses.dataclass(frozen=True)
class Todo:
    sweep: Sweep
    indices: tuple[int, ...]  # the places in sweep.runs of the runs not yet completed

    @property
    def runs(self) -> tuple[Run, ...]:
        return tuple(self.sweep.runs[i] for i in self.indices)

    def summary(self, verb: str = "run") -> str:
        """'nothing to run: 4 of 4 complete', '1 of 4 already complete, skipped: NAME', or '4 run(s) to run'."""
        total, left = len(self.sweep.runs), len(self.indices)
        done = [run.name for i, run in enumerate(self.sweep.runs) if i not in self.indices]
        if not left:
            return f"nothing {'new ' if verb == 'submit' else ''}to {verb}: {total} of {total} complete"
        if done:
            return f"{len(done)} of {total} already complete, skipped: {', '.join(done)}; {left} to {verb}"
        return f"{left} run(s) to {verb}"


def runs_to_start(spec: str, args: Sequence[str], devices: int | None = None, *, save: bool = True) -> Todo:
    """Check every run (a ConfigError naming the first bad run, nothing written), write SWEEP_DIR/sweep.json
    (unless `save` is false), and find the runs to start: those not completed."""
    sweep = sweep_check.checked_sweep(spec, list(args), devices)
    if save:
        save_plan(sweep)
    left = tuple(i for i, run in enumerate(sweep.runs) if state_of(run.run_dir).state is not State.COMPLETED)
    return Todo(sweep, left)


def in_turn(todo: Todo, start: Callable[[Run], int], *, again: str) -> int:
    """Each run not yet completed, in the sweep's order, through `start` (which returns its exit code); the
    first that fails stops the sweep with its code, the runs after it not started. `again`: the command
    that resumes the sweep (completed runs skipped, the failed one resumed)."""
    for number, (index, run) in enumerate(zip(todo.indices, todo.runs, strict=True), 1):
        log.info("sweep run %d of %d (run %d of the sweep): %s -> %s", number, len(todo.runs), index, run.name,
                 run.run_dir)
        code = start(run)
        if code != 0:
            rest = [r.name for r in todo.runs[number:]]
            log.error("sweep run %s failed with exit code %d: the sweep stops here%s. Fix: see its output above, "
                      "then %s again (completed runs are skipped, this one resumes)", run.name, code,
                      f"; not started: {', '.join(rest)}" if rest else "", again)
            return code
    if todo.runs:
        log.info("sweep %s: all %d run(s) completed; python -m job runs %s shows them", todo.sweep.folder,
                 len(todo.runs), shlex.quote(todo.sweep.folder))
    return 0


__all__ = ["Todo", "in_turn", "listing", "runs_to_start"]
