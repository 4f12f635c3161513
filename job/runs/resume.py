"""Resuming a run dir: what it holds must be what this run builds, or nothing is touched.

    python -m job train --run-dir R --steps 4 --ckpt.every 2      # checkpoints 2 and 4
    python -m job train --run-dir R --steps 8 --model.layers 3     # exit 2: --model.layers saved 2, given 3
    python -m job train --run-dir R --steps 8                      # resumes from step 4

A resubmit with a changed flag is not a damaged checkpoint. Before anything is
restored, set aside or rewritten, `check` compares the newest checkpoint's tree
metadata (every leaf's path, shape and dtype) with the state this run built,
and the run dir's `config.json` with this run's config. A state that differs
stops the run with one `StateMismatch` that lists every differing flag (saved
value, given value) and the fixes; flags that leave the state as it was (steps,
learning rate, cadences, ...) may change, and the run says which did. Only a
checkpoint whose files fail to read is set aside (`Checkpointer.restore_newest`),
and a run dir whose checkpoints were all set aside is never trained from step 0
over (`refuse_fresh_start_over_set_aside`); `--no-resume` starts afresh and
moves the old checkpoints aside, never deleting them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from etils import epath

from job.core import rundir, storage
from job.core.errors import ConfigError
from job.core.flags import flatten
from job.parallel.multihost import barrier, on_process_zero
from job.parallel.trees import leaf_specs
from job.runs.checkpoint import SET_ASIDE

log = logging.getLogger(__name__)

FRESH_START = rundir.FRESH_START  # where --no-resume moves the old checkpoints
# Config fields that say where and how the run is run, not what it is: never reported as changed.
NOT_COMPARED = frozenset({"run_dir", "resume"})
# Fields that leave the state's structure and shapes as they are: free to change on resume (the run
# says which did), and never named as the cause of a state that differs.
FREE = ("steps", "log_every", "eval_every", "eval_full", "watchdog_s", "straggler_ratio", "compile_cache",
        "compile_timeout_s", "seed", "ckpt.", "wandb.", "profile.", "data.eval_batches",
        "optim.lr", "optim.warmup_steps", "optim.min_lr_ratio", "optim.schedule", "optim.decay_fraction",
        "optim.decay_steps",
        "mesh", "rule", "model_axis")  # the state's layout over the devices, not its shapes: it restores onto any
SHOWN_LEAVES = 3  # at most this many differing state leaves are named in the error


class StateMismatch(ConfigError):
    """The run dir's checkpoints hold another state than the one this run builds (bad input: exit 2)."""


def flag(name: str) -> str:
    """A dotted config field as the CLI spells it: `data.global_batch` -> `--data.global-batch`."""
    return "--" + name.replace("_", "-")


class Change(NamedTuple):
    """A config field that differs between the saved run and this one."""

    name: str  # dotted: `data.global_batch`
    saved: object  # None: the saved run's config.json lacks the field
    given: object  # None: this run's config lacks it


def config_changes(saved: Mapping[str, Any], given: Mapping[str, Any]) -> list[Change]:
    """A Change for every field that differs; a field only one side has shows as None on the other."""
    old, new = flatten(saved), flatten(given)
    names = sorted((set(old) | set(new)) - NOT_COMPARED)
    return [Change(name, old.get(name), new.get(name)) for name in names if old.get(name) != new.get(name)]


def is_free(name: str) -> bool:
    """True for a dotted field that leaves the train state's structure and shapes as they are."""
    return any(name == free or (free.endswith(".") and name.startswith(free)) for free in FREE)


def state_differences(saved: Mapping[str, tuple], built: Mapping[str, tuple]) -> list[str]:
    """One line per leaf that is only in one of the two states or differs in shape or dtype."""
    lines = [f"{path}: saved, not built by this run" for path in sorted(set(saved) - set(built))]
    lines += [f"{path}: built by this run, not in the checkpoint" for path in sorted(set(built) - set(saved))]
    for path in sorted(set(saved) & set(built)):
        (old_shape, old_dtype), (new_shape, new_dtype) = saved[path], built[path]
        if (old_shape, old_dtype) != (new_shape, new_dtype):
            lines.append(f"{path}: saved {old_dtype}{list(old_shape)}, built {new_dtype}{list(new_shape)}")
    return lines


def saved_config(run_dir: epath.Path) -> dict[str, Any] | None:
    """The run dir's config.json, or None when it has none (or one that does not parse)."""
    return rundir.document(rundir.config(run_dir))


def check(run_dir: epath.Path, given: Mapping[str, Any], step: int, saved_specs: Mapping[str, tuple],
          state: Any) -> list[Change]:
    """The config fields changed since the run dir's config.json, once the checkpoint of `step` (whose
    leaves are `saved_specs`) is known to hold the state this run built; else StateMismatch."""
    saved = saved_config(run_dir)
    changes = config_changes(saved, given) if saved is not None else []
    differences = state_differences(saved_specs, leaf_specs(state))
    if not differences:
        return changes
    suspects = [change for change in changes if not is_free(change.name)]
    if suspects:
        found = "; ".join(f"{flag(name)} saved {old!r}, given {new!r}" for name, old, new in suspects)
        back = " ".join(f"{flag(name)} {old}" for name, old, _ in suspects if old is not None)
        original = f"rerun with the saved flags ({back}), " if back else "rerun with the saved flags, "
    else:  # the same flags: the code changed (a renamed layer, a new optimizer, a library upgrade)
        found = "the same flags, but a state built differently (changed code or library versions)"
        original = "rerun with the code and versions that wrote it, "
    shown = differences[:SHOWN_LEAVES] + ([f"and {len(differences) - SHOWN_LEAVES} more"]
                                          if len(differences) > SHOWN_LEAVES else [])
    raise StateMismatch(
        f"--run-dir {run_dir}", expected=f"a train state like the one its checkpoint step {step} holds "
        f"(checkpoints are kept as they are)", found=f"{found}. State leaves that differ: {'; '.join(shown)}",
        fix=f"{original}or pass a new --run-dir, or pass --no-resume to start afresh "
            f"(the old checkpoints are moved aside to {run_dir}/{FRESH_START}TIME, never deleted)")


def set_aside_steps(directory: epath.Path) -> list[str]:
    """Names of the checkpoints Checkpointer set aside as unreadable in `directory`."""
    try:
        return sorted(p.name for p in directory.iterdir() if SET_ASIDE in p.name)
    except OSError:
        return []


def refuse_fresh_start_over_set_aside(directory: epath.Path) -> None:
    """ConfigError when `directory` holds checkpoints that were set aside and none to resume from: a run
    never trains from step 0 over a run dir that holds checkpoints without being told to."""
    aside = set_aside_steps(directory)
    if aside:
        raise ConfigError(
            f"checkpoints in {directory}", expected="a readable checkpoint to resume from",
            found=f"none readable; set aside as unreadable: {', '.join(aside)}",
            fix=f"move a set-aside step back (e.g. {directory / aside[-1].split(SET_ASIDE)[0]}) if it reads, "
                "or pass --no-resume to start afresh (they stay where they are), or pass a new --run-dir")


def holds_checkpoints(directory: epath.Path) -> bool:
    """True when `directory` holds any step folder, complete, interrupted or set aside."""
    try:
        return any(p.name.split(".")[0].isdigit() for p in directory.iterdir())
    except OSError:  # no folder yet
        return False


def move_aside_for_fresh_start(directory: epath.Path) -> epath.Path | None:
    """--no-resume over existing checkpoints: the whole folder moves aside (by process 0; every process
    calls this together), so the new run's steps never mix with the old ones and nothing is deleted.
    Returns where it went, or None when there was nothing to move."""
    found = holds_checkpoints(directory)
    # every process looks before process 0 moves anything, and every process meets both barriers
    # whatever it found (a process that looked after the move would skip a barrier the others wait in)
    barrier(f"fresh start: looked in {directory}")
    target = directory.with_name(f"{FRESH_START}{int(time.time())}")
    if found:
        on_process_zero(_move_earlier_run_aside, directory, target)
    barrier(f"fresh start: moved {directory} aside")
    storage.forget_listings(directory.parent)
    return target if found else None


def _move_earlier_run_aside(directory: epath.Path, target: epath.Path) -> None:
    storage.move_aside(directory, target)
    log.warning("--no-resume: moved the checkpoints of the earlier run to %s", target)
