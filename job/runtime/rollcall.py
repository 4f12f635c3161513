"""When a step does not end: which process is not where the others are.

The loop says where it is at each phase of each step (`Progress.at`: two attribute writes). When the hang
watchdog fires (job.runtime.watchdog), every process that can still answer posts where it is through the
coordination service's key-value store, and reads the others' answers for a few seconds:

    watchdog: roll call of 2 processes: process 1 on node2 is waiting for its batch of step 12 (its data
    source) while the others are at step 12's end (the stop check): process 1 is the one stuck

A process behind the furthest one is stuck where it is (its data source, a step it never dispatched); a
process that does not answer is frozen or gone; when every process is at the same place, none is behind
(a collective that does not end) and the report says so.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

KEY = "job/rollcall/"
LEFT_KEY = "job/rollcall-left/"  # a process that said its stacks and is leaving
# a step's phases in the loop's order: a process at an earlier phase of the same step is behind
PHASES = ("input", "step", "wait", "log", "eval", "save", "sync")
_WORDS = {
    "input": "waiting for its batch of step {step} (its data source)",
    "step": "in its own code of step {step}, before the step's collectives",
    "wait": "waiting for step {step}'s result (in its collectives)",
    "log": "logging step {step}",
    "eval": "evaluating at step {step}",
    "save": "saving step {step}'s checkpoint",
    "sync": "at step {step}'s end (the stop check)",
}


class Progress:
    """Where this process's training loop is: the step (1-based) and the phase of it."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = PHASES[0]

    def at(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase


@dataclasses.dataclass(frozen=True)
class Answer:
    process: int
    node: str
    step: int
    phase: str

    @property
    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else 0

    def where(self) -> str:
        return _WORDS.get(self.phase, "at step {step}").format(step=self.step)


@dataclasses.dataclass(frozen=True)
class Verdict:
    text: str  # one line for the watchdog's report
    culprit: Answer | None  # the process a retry should move away from (node "" when it did not answer); None: none
    missing: tuple[int, ...] = ()  # processes that did not answer


def verdict(answers: list[Answer], count: int, waited_s: float) -> Verdict:
    """Who is stuck, from every answer: the ones that did not answer, else the ones behind the furthest."""
    heard = {a.process for a in answers}
    missing = tuple(p for p in range(count) if p not in heard)
    head = f"roll call of {count} processes: "
    if missing:
        names = ", ".join(map(str, missing))
        text = (f"{head}process{'es' if len(missing) > 1 else ''} {names} did not answer within {waited_s:.0f} s "
                f"(frozen, or gone): {'they are' if len(missing) > 1 else 'it is'} the one stuck")
        return Verdict(text, Answer(missing[0], "", 0, PHASES[0]), missing)
    furthest = max(a.position for a in answers)
    behind = sorted((a for a in answers if a.position < furthest), key=lambda a: (a.position, a.process))
    ahead = next(a for a in answers if a.position == furthest)
    if not behind:
        return Verdict(f"{head}every process is {ahead.where()}: none is behind the others (a collective that does "
                       "not end)", None)
    stuck = behind[0]
    others = "; ".join(f"process {a.process} on {a.node} is {a.where()}" for a in behind)
    return Verdict(f"{head}{others} while the others are {ahead.where()}: process {stuck.process} on {stuck.node} "
                   "is the one stuck", stuck)


def roll_call(client: Any, me: Answer, count: int, wait_s: float) -> Verdict:
    """Post `me`, then read every process's answer until all `count` answered or `wait_s` passed."""
    client.key_value_set(f"{KEY}{me.process}", json.dumps(dataclasses.asdict(me)), allow_overwrite=True)
    began = time.monotonic()
    while True:
        answers = [Answer(**json.loads(value)) for _, value in client.key_value_dir_get(KEY)]
        if len(answers) >= count or time.monotonic() - began > wait_s:
            return verdict(answers, count, wait_s)
        time.sleep(0.2)


def leave_last(client: Any, process: int, count: int, wait_s: float) -> None:
    """The last thing before a process's watchdog ends it (job.runtime.leaving's `last`): the others say they are
    leaving, and process 0, whose exit ends every process still joined (its coordination service goes with it, and
    they abort), waits up to `wait_s` for `count` of them (those that answered the roll call), so each ends with the
    watchdog's code and its own report, not with an abort in the middle of it."""
    client.key_value_set(f"{LEFT_KEY}{process}", "1", allow_overwrite=True)
    if process != 0:
        return
    began = time.monotonic()
    while len(client.key_value_dir_get(LEFT_KEY)) < count and time.monotonic() - began < wait_s:
        time.sleep(0.1)
    time.sleep(0.5)  # their exits, after they said so


__all__ = ["KEY", "LEFT_KEY", "PHASES", "Answer", "Progress", "Verdict", "leave_last", "roll_call", "verdict"]
