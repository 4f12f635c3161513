"""A sweep: many runs from one command, each in its own folder of one sweep folder.

    SWEEP='optim.lr=1e-3,3e-3,1e-2 seed=0,1'      # a grid: 6 runs, the last name varying fastest
    SWEEP=sweeps/lr.txt                            # a sweep file: one run per line of flags

    sweep = plan("optim.lr=1e-3,3e-3 seed=0,1", ["train", "--steps", "40", "--run-dir", "runs/sweep1"])
    sweep.runs[1].name     # 'lr=1e-3,seed=1'
    sweep.runs[1].run_dir  # 'runs/sweep1/lr=1e-3,seed=1'
    sweep.runs[1].flags    # ('train', '--steps', '40', '--run-dir', 'runs/sweep1/lr=1e-3,seed=1',
                           #  '--optim.lr', '1e-3', '--seed', '1')

The base ARGS' `--run-dir` is the sweep folder; each run's folder in it is
named by its values, the same for the same spec every time, so submitting a
sweep again finds every run's own checkpoints. A sweep file holds one run per
line, `--name value` pairs (`--name=value` for a value that starts with '-';
a switch such as `--model.no-scan` alone), `#` starts a comment, blank lines
are skipped. Nothing here reads a config: `job/train/sweep_check.py` checks
every run as it would check itself at its start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import shlex
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from job.core import flags, rundir, storage, values
from job.core.errors import ConfigError, as_config_error
from job.runtime.cluster import environment

Values = tuple[tuple[str, str], ...]  # (dotted config name, value as given), in the order given

PLAN_FILE = rundir.SWEEP_PLAN  # SWEEP_DIR/sweep.json: the runs of a sweep, written before the first one starts
MAX_NAME = 120  # characters of a run's folder name; a longer one is cut and ends in '+' and a hash
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
_GRID_FIX = "write NAME=V1,V2,... words, e.g. SWEEP='optim.lr=1e-3,3e-3 seed=0,1'"
_NOT_SWEPT = ("run-dir",)  # the sweep sets it: SWEEP_DIR/NAME


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: its values, its folder's name, and the whole command line it runs."""

    name: str  # its folder's name inside the sweep folder, e.g. 'lr=1e-3,seed=1'
    values: Values  # its own values, in the spec's order
    run_dir: str  # SWEEP_DIR/name
    flags: tuple[str, ...]  # `python -m job FLAGS`: the base ARGS, its own values winning, its --run-dir


@dataclasses.dataclass(frozen=True)
class Sweep:
    spec: str  # the SWEEP as given: grid words or a sweep file's path
    folder: str  # the base ARGS' --run-dir: every run's folder is in it
    runs: tuple[Run, ...]


def _bad(word: str, expected: str, fix: str) -> ConfigError:
    return ConfigError(f"SWEEP word {word!r}", expected=expected, found=word, fix=fix)


def _key(name: str) -> str:
    """One spelling per config field (`warmup_steps` and `warmup-steps` are one flag)."""
    return name.replace("_", "-")


def _check_name(name: str, word: str, fix: str) -> None:
    if name.startswith("-"):
        raise _bad(word, "a config field without dashes, e.g. optim.lr", f"write {name.lstrip('-')}=... ({fix})")
    if not _NAME.fullmatch(name):
        raise _bad(word, "a config field as a dotted name: optim.lr, model.layers, seed", fix)
    if _key(name) in _NOT_SWEPT:
        raise _bad(word, "a field other than --run-dir (the sweep gives each run SWEEP_DIR/NAME)",
                   "give the sweep folder as --run-dir in ARGS")


def grid(words: Sequence[str]) -> tuple[Values, ...]:
    """`name=v1,v2 ...` -> every combination, in the order given, the last name varying fastest."""
    names: list[str] = []
    choices: list[list[str]] = []
    for word in words:
        name, eq, text = word.partition("=")
        if not eq:
            raise _bad(word, "NAME=V1,V2,... (a config field and its values)", _GRID_FIX)
        _check_name(name, word, _GRID_FIX)
        if any(q in text for q in "'\""):
            raise _bad(word, "values without quotes: a value that holds a comma or a space cannot be in the "
                       "grid form", "write those runs in a sweep file, one run per line (docs/sweeps.md#sweeps)")
        options = text.split(",")
        if "" in options:
            raise _bad(word, f"{name}=V1,V2,... with no empty value", f"remove the stray comma: {name}="
                       + ",".join(o for o in options if o))
        if len(set(options)) != len(options):
            raise _bad(word, f"each value of {name} once (two runs would share a folder)",
                       f"write {name}={','.join(dict.fromkeys(options))}")
        if _key(name) in map(_key, names):
            raise _bad(word, f"{name} once in the sweep", f"put every value of {name} in one word")
        names.append(name)
        choices.append(options)
    return tuple(tuple(zip(names, combo, strict=True)) for combo in itertools.product(*choices))


def read_file(path: str) -> tuple[Values, ...]:
    """A sweep file: one run per line of `--name value` flags (a switch alone), `#` comments, blank lines skipped."""
    try:
        text = storage.run_path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("SWEEP", expected="NAME=V1,V2,... words, or the path of a sweep file",
                          found=f"{path} ({type(exc).__name__}: {exc})",
                          fix=f"{_GRID_FIX}, or SWEEP=PATH of a file with one run per line of flags") from None
    runs: list[Values] = []
    seen: dict[tuple, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise ConfigError(f"{path} line {number}", expected="flags split as a shell splits them",
                              found=line, fix=f"close the quote ({exc})") from None
        if not words:
            continue
        run = _line(words, f"{path} line {number}")
        key = tuple((_key(n), v) for n, v in run)
        if key in seen:
            raise ConfigError(f"{path} line {number}", expected="each run once (two runs would share a folder)",
                              found=line, fix=f"remove it: line {seen[key]} is the same run")
        seen[key] = number
        runs.append(run)
    if not runs:
        raise ConfigError("SWEEP", expected="a sweep file with at least one run", found=path,
                          fix="write one run per line, e.g. --optim.lr 1e-3 --seed 0")
    return tuple(runs)


def _line(words: list[str], where: str) -> Values:
    """One line's (name, value) pairs; a switch alone (`--model.no-scan`) reads as ('model.scan', 'false')."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        flag, eq, value = word.partition("=")
        if not flag.startswith("--"):
            raise ConfigError(where, expected="--name value pairs", found=word,
                              fix="write each run as flags, e.g. --optim.lr 1e-3 --seed 0")
        name = flag[2:]
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value, eq, i = words[i + 1], "=", i + 1
        if not eq:  # a switch: --x or --a.no-x
            head, _, last = name.rpartition(".")
            value = "false" if last.startswith(("no-", "no_")) else "true"
            if value == "false":
                name = f"{head}.{last[3:]}" if head else last[3:]
        _check_name(name, f"{where}: {word}", "write --name value")
        if _key(name) in (_key(n) for n, _ in pairs):
            raise ConfigError(where, expected=f"--{name} once per run", found=shlex.join(words),
                              fix=f"keep one --{name}")
        pairs.append((name, value))
        i += 1
    return tuple(pairs)


def parse(spec: str) -> tuple[Values, ...]:
    """The runs a SWEEP says: grid words, or one word without '=' naming a sweep file."""
    words = spec.split()
    if not words:
        raise ConfigError("SWEEP", expected="NAME=V1,V2,... words or a sweep file", found=spec, fix=_GRID_FIX)
    if len(words) == 1 and "=" not in words[0]:
        return read_file(words[0])
    return grid(words)


def short_names(names: Sequence[str]) -> dict[str, str]:
    """Each dotted name's shortest unambiguous form: its last part, unless another name ends the same."""
    last = [name.rpartition(".")[2] for name in names]
    return {name: tail if last.count(tail) == 1 else name for name, tail in zip(names, last, strict=True)}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def run_names(runs: Sequence[Values]) -> list[str]:
    """Folder names, stable for a spec: 'lr=1e-3,seed=1'. Characters outside [A-Za-z0-9._=,+-] become '_';
    names that would then be alike, or longer than MAX_NAME, end in '+' and a hash of the run's values."""
    short = short_names(list(dict.fromkeys(name for run in runs for name, _ in run)))
    raw = [",".join(f"{short[n]}={v}" for n, v in run) for run in runs]
    names = [_UNSAFE.sub("_", text) for text in raw]
    alike = {n for n in names if names.count(n) > 1}
    out = []
    for text, name in zip(raw, names, strict=True):
        if name in alike or len(name) > MAX_NAME:
            name = f"{name[:MAX_NAME - 9]}+{_digest(text)}"
        out.append(name)
    return out


def run_flags(base: Sequence[str], own: Values, run_dir: str, switches: Collection[str] = ()) -> tuple[str, ...]:
    """The base words with each of `own`'s flags removed, then its run dir and `--name value` for each value.
    A name in `switches` (a bool field, hyphen-spelled) becomes `--name` or `--no-name`."""
    out = flags.with_value(list(base), "--run-dir", run_dir)
    bools = {_key(s) for s in switches}
    for name, value in own:
        if _key(name) in bools:
            head, _, last = name.rpartition(".")
            off = f"{head}.no-{last}" if head else f"no-{last}"
            gone = {*flags.spellings(f"--{name}"), *flags.spellings(f"--{off}")}
            out = [word for word in out if word not in gone]
            with as_config_error(f"SWEEP value {name}={value}",
                                 fix=f"--{name} is on or off: write {name}=true,false"):
                on = values.switch(value)
            out.append(f"--{_key(name)}" if on else f"--{_key(off)}")
        else:
            out = [*flags.without(out, f"--{name}"), f"--{_key(name)}", value]
    return tuple(out)


def plan(spec: str, base: Sequence[str], switches: Collection[str] = ()) -> Sweep:
    """The sweep's runs: each one's name, run dir (inside the base's --run-dir) and flags."""
    base = list(base)
    if base and not base[0].startswith("-") and base[0] != "train":
        raise ConfigError("ARGS", expected="the flags of python -m job train (a sweep trains)",
                          found=shlex.join(base), fix=f"start ARGS with train, or drop {base[0]!r}")
    folder = flags.value(base, "--run-dir")
    if not folder:
        raise ConfigError("ARGS", expected="--run-dir SWEEP_DIR: the folder that holds every run's folder",
                          found=shlex.join(base), fix="add e.g. --run-dir runs/sweep1 to ARGS")
    runs = parse(spec)
    folder = folder.rstrip("/") or folder
    made = []
    for name, own in zip(run_names(runs), runs, strict=True):
        run_dir = f"{folder}/{name}"
        made.append(Run(name=name, values=own, run_dir=run_dir, flags=run_flags(base, own, run_dir, switches)))
    return Sweep(spec=spec, folder=folder, runs=tuple(made))


def listing(sweep: Sweep) -> str:
    """What a dry run prints: one line per run, its run dir and its `python -m job` flags."""
    lines = [f"sweep {sweep.folder}: {len(sweep.runs)} run(s)"]
    lines += [f"  {run.run_dir}: python -m job {shlex.join(run.flags)}" for run in sweep.runs]
    return "\n".join(lines)


def save_plan(sweep: Sweep) -> None:
    """SWEEP_DIR/sweep.json: the runs, so that `python -m job runs` lists those that have not started."""
    folder = storage.run_path(sweep.folder)
    storage.make_dirs(folder)
    record = {"spec": sweep.spec, "folder": sweep.folder,
              "runs": [{"name": r.name, "values": [list(v) for v in r.values], "run_dir": r.run_dir,
                        "flags": list(r.flags)} for r in sweep.runs]}
    rundir.sweep_plan(folder).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def load_plan(folder: str | Path) -> Sweep | None:
    """The sweep.json in `folder` (its runs' dirs as found there, wherever it was written from), or None."""
    path = rundir.sweep_plan(storage.run_path(folder))
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        runs = tuple(Run(name=r["name"], values=tuple((str(n), str(v)) for n, v in r["values"]),
                         run_dir=f"{str(folder).rstrip('/')}/{r['name']}", flags=tuple(r["flags"]))
                     for r in record["runs"])
        return Sweep(spec=str(record["spec"]), folder=str(folder), runs=runs)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def element_flags(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[str, ...]:
    """`python -m job sweep-run SWEEP_DIR [INDEX]`: the flags of run INDEX (default: the cluster's array index,
    job.runtime.cluster) of the sweep.json in SWEEP_DIR: what an element of the sweep's job array runs."""
    usage = "python -m job sweep-run SWEEP_DIR [INDEX]"
    if len(argv) not in (1, 2):
        raise ConfigError("sweep-run", expected=usage, found=shlex.join(argv), fix="give the sweep folder, then "
                          "the run's index (an element of the sweep's job array is given its own by its cluster)")
    index: str | int | None
    if len(argv) == 2:
        what, index = "sweep-run INDEX", argv[1]
    else:
        cluster = environment(environ)
        what, index = f"sweep-run's array index ({cluster.kind})", cluster.array_index(environ)
    sweep = load_plan(argv[0])
    if sweep is None:
        raise ConfigError("sweep-run SWEEP_DIR", expected=f"a folder with the {PLAN_FILE} its submission wrote",
                          found=argv[0], fix="submit the sweep again (make submit-slurm SWEEP=...), which writes it")
    last = len(sweep.runs) - 1
    with as_config_error(what, expected=f"a run's index, 0..{last}", found="none" if index is None else index,
                         fix=f"pass the run's index (0..{last}), or run it as an element of the sweep's job array"):
        return sweep.runs[values.whole(str(index), maximum=last)].flags


__all__ = ["MAX_NAME", "PLAN_FILE", "Run", "Sweep", "Values", "element_flags", "grid", "listing", "load_plan", "parse", "plan",
           "read_file", "run_flags", "run_names", "save_plan", "short_names"]
