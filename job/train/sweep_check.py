"""Every run of a sweep checked on the submitting machine, as each run checks itself at its start.

    python -m job sweep 'optim.lr=1e-3,3e-3 seed=0,1' -- train --steps 40 --run-dir runs/sweep1
    python -m job sweep sweeps/lr.txt --devices 8 -- train --run-dir runs/sweep1

For each run: its names are config fields, its flags parse (`config.parse`, the
parser `python -m job train` uses), `config.validate` passes (the task's own
`validate` included), and, with the number of devices known, its global batch
splits over the data-parallel devices (the loop's own rule). Every run is
checked; one ConfigError names the first failing run, its value and the fix,
and how many others fail. Nothing is written, started or queued.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
import sys
from collections.abc import Sequence

from job.core import values
from job.core.errors import ConfigError
from job.parallel import mesh_flag
from job.runs.sweep import Run, Sweep, listing, plan
from job.train import config
from job.train import task as tasks

SHOWN_FAILURES = 5  # other failing runs named in the error


def _fields(task: tasks.Task) -> dict[str, type]:
    """Every config field of `task`'s runs as a dotted, hyphen-spelled name -> its value's type."""
    found: dict[str, type] = {}

    def walk(node: object, prefix: str) -> None:
        if not dataclasses.is_dataclass(node):  # a field's value; `prefix` is the field's name and a dot
            found[prefix.removesuffix(".")] = type(node)
            return
        for field in dataclasses.fields(node):
            walk(getattr(node, field.name), f"{prefix}{field.name.replace('_', '-')}.")

    walk(config.defaults(task), "")
    return found


def switches(task: tasks.Task) -> frozenset[str]:
    """The bool fields of `task`'s config (`model.scan`): a sweep gives them as --x / --no-x."""
    return frozenset(name for name, kind in _fields(task).items() if kind is bool)


def checked_sweep(spec: str, base: Sequence[str], devices: int | None = None) -> Sweep:
    """The sweep's runs, each one checked (`check_runs`): a ConfigError before anything else happens."""
    words = list(base[1:] if base and base[0] == "train" else base)
    sweep = plan(spec, base, switches(tasks.load(tasks.task_name(words))))
    check_runs(sweep, devices)
    return sweep


def check_runs(sweep: Sweep, devices: int | None = None) -> None:
    """Every run checked; one ConfigError naming the first failing run (and how many others fail)."""
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ConfigError("devices", expected="a whole number >= 1, or None (not known)", found=devices,
                          fix="pass the job's total device count, e.g. 8")
    failures: list[tuple[Run, ConfigError]] = []
    for run in sweep.runs:
        try:
            check_run(run, devices)
        except ConfigError as exc:
            failures.append((run, exc))
    if not failures:
        return
    (run, first), others = failures[0], [r.name for r, _ in failures[1:]]
    fix = first.fix
    if others:
        named = ", ".join(others[:SHOWN_FAILURES]) + (", ..." if len(others) > SHOWN_FAILURES else "")
        fix += f". {len(others)} other run(s) fail too: {named}"
    raise ConfigError(f"sweep run {run.name!r}: {first.what}", expected=first.expected, found=first.found, fix=fix)


def check_run(run: Run, devices: int | None = None) -> config.TrainConfig:
    """One run's flags parsed and validated as `python -m job train` does before it starts: its config."""
    words = list(run.flags[1:] if run.flags and run.flags[0] == "train" else run.flags)
    task = tasks.load(tasks.task_name(words))
    fields = _fields(task)
    for name, value in run.values:
        key = name.replace("_", "-")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=2, cutoff=0.75)
            raise ConfigError(f"SWEEP name {name!r}", expected=f"a config field of the {task.name} task",
                              found=f"{name}={value}", fix=(f"did you mean {' or '.join(close)}? " if close else "")
                              + "python -m job train --help lists every flag")
    cfg = _parse(words, task)
    config.validate(cfg, task)
    # optax only here: deploy imports this module without a task (a task's own module imports jax anyway)
    from job.train import optimizers

    optimizers.for_task(task, cfg)  # an --optim.* value the task's own optimizer never reads is refused
    if devices is not None:
        check_mesh(cfg, devices)
    return cfg


def check_args(args: Sequence[str], devices: int | None = None) -> config.TrainConfig:
    """One command line (ARGS: `train --task ... --data.global-batch ...`) checked as `check_run` checks a sweep's
    run, the batch against `devices` when given: its config, or the first ConfigError."""
    return check_run(Run(name="ARGS", values=(), run_dir="", flags=tuple(args)), devices)


def _parse(words: list[str], task: tasks.Task) -> config.TrainConfig:
    """`config.parse`, its usage error (printed by tyro, then exit 2) turned into one ConfigError."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return config.parse(words, task)
    except SystemExit:
        raise ConfigError("flags", expected="flags that python -m job train parses", found=_reason(said.getvalue()),
                          fix="correct that value in SWEEP or ARGS (python -m job train --help lists every flag)"
                          ) from None


def _reason(text: str) -> str:
    """The lines of tyro's error box between its first two rules: 'Error parsing --optim.lr: ...'."""
    lines = [line.strip() for line in text.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and set(line) <= set("-─━═")]
    inside = lines[rules[0] + 1:rules[1]] if len(rules) >= 2 else lines
    return " ".join(line for line in inside if line) or text.strip()


def check_mesh(cfg: config.TrainConfig, devices: int) -> None:
    """The run's mesh on `devices` devices: --mesh's sizes multiply to them (or --model-axis divides them),
    the batch splits over the batch axes."""
    # jax only with --devices: deploy's sweeps import this module
    from jax.sharding import AbstractMesh

    # the rule the loop applies to its mesh at start
    from job.parallel.sharding import check_global_batch

    shape = mesh_flag.counted_shape(cfg.mesh, cfg.model_axis, devices)
    check_global_batch(cfg.data.global_batch, cfg.accum_steps, AbstractMesh(tuple(shape.values()), tuple(shape)))


def sweep_command(argv: list[str]) -> int:
    """`python -m job sweep SPEC [--devices N] -- ARGS...`: check every run, print each one's run dir and flags."""
    parser = argparse.ArgumentParser(prog="python -m job sweep", description=__doc__.split("\n")[0])
    parser.add_argument("spec", help="NAME=V1,V2 words in one argument, or a sweep file")
    devices = values.for_argparse(values.whole, minimum=1, fix="pass the job's total device count, e.g. 8")
    parser.add_argument("--devices", type=devices, default=None, help="the job's total device count, when known")
    parser.epilog = "then -- and the base ARGS of every run: train ... --run-dir SWEEP_DIR"
    cut = argv.index("--") if "--" in argv else len(argv)
    parsed, base = parser.parse_args(argv[:cut]), argv[cut + 1:]
    sweep = checked_sweep(parsed.spec, base, parsed.devices)
    print(listing(sweep))
    print(f"checked {len(sweep.runs)} run(s): every one parses and validates"
          + (f", and its batch splits over {parsed.devices} devices" if parsed.devices else ""), file=sys.stderr)
    return 0


__all__ = ["SHOWN_FAILURES", "check_args", "check_mesh", "check_run", "check_runs", "checked_sweep", "sweep_command",
           "switches"]
