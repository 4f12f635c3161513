"""`make rehearse ARGS='train --task mypkg.tasks:TASK ...'`: a task proven on this machine's CPU before a queue.

    python -m deploy.rehearse train --task mypkg.tasks:TASK --model.dim 64
    python -m deploy.rehearse --steps 8 --args 'train --task classify'      # what make passes (STEPS=8)

ARGS' model flags, rule and batch are taken as given. Only what must shrink is overridden, on every run:
--steps S (6), --eval-every S, --log-every 1, --ckpt.every S/2, --run-dir (a run in a temporary folder), and
--optim.decay-steps S unless ARGS give one (the learning-rate schedule of a run stopped at S/2 is then the one
of a run of S steps). Each check is real runs of `python -m job.launch -n N --devices-per-process D -- python
-m job ...` on local CPU processes:

    args      ARGS parse, validate, and their global batch splits over 4 devices (before anything runs)
    topology  S steps on 2 processes x 2 devices and on 1 x 4: every step's train loss within 1e-4 relative
    resume    S/2 steps on 2 x 2, then the same with --steps S: the losses after the resume and params_sha256
              equal the straight 2 x 2 run's bitwise
    eval      `python -m job eval` of the straight run on 2 x 2: RUN_DIR/eval-S.json's metrics equal the run's
              own last evaluation within 1e-6 relative

One line per check (deploy/checks.py's format); a run that fails is its check's FAIL line with the last
error its processes printed, and the checks that need that run are skipped. Exit 0 when every check
passes, 1 when one fails, 2 when ARGS do not check (nothing runs). The folder is removed when every check
passes, kept and named when one fails (each run's output in NAME.log beside its run dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from deploy import row_contract
from deploy.checks import Check, failed, report
from deploy.runner import Runner, shell_words
from job.core import flags, rundir, values
from job.core.errors import BAD_INPUT_EXIT_CODE, ConfigError
from job.launch import command_line
from job.observe.plot import series
from job.train import sweep_check
from job.train.evaluation import RESERVED_SPLITS
from job.train import task as tasks

DEFAULT_STEPS = 6
TOPOLOGY_RTOL = 1e-4  # another layout reduces in another order: float noise, not another model
EVAL_RTOL = 1e-6
NOT_METRICS = ("rows", "batches")  # what eval-S.json says of a split beside its metrics
_ERROR = re.compile(r"(error: |[A-Za-z_][\w.]*(Error|Exception|Mismatch)\b)")
_RANK = re.compile(r"^\[rank \d+\] ")
_LAUNCHER = "[launch] "
K = TypeVar("K")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Processes x CPU devices each: the same 4 devices, cut another way."""

    processes: int
    devices: int

    def __str__(self) -> str:
        return f"{self.processes} x {self.devices}"


WIDE = Layout(2, 2)  # the straight run's, the resume's and eval's
TALL = Layout(1, 4)
DEVICES = 4


def skipped(name: str, needs: str) -> Check:
    """A check not run because a run it needs failed: neither ok nor a failure of its own."""
    return Check.skip(name, f"not run: it needs {needs}, which failed")


@dataclasses.dataclass(frozen=True)
class Shrink:
    """What the rehearsal overrides in ARGS: the length, how often it logs, evaluates and saves, where it runs."""

    steps: int
    pin_horizon: bool  # ARGS give no --optim.decay-steps: pass S, so a run stopped at S/2 has the same schedule

    @classmethod
    def of(cls, args: Sequence[str], steps: int) -> Shrink:
        return cls(steps, flags.value(args, "--optim.decay-steps", "0") == "0")

    @property
    def half(self) -> int:
        return self.steps // 2

    def overrides(self, steps: int | None = None) -> list[tuple[str, str]]:
        """(flag, value) of each override but --run-dir; `steps`: the resume's first part."""
        total = str(self.steps)
        given = [("--steps", str(steps or self.steps)), ("--eval-every", total), ("--log-every", "1"),
                 ("--ckpt.every", str(self.half))]
        return given + ([("--optim.decay-steps", total)] if self.pin_horizon else [])

    def argv(self, args: Sequence[str], run_dir: Path, steps: int | None = None) -> list[str]:
        """ARGS with each override in place of the value they give, else after them: `python -m job ARGV`."""
        words = list(args)
        for flag, value in [*self.overrides(steps), ("--run-dir", str(run_dir))]:
            given = flags.value(words, flag) is not None
            words = flags.with_value(words, flag, value) if given else [*words, flag, value]
        return words

    def said(self) -> str:
        """The output's first line: exactly what is overridden, and where it runs."""
        given = " ".join(f"{flag} {value}" for flag, value in self.overrides())
        return (f"rehearse: ARGS as given, but {given} and --run-dir in a temporary folder; on local CPU processes, "
                f"{WIDE} and {TALL} devices (the resume: --steps {self.half}, then --steps {self.steps} --resume)")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One finished launch: its exit code, its stderr, where its run dir and its whole output are."""

    name: str  # its log's name in the folder: '2x2', '1x4', 'resume-1', 'resume-2', 'eval'
    what: str  # in words: 'the 2 x 2 run'
    code: int
    stderr: str
    run_dir: Path
    log: Path

    @property
    def ok(self) -> bool:
        return self.code == 0

    def failure(self, check: str) -> Check:
        """A run that failed as `check`'s FAIL line: its exit code and the last error its processes printed."""
        said = last_words(self.stderr)
        fix = "" if "Fix:" in said else f"read the run's whole output in {self.log}"
        return Check(check, False, f"{self.what} exited {self.code}: {said}", fix=fix)


def last_words(stderr: str) -> str:
    """The meaningful last line of a launch's stderr: the last error a process printed, else the launcher's last
    word (which rank ended how), else the last line; without the [rank N] prefix."""
    lines = [_RANK.sub("", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if _ERROR.match(line)]
    launcher = [line for line in lines if line.startswith(_LAUNCHER)]
    return (errors or launcher or lines or ["no output"])[-1]


def first_difference(expected: Mapping[K, float], found: Mapping[K, float], keys: Iterable[K],
                     rtol: float) -> tuple[K, float | None, float | None] | None:
    """The first of `keys` (steps, metric names) whose values differ by more than `rtol` relative (0: bitwise), or
    is missing from either: (key, expected, found); None when every one agrees."""
    for key in keys:
        a, b = expected.get(key), found.get(key)
        if a is None or b is None or not (a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)):
            return key, a, b
    return None


def train_losses(run_dir: Path) -> dict[int, float]:
    """Each step's train loss in RUN_DIR/metrics.jsonl (a resumed run's own where it redid a step)."""
    return dict(zip(*series(rundir.records(rundir.metrics(run_dir)), "train", "loss"), strict=True))


def _tolerance(rtol: float) -> str:
    return f"{rtol:.0e}".replace("e-0", "e-")  # 1e-4


def _shown(value: float | None) -> str:
    return "nothing" if value is None else repr(value)


def topologies_agree(wide: Mapping[int, float], tall: Mapping[int, float], steps: int,
             rows: Callable[[], str | None] | None = None) -> Check:
    """The train losses of the same S steps on 2 x 2 and 1 x 4: within TOPOLOGY_RTOL, step by step. On a
    difference, `rows()` (when given) says where the task's rows break the contract they must keep
    (deploy/row_contract.py): the first differing step, row and field, or None when its rows keep it."""
    diff = first_difference(wide, tall, range(1, steps + 1), TOPOLOGY_RTOL)
    if diff is None:
        worst = max(abs(wide[s] - tall[s]) / max(abs(wide[s]), abs(tall[s]), 1e-30) for s in range(1, steps + 1))
        return Check("topology", True, f"{steps} train losses agree on {WIDE} and {TALL} devices within "
                     f"{_tolerance(TOPOLOGY_RTOL)} relative (largest difference {worst:.1e})")
    step, a, b = diff
    return Check("topology", False, f"the train loss of step {step} differs: {_shown(a)} on {WIDE}, {_shown(b)} on "
                 f"{TALL} (expected within {_tolerance(TOPOLOGY_RTOL)} relative)", fix=row_contract.fix(rows, steps))


def resume(straight: Mapping[int, float], resumed: Mapping[int, float], shrink: Shrink,
           sha: tuple[str | None, str | None]) -> Check:
    """The resumed run's losses after S/2 and its final params_sha256 against the straight run's: bitwise."""
    diff = first_difference(straight, resumed, range(shrink.half + 1, shrink.steps + 1), 0.0)
    if diff is not None:
        step, a, b = diff
        return Check("resume", False, f"losses after resume differ from step {step}: {_shown(b)} resumed, "
                     f"{_shown(a)} straight",
                     fix="is the source a pure function of (split, step, row)? is every rng stream in the model's "
                         "state? does a task's own optimizer take its schedule's length from its `steps` argument?")
    if sha[0] is None or sha[0] != sha[1]:
        return Check("resume", False, f"params_sha256 after resume differs: {sha[1]} resumed, {sha[0]} straight "
                     f"(the losses of steps {shrink.half + 1}-{shrink.steps} agree)",
                     fix="keep everything the step changes in the train state, so the checkpoint holds it (every "
                         "rng stream and counter the model carries)")
    return Check("resume", True, f"stopped at step {shrink.half} and resumed to {shrink.steps} on {WIDE}: the losses "
                 "after the resume and params_sha256 equal the straight run's bitwise")


def eval_agrees(runs_own: Sequence[Mapping[str, Any]], written: Mapping[str, Any] | None, step: int) -> Check:
    """`python -m job eval`'s eval-S.json against the run's own evaluation of step S in metrics.jsonl."""
    if written is None:
        return Check("eval", False, f"python -m job eval left no {rundir.evaluation(Path(), step)} in the run dir",
                     fix="read its output: it writes the file on process 0 after evaluating every split")
    own = {r["split"]: r for r in runs_own if r.get("step") == step and r.get("split") not in RESERVED_SPLITS}
    splits = written.get("splits", {})
    if not splits and not own:
        return Check.skip("eval", "the task evaluates no split (no eval split declared, or --data.eval-batches 0): "
                          "nothing to compare", to_run="a task with an eval split and --data.eval-batches over 0")
    for split in sorted({*splits, *own}):
        computed = _metrics(splits.get(split, {}), NOT_METRICS)
        logged = _metrics(own.get(split, {}), ("step", "split"))
        diff = first_difference(computed, logged, sorted({*computed, *logged}), EVAL_RTOL)
        if diff is not None:
            return _eval_differs(split, step, *diff)
    shown = ", ".join(f"{s} ({', '.join(sorted(k for k in splits[s] if k not in NOT_METRICS))})" for s in splits)
    return Check("eval", True, f"python -m job eval of step {step} on {WIDE} gives the run's own metrics within "
                 f"{_tolerance(EVAL_RTOL)} relative: {shown}")


def _metrics(record: Mapping[str, Any], besides: Sequence[str]) -> dict[str, float]:
    return {name: float(value) for name, value in record.items() if name not in besides}


def _eval_differs(split: str, step: int, name: str, computed: float | None, logged: float | None) -> Check:
    return Check("eval", False, f"split {split}'s {name} at step {step}: {_shown(computed)} from python -m job eval on "
                 f"{WIDE}, {_shown(logged)} in the run's {rundir.METRICS} (expected within {_tolerance(EVAL_RTOL)} "
                 "relative)", fix="the evaluation must depend only on the saved state and the eval rows: is the model "
                 "in eval mode (no dropout)? is every statistic it evaluates with (batch norm's, an EMA) in the train "
                 "state?")


def _params_sha256(run_dir: Path) -> str | None:
    found = rundir.document(rundir.summary(run_dir))
    return found.get("params_sha256") if isinstance(found, dict) else None


def cpu_env() -> dict[str, str]:
    """This environment, the job on CPU: the rehearsal's devices are this machine's CPU, whatever else it has."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


class Rehearsal:
    """The runs of one rehearsal of ARGS in `folder`, each launched through `runner`, and the checks of what they
    left: `checks()` yields each check's line as its runs end."""

    def __init__(self, args: Sequence[str], shrink: Shrink, folder: Path, runner: Runner) -> None:
        self.args, self.shrink, self.folder, self.runner = tuple(args), shrink, folder, runner

    def launch(self, name: str, what: str, layout: Layout, job: Sequence[str], run_dir: Path) -> Launch:
        """`python -m job JOB` on `layout` through the local launcher; its output kept in FOLDER/NAME.log."""
        argv = command_line(layout.processes, layout.devices, job)
        proc = self.runner.run(argv, check=False, capture=True, env=cpu_env())
        log = self.folder / f"{name}.log"
        log.write_text(f"$ {shlex.join(argv)}\n{proc.stdout or ''}{proc.stderr or ''}", encoding="utf-8")
        return Launch(name, what, proc.returncode, proc.stderr or "", run_dir, log)

    def train(self, name: str, what: str, layout: Layout, run: str, steps: int | None = None,
              resumes: bool = False) -> Launch:
        """ARGS shrunk, in FOLDER/RUN (`steps`: stop there; `resumes`: --resume, whatever ARGS say)."""
        run_dir = self.folder / run
        job = self.shrink.argv(self.args, run_dir, steps) + (["--resume"] if resumes else [])
        return self.launch(name, what, layout, job, run_dir)

    def checks(self) -> Iterator[Check]:
        wide = self.train("2x2", f"the {WIDE} run", WIDE, "2x2")
        if not wide.ok:
            yield wide.failure("topology")
            yield skipped("resume", wide.what)
            yield skipped("eval", wide.what)
            return
        tall = self.train("1x4", f"the {TALL} run", TALL, "1x4")
        yield topologies_agree(train_losses(wide.run_dir), train_losses(tall.run_dir), self.shrink.steps, self.rows) \
            if tall.ok else tall.failure("topology")
        yield self.resume(wide)
        yield self.evaluation(wide)

    def rows(self) -> str | None:
        """Where ARGS' task's own rows break the row contract, on this machine (deploy/row_contract.py)."""
        cfg = sweep_check.check_args(self.args)
        source = tasks.load(cfg.task).source(cfg.data, cfg.model)
        return row_contract.first_difference(source, cfg.data.global_batch, self.shrink.steps)

    def resume(self, wide: Launch) -> Check:
        """S/2 steps on 2 x 2, then the same command with --steps S: the rest against the straight run."""
        half, steps = self.shrink.half, self.shrink.steps
        first = self.train("resume-1", f"the resume's first part (--steps {half} on {WIDE})", WIDE, "resume", half)
        if not first.ok:
            return first.failure("resume")
        second = self.train("resume-2", f"the resumed run (--steps {steps} on {WIDE})", WIDE, "resume", resumes=True)
        if not second.ok:
            return second.failure("resume")
        if f"resumed from step {half} (" not in second.stderr:
            return Check("resume", False, f"{second.what} did not say 'resumed from step {half}': it started again "
                         f"instead of resuming the checkpoint of step {half}",
                         fix=f"read its output in {second.log}: was step {half}'s checkpoint saved (--ckpt.every)?")
        return resume(train_losses(wide.run_dir), train_losses(second.run_dir), self.shrink,
                      (_params_sha256(wide.run_dir), _params_sha256(second.run_dir)))

    def evaluation(self, wide: Launch) -> Check:
        """`python -m job eval --run-dir` of the straight run, on 2 x 2: eval-S.json against its metrics.jsonl."""
        ran = self.launch("eval", f"python -m job eval on {WIDE}", WIDE, ["eval", "--run-dir", str(wide.run_dir)],
                          wide.run_dir)
        if not ran.ok:
            return ran.failure("eval")
        step = self.shrink.steps
        return eval_agrees(rundir.records(rundir.metrics(wide.run_dir)),
                          rundir.document(rundir.evaluation(wide.run_dir, step)), step)


def check_args(args: Sequence[str], shrink: Shrink) -> Check:
    """ARGS, and the rehearsal's shrunk runs of them, parsed and validated as `python -m job train` does at its
    start, the global batch against the 4 devices: the input check, before anything runs."""
    if not args or args[0] != "train":
        return Check("args", False, f"ARGS: expected `train` first (a rehearsal trains), found {shlex.join(args)!r}",
                     fix=f"ARGS='train {shlex.join(args[1:] if args and not args[0].startswith('-') else args)}'")
    try:
        cfg = sweep_check.check_args(args)
        sweep_check.check_args(shrink.argv(args, Path("rehearsal")))
    except ConfigError as exc:
        return failed("args", exc)
    except Exception as exc:  # noqa: BLE001 (a task's module may raise anything as it is imported or validates)
        return Check("args", False, f"checking ARGS raised {type(exc).__name__}: {exc}",
                     fix="correct the task's code: every process of the job would fail the same way at its start")
    try:
        sweep_check.check_mesh(cfg, DEVICES)
    except ConfigError as exc:
        return failed("args", exc, where=f" on {DEVICES} devices ({WIDE} and {TALL})")
    return Check("args", True, f"task {cfg.task}: parses and validates, global batch {cfg.data.global_batch} splits "
                 f"over {DEVICES} devices ({WIDE} and {TALL})")


def parse(argv: Sequence[str]) -> tuple[tuple[str, ...], int]:
    """(ARGS, S): ARGS as words after the flags, or as one shell-style string in --args (what make passes)."""
    p = argparse.ArgumentParser(prog="python -m deploy.rehearse", description=__doc__.split("\n")[0],
                                epilog="then ARGS: train --task mypkg.tasks:TASK ... (or --args 'train ...')")
    p.add_argument("--steps", type=values.for_argparse(values.whole, minimum=2, fix="STEPS=6 (the resume stops at "
                   "half of it)"), default=DEFAULT_STEPS, help=f"S, the steps of each run (default {DEFAULT_STEPS})")
    p.add_argument("--args", type=shell_words, default=None, help="ARGS as one shell-style string")
    p.add_argument("words", nargs=argparse.REMAINDER, help="ARGS as words: train ...")
    parsed = p.parse_args(list(argv))
    if parsed.args is not None and parsed.words:
        p.error(f"expected ARGS once, found --args {shlex.join(parsed.args)!r} and {shlex.join(parsed.words)!r}. "
                "Fix: drop one")
    return (parsed.args if parsed.args is not None else tuple(parsed.words)), parsed.steps


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    args, steps = parse(sys.argv[1:] if argv is None else argv)
    shrink = Shrink.of(args, steps)
    print(shrink.said(), flush=True)
    checked = check_args(args, shrink)
    if not checked.ok:
        report([checked], before="rehearsing")
        print("nothing was run", flush=True)
        return BAD_INPUT_EXIT_CODE
    folder = Path(tempfile.mkdtemp(prefix="rehearse-"))
    started = time.monotonic()
    try:
        code = report(itertools.chain([checked], Rehearsal(args, shrink, folder, runner or Runner()).checks()),
                      before="queueing the job")
    except KeyboardInterrupt:
        print(f"stopped (Ctrl-C): the runs so far are kept in {folder}", flush=True)
        return 130
    if code:
        print(f"the rehearsal's runs are kept in {folder} (each run's output in NAME.log beside its run dir)",
              flush=True)
        return code
    shutil.rmtree(folder, ignore_errors=True)
    print(f"rehearsed in {time.monotonic() - started:.0f} s: every check passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
